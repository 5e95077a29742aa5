// W8A8 row kernel for CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 1-3); included by quant_int8_blocks.h inside
// namespace ascent_quant's anonymous namespace (I8Args and use_avx2 come before it).
//
// int8_linear widens x to int16 once per call (I8Args::x16, widen_x16); sixteen int8 weights are sign-extended to
// int16 and multiplied pairwise with them into int32 lanes (VPMADDWD: |pair sum| <= 2 * 128 * 128, exact), so the
// sums are exact and equal the generic path's. Per 32 weights: 2 sign-extending loads, 2 VPMADDWD (x straight from
// L1), 2 adds; widening x per weight row instead (as before) doubled the work of a batch-1 row and held the W8A8
// decode sweep at ~24 GB/s from L3 against the bf16 GEMV's 45. Calls of up to 4 tokens take the stream kernel at
// the end of this file instead (i8_linear_streams_avx2). Here each weight row is read front to back, one row after
// the other (one sequential stream per thread) with a non-temporal prefetch kInt8PrefetchNta bytes ahead on AMD CPUs
// (stream_prefetch.h; Intel CPUs take the T0 1 KiB + T1 4 KiB pair). Measured on
// a Zen 2 (2 threads, the 120 linears of a SmolLM2-135M decode step, DRAM-resident, interleaved in one process)
// against the weight-only kernels' T0 1 KiB + T1 4 KiB prefetches: W8A8 0.80-0.86x the time, W8A16 (its fixed-point
// kernel shares i8_span_avx2) 0.87x; NTA distances 640-1024 B were alike, 512 / 1280-1536 / 4096 B 0.87-0.88x, and
// 2048 B 0.98-1.0x.
#pragma once

constexpr int64_t kInt8PrefetchNta = 896;

// The sum of the 8 int32 lanes of v.
__attribute__((target("avx2"), always_inline)) inline int32_t hsum_epi32_avx2(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

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
  for (int m = 0; m < MB; ++m) acc[m] = hsum_epi32_avx2(lanes[m]) + rest[m];
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

// Side-by-side weight streams (as the bf16 rows of gemv_avx2.h): one stream per thread leaves a Zen 3's memory
// system idle between its prefetches. kI8Streams weight rows (rows[s], far apart) against MB token rows of the int8
// x (a.xq, ldx apart, no value -128): per 32 columns one 32-byte weight load, |w| (u8, at most 128) times x * sign(w)
// (s8) summed pairwise into int16 by VPMADDUBSW (|pair| <= 2 * 128 * 127 < 2^15: exact, never saturating) and
// widened pairwise into int32 by VPMADDWD with ones, so acc[s][m] is the exact sum the other paths compute. Against
// sign-extending both halves to int16 (i8_span_avx2) 1.3x the rate on one Zen 3 core from L3.
constexpr int kI8Streams = 4;

template <int S, int MB>
__attribute__((target("avx2,fma"))) void i8_rows_streams_avx2(const I8Args& a, const int64_t (&rows)[S],
                                                              const uint8_t* x, int32_t (&acc)[S][MB]) {
  const int8_t* w[S];
  __m256i s[S][MB];
#pragma GCC unroll 4
  for (int r = 0; r < S; ++r) {
    w[r] = a.w + rows[r] * a.k;
    for (int m = 0; m < MB; ++m) s[r][m] = _mm256_setzero_si256();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int r = 0; r < S; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
      const __m256i magnitude = _mm256_abs_epi8(wv);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * a.ldx + k));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv));
        s[r][m] = _mm256_add_epi32(s[r][m], _mm256_madd_epi16(pairs, ones));
      }
    }
  };
  const bool nta = ascent_prefetch::nta_streams();
  int64_t k = 0;
  for (; k + 64 <= a.k; k += 64) {
#pragma GCC unroll 4
    for (int r = 0; r < S; ++r) ascent_prefetch::stream_line(reinterpret_cast<const char*>(w[r] + k), nta,
                                                             kInt8PrefetchNta);
    step(k);
    step(k + 32);
  }
  if (k + 32 <= a.k) {
    step(k);
    k += 32;
  }
  for (int r = 0; r < S; ++r)
    for (int m = 0; m < MB; ++m) {
      int32_t rest = 0;
      for (int64_t j = k; j < a.k; ++j)
        rest += static_cast<int32_t>(static_cast<int8_t>(x[m * a.ldx + j])) * static_cast<int32_t>(w[r][j]);
      acc[r][m] = hsum_epi32_avx2(s[r][m]) + rest;
    }
}

// Token rows [0, mb) (mb <= 4) of x against rows[]: 1-3 tokens in one pass, 4 as two 2s (the second pass reads the
// rows from L1).
inline void i8_rows_streams_mb(const I8Args& a, const int64_t (&rows)[kI8Streams], const uint8_t* x, int64_t mb,
                               int32_t (&acc)[kI8Streams][4]) {
  constexpr int S = kI8Streams;
  const auto run = [&](auto tokens, int64_t m0) {
    constexpr int MB = decltype(tokens)::value;
    int32_t part[S][MB];
    i8_rows_streams_avx2<S, MB>(a, rows, x + m0 * a.ldx, part);
    for (int r = 0; r < S; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m0 + m] = part[r][m];
  };
  if (mb == 1) run(std::integral_constant<int, 1>{}, 0);
  else if (mb == 3) run(std::integral_constant<int, 3>{}, 0);
  else for (int64_t m0 = 0; m0 < mb; m0 += 2) run(std::integral_constant<int, 2>{}, m0);
}

// Weight rows [begin, end) for all m_rows <= 4 tokens of a.xq as kI8Streams equal parts read side by side, in
// spans of up to kSpanRows rows per part; emit(m, n0, rows, acc) takes each span's sums of token m (acc[r], rows
// n0 + r). Returns the first row left over (end - (end - begin) % kI8Streams), for the caller's row kernel.
template <class Emit>
int64_t i8_linear_streams_avx2(const I8Args& a, int64_t begin, int64_t end, int64_t m_rows, const Emit& emit) {
  constexpr int S = kI8Streams;
  if (a.x_has_min) return begin;  // x * sign(w) of x = -128 would wrap: the row kernel takes every row
  const int64_t part = (end - begin) / S;
  int32_t sums[S][4][kSpanRows];
  for (int64_t i0 = 0; i0 < part; i0 += kSpanRows) {
    const int64_t len = std::min(kSpanRows, part - i0);
    for (int64_t i = 0; i < len; ++i) {
      int64_t rows[S];
      for (int r = 0; r < S; ++r) rows[r] = begin + r * part + i0 + i;
      int32_t acc[S][4];
      i8_rows_streams_mb(a, rows, a.xq, m_rows, acc);
      for (int r = 0; r < S; ++r)
        for (int64_t m = 0; m < m_rows; ++m) sums[r][m][i] = acc[r][m];
    }
    for (int r = 0; r < S; ++r)
      for (int64_t m = 0; m < m_rows; ++m) emit(m, begin + r * part + i0, len, sums[r][m]);
  }
  return begin + S * part;
}
