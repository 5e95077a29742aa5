// W8A8 row kernel for CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 1-3); included by quant_int8_blocks.h inside
// namespace ascent_quant's anonymous namespace (I8Args and use_avx2 come before it).
//
// int8_linear widens x to int16 once per call (I8Args::x16, widen_x16); sixteen int8 weights are sign-extended to
// int16 and multiplied pairwise with them into int32 lanes (VPMADDWD: |pair sum| <= 2 * 128 * 128, exact), so the
// sums are exact and equal the generic path's. Per 32 weights: 2 sign-extending loads, 2 VPMADDWD (x straight from
// L1), 2 adds; widening x per weight row instead (as before) doubled the work of a batch-1 row and held the W8A8
// decode sweep at ~24 GB/s from L3 against the bf16 GEMV's 45. Each weight row is read front to back, one row after
// the other (one sequential stream per thread) with a non-temporal prefetch kInt8PrefetchNta bytes ahead on AMD CPUs
// (stream_prefetch.h; Intel CPUs take the T0 1 KiB + T1 4 KiB pair). Measured on
// a Zen 2 (2 threads, the 120 linears of a SmolLM2-135M decode step, DRAM-resident, interleaved in one process)
// against the weight-only kernels' T0 1 KiB + T1 4 KiB prefetches: W8A8 0.80-0.86x the time, W8A16 (its fixed-point
// kernel shares i8_span_avx2) 0.87x; NTA distances 640-1024 B were alike, 512 / 1280-1536 / 4096 B 0.87-0.88x, and
// 2048 B 0.98-1.0x.
#pragma once

constexpr int64_t kInt8PrefetchNta = 896;

// x16 [M, ldx] = the int8 bits of xq sign-extended (M * ldx values; ldx a multiple of 16).
__attribute__((target("avx2"))) void widen_x16(const uint8_t* xq, int64_t values, int16_t* x16) {
  for (int64_t i = 0; i < values; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + i),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i))));
}

// Exact dot products of int8 weights w with int16 x over columns [k0, k1) for MB token rows of x (ldx apart):
// lanes[m] holds 8 int32 partial sums, rest[m] the products of the last (k1 - k0) % 16 columns. Shared with the
// W8A16 fixed-point kernel (quant_wo8_fixed_avx2.h), which calls it per scale group.
template <int MB>
__attribute__((target("avx2,fma"))) inline void i8_span_avx2(const int8_t* w, const int16_t* x, int64_t ldx,
                                                             int64_t k0, int64_t k1, __m256i (&lanes)[MB],
                                                             int32_t (&rest)[MB]) {
  __m256i s[MB][2];
  for (int m = 0; m < MB; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
  auto widen = [](const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  auto xs = [&](int m, int64_t k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * ldx + k)); };
  const bool nta = ascent_prefetch::nta_streams();
  int64_t k = k0;
  for (; k + 32 <= k1; k += 32) {
    if ((k & 63) == 0) ascent_prefetch::stream_line(reinterpret_cast<const char*>(w + k), nta, kInt8PrefetchNta);
    const __m256i w0 = widen(w + k), w1 = widen(w + k + 16);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      s[m][0] = _mm256_add_epi32(s[m][0], _mm256_madd_epi16(w0, xs(m, k)));
      s[m][1] = _mm256_add_epi32(s[m][1], _mm256_madd_epi16(w1, xs(m, k + 16)));
    }
  }
  if (k + 16 <= k1) {
    const __m256i w0 = widen(w + k);
    for (int m = 0; m < MB; ++m) s[m][0] = _mm256_add_epi32(s[m][0], _mm256_madd_epi16(w0, xs(m, k)));
    k += 16;
  }
  for (int m = 0; m < MB; ++m) {
    lanes[m] = _mm256_add_epi32(s[m][0], s[m][1]);
    rest[m] = 0;
    for (int64_t j = k; j < k1; ++j) rest[m] += static_cast<int32_t>(x[m * ldx + j]) * static_cast<int32_t>(w[j]);
  }
}

// acc[m] = sum_k q_x[m, k] * W[n, k] for MB tokens of x16 (rows a.ldx apart).
template <int MB>
__attribute__((target("avx2,fma"))) void i8_row_avx2(const I8Args& a, int64_t n, const int16_t* x, int32_t* acc) {
  __m256i lanes[MB];
  int32_t rest[MB];
  i8_span_avx2<MB>(a.w + n * a.k, x, a.ldx, 0, a.k, lanes, rest);
  for (int m = 0; m < MB; ++m) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(lanes[m]), _mm256_extracti128_si256(lanes[m], 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    acc[m] = _mm_cvtsi128_si32(h) + rest[m];
  }
}

// acc [mb, rows] (mb <= 4) for weight rows [n, n + rows), row after row.
void i8_block_avx2(const I8Args& a, int64_t n, int64_t rows, int64_t mb, const int16_t* x, int32_t* acc) {
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
