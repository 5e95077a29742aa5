// W8A8 row kernel for CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 1-3); included by quant_int8_blocks.h inside
// namespace ascent_quant's anonymous namespace (I8Args, use_avx2 and prefetch_wo_avx2 come before it).
//
// x holds the int8 bits of q (the generic layout). Sixteen int8 weights and the matching x bytes are sign-extended
// to int16 and multiplied pairwise into int32 lanes (VPMADDWD: |pair sum| <= 2 * 128 * 128, exact), so the sums are
// exact and equal the generic path's. Each weight row is read front to back, prefetched ahead like the weight-only
// AVX2 kernels (rows are contiguous, so that also covers the next row).
#pragma once

// acc[m] = sum_k q_x[m, k] * W[n, k] for MB tokens of x (rows a.ldx apart).
template <int MB>
__attribute__((target("avx2,fma"))) void i8_row_avx2(const I8Args& a, int64_t n, const uint8_t* x, int32_t* acc) {
  const int8_t* w = a.w + n * a.k;
  __m256i s[MB][2];
  for (int m = 0; m < MB; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
  auto widen = [](const void* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  int64_t k = 0;
  for (; k + 32 <= a.k; k += 32) {
    if ((k & 63) == 0) prefetch_wo_avx2(reinterpret_cast<const uint8_t*>(w + k));
    const __m256i w0 = widen(w + k), w1 = widen(w + k + 16);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      s[m][0] = _mm256_add_epi32(s[m][0], _mm256_madd_epi16(w0, widen(x + m * a.ldx + k)));
      s[m][1] = _mm256_add_epi32(s[m][1], _mm256_madd_epi16(w1, widen(x + m * a.ldx + k + 16)));
    }
  }
  if (k + 16 <= a.k) {
    const __m256i w0 = widen(w + k);
    for (int m = 0; m < MB; ++m) s[m][0] = _mm256_add_epi32(s[m][0], _mm256_madd_epi16(w0, widen(x + m * a.ldx + k)));
    k += 16;
  }
  for (int m = 0; m < MB; ++m) {
    const __m256i t = _mm256_add_epi32(s[m][0], s[m][1]);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    int32_t dot = _mm_cvtsi128_si32(h);
    const int8_t* xr = reinterpret_cast<const int8_t*>(x + m * a.ldx);
    for (int64_t t2 = k; t2 < a.k; ++t2) dot += static_cast<int32_t>(xr[t2]) * static_cast<int32_t>(w[t2]);
    acc[m] = dot;
  }
}

// acc [mb, rows] (mb <= 4) for weight rows [n, n + rows), row after row.
void i8_block_avx2(const I8Args& a, int64_t n, int64_t rows, int64_t mb, const uint8_t* x, int32_t* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    int32_t one[4];
    switch (mb) {
      case 1: i8_row_avx2<1>(a, n + r, x, one); break;
      case 2: i8_row_avx2<2>(a, n + r, x, one); break;
      case 3: i8_row_avx2<3>(a, n + r, x, one); break;
      default: i8_row_avx2<4>(a, n + r, x, one); break;
    }
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}
