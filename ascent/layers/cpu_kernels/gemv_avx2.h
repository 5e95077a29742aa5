// AVX2 + FMA small-M kernels of gemv_cpu.cpp (CPUs without AVX512, e.g. AMD Zen 1-3), included there inside its
// anonymous namespace after GemvArgs. Up to kSplitXMinRows - 1 x rows: W rows are read front to back as several
// side-by-side streams per thread (run_rows_streams_avx2) in passes of up to 4 x rows, one x row split inline,
// several widened once to fp32 (GemvArgs::x_split). From kSplitXMinRows rows on the call is compute-bound: tiles
// of 2 W rows x up to 6 x_split rows spend one FMA per W element and x load; from kPanelMinRows the W rows are
// repacked into panels for outer-product tiles (gemv_panel_avx2.h).
#pragma once

// AVX2 + FMA (CPUs without AVX512, e.g. AMD Zen 1-3): each W row is read front to back, 16 values at a time split
// into two fp32 vectors (x split alike) and FMA'd into fp32 accumulators; a K tail (K % 16) is summed in scalar fp32
// after the vector lanes.
__attribute__((target("avx2,fma"), always_inline)) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sixteen 16-bit values as two fp32 vectors. bf16: the even elements (low halves shifted up) and the odd ones
// (high halves masked), one ALU op each; fp16: elements 0-7 and 8-15. x and W are split the same way, so the lane
// products pair the same elements.
template <bool kIsHalf>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void split16_256(const uint16_t* p, __m256& lo,
                                                                                __m256& hi) {
  if constexpr (kIsHalf) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// Sets every accumulator of an [A][B] register array to zero.
template <int A, int B>
__attribute__((target("avx2,fma"), always_inline)) inline void zero_accumulators(__m256 (&acc)[A][B]) {
#pragma GCC unroll 8
  for (int i = 0; i < A; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) acc[i][j] = _mm256_setzero_ps();
}

constexpr int64_t kSeqPrefetchL1 = 1024;  // bytes ahead of the read position prefetched into L1
constexpr int64_t kSeqPrefetchL2 = 4096;  // ... and into L2
constexpr int64_t kSeqPrefetchNta = 896;  // the row sweep's non-temporal prefetch distance

// S W rows (rows[0..S)) against MS x rows from m0, each row read front to back 16 values per step, split into two
// fp32 vectors and FMA'd into NA accumulators per (W row, x row) pair. One x row is split inline once per step and
// shared by the S rows; several x rows come widened from a.x_split. The S rows lie far apart (the streams of
// run_rows_streams_avx2), and each stream prefetches one 64-byte line per 32 values (stream_prefetch.h).
template <typename T, bool kIsHalf, int S, int MS, int NA>
__attribute__((target("avx2,fma,f16c"))) void gemv_rows_streams_avx2(const GemvArgs& a, const int64_t (&rows)[S],
                                                                    int64_t m0) {
  static_assert(NA == 1 || NA == 2, "one accumulator per pair, or one per split half");
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.k;
  const float* xs = a.x_split != nullptr ? a.x_split + m0 * a.k : nullptr;
  const uint16_t* w[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) w[s] = static_cast<const uint16_t*>(a.w) + rows[s] * a.k;
  __m256 acc[S][MS][NA];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) zero_accumulators(acc[s]);
  const bool nta = ascent_prefetch::nta_streams();
  const auto step = [&](int64_t i) __attribute__((always_inline)) {
    __m256 x0, x1;  // one x row: split once per step for all S rows
    if constexpr (MS == 1) split16_256<kIsHalf>(x + i, x0, x1);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m256 w0, w1;
      split16_256<kIsHalf>(w[s] + i, w0, w1);
#pragma GCC unroll 4
      for (int j = 0; j < MS; ++j) {
        if constexpr (MS > 1) {  // several: loaded per use from L1 (the registers hold the accumulators)
          x0 = _mm256_loadu_ps(xs + j * a.k + i);
          x1 = _mm256_loadu_ps(xs + j * a.k + i + 8);
        }
        acc[s][j][0] = _mm256_fmadd_ps(w0, x0, acc[s][j][0]);
        acc[s][j][NA - 1] = _mm256_fmadd_ps(w1, x1, acc[s][j][NA - 1]);
      }
    }
  };
  int64_t i = 0;
  for (; i + 32 <= a.k; i += 32) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) ascent_prefetch::stream_line(reinterpret_cast<const char*>(w[s] + i), nta,
                                                             kSeqPrefetchNta);
    step(i);
    step(i + 16);
  }
  if (i + 16 <= a.k) {
    step(i);
    i += 16;
  }
  const T* xt = static_cast<const T*>(a.x) + m0 * a.k;
  for (int s = 0; s < S; ++s) {
    const T* wt = static_cast<const T*>(a.w) + rows[s] * a.k;
    for (int j = 0; j < MS; ++j) {
      float sum = hsum256(NA == 2 ? _mm256_add_ps(acc[s][j][0], acc[s][j][NA - 1]) : acc[s][j][0]);
      for (int64_t t = i; t < a.k; ++t) sum += static_cast<float>(wt[t]) * static_cast<float>(xt[j * a.k + t]);
      a.store(m0 + j, rows[s], sum);
    }
  }
}

// Rows [row_begin, row_end) against MS x rows from m0 as S sequential streams: the range is cut into S equal
// parts read side by side (row i of every part in one kernel call), the rows left over one by one. One stream per
// thread leaves a Zen 3's memory system idle between its prefetches (read-only loops, 2 threads: 45 against 31
// GB/s in a fast phase of the shared machine). Over SmolLM2-135M's 121 decode linears (DRAM-resident, 2 threads,
// interleaved in one process) the streams took 0.81-0.83x the time of the one-row sweep at 1 x row, 0.78x at 2,
// 0.81-0.86x at 3 and 0.85-0.88x at 4; in a standalone sweep 4 streams beat 2 (0.86x of one), 3 (0.75x) and 8
// (0.80x), 6 tied.
template <typename T, bool kIsHalf, int S, int MS, int NA>
void run_rows_streams_avx2(const GemvArgs& a, int64_t row_begin, int64_t row_end, int64_t m0) {
  ascent_prefetch::side_by_side<S>(row_begin, row_end, [&](const auto& rows) {
    gemv_rows_streams_avx2<T, kIsHalf, std::extent_v<std::remove_reference_t<decltype(rows)>>, MS, NA>(a, rows, m0);
  });
}

// x [m, k] (16-bit) -> fp32 [m, k] in split order: each full 16-column block as split16_256 gives it (bf16: the 8
// even then the 8 odd elements; fp16: 0-7 then 8-15), the k % 16 tail columns in natural order.
template <bool kIsHalf>
__attribute__((target("avx2,fma,f16c"))) void split_x_to_f32(const uint16_t* x, float* out, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* xr = x + r * k;
    float* o = out + r * k;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      __m256 lo, hi;
      split16_256<kIsHalf>(xr + i, lo, hi);
      _mm256_storeu_ps(o + i, lo);
      _mm256_storeu_ps(o + i + 8, hi);
    }
    for (; i < k; ++i) {
      o[i] = kIsHalf ? static_cast<float>(c10::Half(xr[i], c10::Half::from_bits()))
                     : static_cast<float>(c10::BFloat16(xr[i], c10::BFloat16::from_bits()));
    }
  }
}

// x rows from which the split tiles take over from passes of the streams. Zen 3, 2 threads, alternated in one
// process, time of the streams' passes over the split tiles' for SmolLM2's 120 layer linears from DRAM: M = 5 0.98,
// 6 0.93, 7 0.86, 8 0.89 (IQRs below 1 from M = 6), 9 0.96, 12 0.96, 16 0.98 (IQRs spanning 1 from M = 9), 20 0.99;
// one layer's linears (cache-resident): M = 6 0.96, 8 0.90, 12 0.95, 16 0.96. The streams then read W once per 4 x
// rows, yet their side-by-side prefetched rows keep more lines in flight than a tile's two adjacent ones.
constexpr int64_t kSplitXMinRows = 9;
constexpr int kSplitTileRowsW = 2;  // W rows per tile
constexpr int kSplitTileRowsX = 6;  // most x rows per tile: 2 x 6 accumulators + 4 W halves fill 16 ymm registers

// RW W rows from n against MX x rows from m0 (a.x_split), 16 columns per step: each W load is split once and each x
// vector feeds RW FMAs; the even (low) halves go first, so an accumulator's two FMAs of a step are RW * MX FMAs apart.
template <typename T, bool kIsHalf, int RW, int MX, bool kPrefetch>
__attribute__((target("avx2,fma,f16c"))) void gemv_tile_split_avx2(const GemvArgs& a, int64_t n, int64_t m0) {
  const float* xs = a.x_split + m0 * a.k;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.k;
  __m256 acc[RW][MX];
  zero_accumulators(acc);
  int64_t i = 0;
  for (; i + 16 <= a.k; i += 16) {
    __m256 wl[RW], wh[RW];
#pragma GCC unroll 2
    for (int r = 0; r < RW; ++r) {
      if constexpr (kPrefetch) {
        const char* p = reinterpret_cast<const char*>(w + r * a.k + i);
        __builtin_prefetch(p + kSeqPrefetchL1, 0, 3);
        __builtin_prefetch(p + kSeqPrefetchL2, 0, 1);
      }
      split16_256<kIsHalf>(w + r * a.k + i, wl[r], wh[r]);
    }
#pragma GCC unroll 6
    for (int j = 0; j < MX; ++j) {
      const __m256 xl = _mm256_loadu_ps(xs + j * a.k + i);
#pragma GCC unroll 2
      for (int r = 0; r < RW; ++r) acc[r][j] = _mm256_fmadd_ps(wl[r], xl, acc[r][j]);
    }
#pragma GCC unroll 6
    for (int j = 0; j < MX; ++j) {
      const __m256 xh = _mm256_loadu_ps(xs + j * a.k + i + 8);
#pragma GCC unroll 2
      for (int r = 0; r < RW; ++r) acc[r][j] = _mm256_fmadd_ps(wh[r], xh, acc[r][j]);
    }
  }
  const T* wt = static_cast<const T*>(a.w) + n * a.k;
  for (int r = 0; r < RW; ++r) {
    for (int j = 0; j < MX; ++j) {
      float sum = hsum256(acc[r][j]);
      for (int64_t t = i; t < a.k; ++t) sum += static_cast<float>(wt[r * a.k + t]) * xs[j * a.k + t];
      a.store(m0 + j, n + r, sum);
    }
  }
}

// The first pass over a W block reads it from memory, so it prefetches ahead; the later passes find it in cache.
template <typename T, bool kIsHalf, int RW, bool kPrefetch>
void gemv_tile_split_mx(const GemvArgs& a, int64_t n, int64_t m0, int64_t mx) {
  switch (mx) {  // 3 <= mx <= 6: the passes of run_rows_split_avx2 over m >= kSplitXMinRows rows
    case 6: gemv_tile_split_avx2<T, kIsHalf, RW, 6, kPrefetch>(a, n, m0); break;
    case 5: gemv_tile_split_avx2<T, kIsHalf, RW, 5, kPrefetch>(a, n, m0); break;
    case 4: gemv_tile_split_avx2<T, kIsHalf, RW, 4, kPrefetch>(a, n, m0); break;
    default: gemv_tile_split_avx2<T, kIsHalf, RW, 3, kPrefetch>(a, n, m0); break;
  }
}

template <typename T, bool kIsHalf, int RW>
void gemv_tile_split_rows(const GemvArgs& a, int64_t n, int64_t m0, int64_t mx, bool first_pass) {
  if (first_pass) gemv_tile_split_mx<T, kIsHalf, RW, true>(a, n, m0, mx);
  else gemv_tile_split_mx<T, kIsHalf, RW, false>(a, n, m0, mx);
}

// x rows of pass p when m rows go in `passes` passes as even as possible (the first m % passes take one more).
inline int64_t pass_rows(int64_t m, int64_t passes, int64_t p) { return m / passes + (p < m % passes ? 1 : 0); }

constexpr int64_t kSeqBlockBytes = 16384;  // W bytes per block that all x passes share: about half of L1

// W rows [row_begin, row_end) against the x rows in passes as even as possible of at most kSplitTileRowsX rows (so
// of at least 3 rows when m >= kSplitXMinRows: fewer accumulators could not hide the FMA latency), W in
// blocks of about kSeqBlockBytes: every pass runs over a block before the next block is read, so W streams from
// memory once and the later passes find it in cache.
template <typename T, bool kIsHalf>
void run_rows_split_avx2(const GemvArgs& a, int64_t row_begin, int64_t row_end) {
  const int64_t block_rows = kSeqBlockBytes / (2 * a.k) / kSplitTileRowsW * kSplitTileRowsW;
  const int64_t block = std::max<int64_t>(kSplitTileRowsW, block_rows);
  const int64_t passes = (a.m + kSplitTileRowsX - 1) / kSplitTileRowsX;
  for (int64_t b0 = row_begin; b0 < row_end; b0 += block) {
    const int64_t b1 = std::min(row_end, b0 + block);
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int64_t mx = pass_rows(a.m, passes, p);
      int64_t n = b0;
      for (; n + kSplitTileRowsW <= b1; n += kSplitTileRowsW) {
        gemv_tile_split_rows<T, kIsHalf, kSplitTileRowsW>(a, n, m0, mx, p == 0);
      }
      for (; n < b1; ++n) gemv_tile_split_rows<T, kIsHalf, 1>(a, n, m0, mx, p == 0);
      m0 += mx;
    }
  }
}

#include "gemv_panel_avx2.h"

// x rows in passes of up to 4 (run_rows_streams_avx2; S * MS * NA accumulators + 4 split vectors within the 16 ymm
// registers), the split tiles from kSplitXMinRows rows, the panel tiles (gemv_panel_avx2.h) from kPanelMinRows.
template <typename T, bool kIsHalf>
void run_rows_avx2(const GemvArgs& a, int64_t row_begin, int64_t row_end) {
  if (a.m >= kPanelMinRows) {
    run_rows_panel_avx2<T, kIsHalf>(a, row_begin, row_end);
    return;
  }
  if (a.m >= kSplitXMinRows) {
    run_rows_split_avx2<T, kIsHalf>(a, row_begin, row_end);
    return;
  }
  for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
    switch (std::min<int64_t>(4, a.m - m0)) {
      case 4: run_rows_streams_avx2<T, kIsHalf, 3, 4, 1>(a, row_begin, row_end, m0); break;
      case 3: run_rows_streams_avx2<T, kIsHalf, 3, 3, 1>(a, row_begin, row_end, m0); break;
      case 2: run_rows_streams_avx2<T, kIsHalf, 4, 2, 1>(a, row_begin, row_end, m0); break;
      default: run_rows_streams_avx2<T, kIsHalf, 4, 1, 2>(a, row_begin, row_end, m0); break;
    }
  }
}
