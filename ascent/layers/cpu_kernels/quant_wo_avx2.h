// Weight-only (W8A16 / W4A16) block kernels for CPUs with AVX2 + FMA but no AVX512 (e.g. AMD Zen 1-3); included by
// quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after quant_wo_blocks.h (WoArgs, the fp32
// x layout of the generic path: int8 K columns as they are, int4 de-interleaved 32-column blocks, zero padded).
//
// Each weight row is read front to back (the rows of a block one after another, so the weight stream is one linear
// sweep, prefetched a fixed distance ahead: rows are contiguous, so that also covers the next row). Weights become
// fp32 by sign extension and conversion; per group, d = x_g . q_g in fp32 lanes, then y += s_g * d; the group sums
// of the vector lanes and of the scalar K tail are kept apart and added at the end. Same math as wo8_block_avx512 /
// wo4_block_avx512, in 8-lane vectors.
#pragma once

#define ASCENT_WO_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t kWoAvx2PrefetchL1 = 1024;  // weight bytes ahead of the read position prefetched into L1
constexpr int64_t kWoAvx2PrefetchL2 = 4096;  // ... and into L2

bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok && g_force_generic != 1;
}

ASCENT_WO_AVX2 inline float hsum_wo_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

ASCENT_WO_AVX2 inline void prefetch_wo_avx2(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kWoAvx2PrefetchL1), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + kWoAvx2PrefetchL2), _MM_HINT_T1);
}

// d[m][2P], d[m][2P + 1] += (16 int8 weights b, as fp32) . x[m][0:16] for MB tokens (x rows ldx apart).
template <int MB, int NA>
ASCENT_WO_AVX2 inline void fma16_int8(__m128i b, const float* x, int64_t ldx, __m256 (&d)[MB][NA], int pair) {
  const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    d[m][2 * pair] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx), d[m][2 * pair]);
    d[m][2 * pair + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + 8), d[m][2 * pair + 1]);
  }
}

// fma16_int8 on 16 int8 weights read from memory: each 8-byte half is sign-extended straight from memory (one
// vpmovsxbd with a memory operand each), which saves the byte shift of the register form.
template <int MB, int NA>
ASCENT_WO_AVX2 inline void fma16_int8_at(const int8_t* w, const float* x, int64_t ldx, __m256 (&d)[MB][NA], int pair) {
  const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
  const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8))));
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    d[m][2 * pair] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx), d[m][2 * pair]);
    d[m][2 * pair + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + 8), d[m][2 * pair + 1]);
  }
}

// Accumulator pairs per token: enough independent FMA chains to cover the FMA latency (8 per step).
template <int MB>
constexpr int kWoAvx2Pairs = MB == 1 ? 4 : 2;

// The fp32 sum of MB tokens' NA accumulators each, scaled by s and added to y[m].
template <int MB, int NA>
ASCENT_WO_AVX2 inline void scale_into(const __m256 (&d)[MB][NA], float s, __m256 (&y)[MB]) {
  for (int m = 0; m < MB; ++m) {
    __m256 t = d[m][0];
    for (int c = 1; c < NA; ++c) t = _mm256_add_ps(t, d[m][c]);
    y[m] = _mm256_fmadd_ps(t, _mm256_set1_ps(s), y[m]);
  }
}

// One int8 row n against MB tokens: out[m] = sum_g s[n, g] * (x_g . q_g).
template <int MB>
ASCENT_WO_AVX2 void wo8_row_avx2(const WoArgs& a, int64_t n, const float* x, float* out) {
  constexpr int NP = kWoAvx2Pairs<MB>, NA = 2 * NP;
  const int8_t* w = static_cast<const int8_t*>(a.w) + n * a.ldw;
  __m256 y[MB];
  float tail[MB] = {};
  for (int m = 0; m < MB; ++m) y[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 d[MB][NA];
    float dt[MB] = {};
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < NA; ++c) d[m][c] = _mm256_setzero_ps();
    const int64_t k1 = (g + 1) * a.gs;
    int64_t k = g * a.gs;
    for (; k + 16 * NP <= k1; k += 16 * NP) {
      prefetch_wo_avx2(reinterpret_cast<const uint8_t*>(w + k));
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) fma16_int8_at<MB, NA>(w + k + 16 * p, x + k + 16 * p, a.ldx, d, p);
    }
    for (; k + 16 <= k1; k += 16) fma16_int8_at<MB, NA>(w + k, x + k, a.ldx, d, 0);
    for (; k < k1; ++k)
      for (int m = 0; m < MB; ++m) dt[m] += x[m * a.ldx + k] * static_cast<float>(w[k]);
    const float s = a.scale[n * a.groups + g];
    scale_into<MB, NA>(d, s, y);
    for (int m = 0; m < MB; ++m) tail[m] += dt[m] * s;
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum_wo_avx2(y[m]) + tail[m];
}

// Packed int4 bytes k / 2 .. k / 2 + 15 of a row; the row's last, partial 16 bytes come through a zeroed buffer (x is
// zero padded there).
ASCENT_WO_AVX2 inline __m128i int4_bytes(const uint8_t* w, int64_t k, int64_t ldw) {
  const int64_t left = ldw - k / 2;  // bytes of the row from here
  if (left >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
  alignas(16) uint8_t part[16] = {};
  std::memcpy(part, w + k / 2, static_cast<size_t>(std::max<int64_t>(left, 0)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(part));
}

// The 32 de-interleaved columns k .. k + 31 of packed int4 bytes b (low nibbles the first 16, high nibbles the next
// 16) into accumulator pairs P and P + 1.
template <int MB, int NA>
ASCENT_WO_AVX2 inline void fma32_int4(__m128i b, const float* x, int64_t ldx, __m256 (&d)[MB][NA], int pair) {
  const __m128i nib = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  fma16_int8<MB, NA>(_mm_sub_epi8(_mm_and_si128(b, nib), eight), x, ldx, d, pair);
  fma16_int8<MB, NA>(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nib), eight), x + 16, ldx, d, pair + 1);
}

// One packed int4 row n against MB tokens (16 bytes = 32 columns per load; groups are multiples of 32 columns).
template <int MB>
ASCENT_WO_AVX2 void wo4_row_avx2(const WoArgs& a, int64_t n, const float* x, float* out) {
  constexpr int NP = kWoAvx2Pairs<MB>, NA = 2 * NP;
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + n * a.ldw;
  __m256 y[MB];
  for (int m = 0; m < MB; ++m) y[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 d[MB][NA];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < NA; ++c) d[m][c] = _mm256_setzero_ps();
    const int64_t k1 = (g + 1) * a.gs;
    int64_t k = g * a.gs;
    for (; k + 16 * NP <= k1; k += 16 * NP) {  // NP / 2 loads of 32 columns
      prefetch_wo_avx2(w + k / 2);
#pragma GCC unroll 4
      for (int p = 0; p < NP; p += 2) fma32_int4<MB, NA>(int4_bytes(w, k + 16 * p, a.ldw), x + k + 16 * p, a.ldx, d, p);
    }
    for (; k < k1; k += 32) fma32_int4<MB, NA>(int4_bytes(w, k, a.ldw), x + k, a.ldx, d, 0);
    scale_into<MB, NA>(d, a.scale[n * a.groups + g], y);
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum_wo_avx2(y[m]);
}

// acc [mb, rows] for weight rows [n, n + rows) and the mb (1 or 2) tokens of x, row after row.
void wo_block_avx2(const WoArgs& a, bool int4, int64_t n, int64_t rows, int64_t mb, const float* x, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float one[2];
    if (int4) (mb == 1 ? wo4_row_avx2<1> : wo4_row_avx2<2>)(a, n + r, x, one);
    else (mb == 1 ? wo8_row_avx2<1> : wo8_row_avx2<2>)(a, n + r, x, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}
