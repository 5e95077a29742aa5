// AVX2 + FMA small-M linear from kPanelMinRows x rows on (the compute-bound range of gemv_avx2.h), included there
// after split_x_to_f32. Each thread repacks its W rows, 16 at a time, into an fp32 panel [K][16] (column c holds
// the 16 rows' values of x_split's column c, so the split order of gemv_avx2.h carries over), then runs register
// tiles of 16 W rows x up to 6 x rows over it: per column two panel loads, one broadcast per x row and two FMAs
// per x row, 12 accumulators that stay in registers and need no horizontal sums. The panel (36 KiB at K = 576) is
// written once per 16 rows and read by every pass over the x rows from L1 / L2.
// Why: the inner-product tiles of gemv_avx2.h (2 W rows x 6 x rows, 16 columns per step) load every x vector once
// per FMA pair and end each tile in 12 horizontal sums; on a Zen 3 (2 threads, SmolLM2-135M's four layer shapes,
// hot caches) they ran 73-82 GFLOP/s from M = 16 to 128 while an fp32 GEMM reached 172. A standalone version of
// this kernel ran 76-90 GFLOP/s on one thread from M = 16 to 128 (49 at M = 5, repacking included).
// Measured on a Zen 3 (2 threads, both kernels built side by side and alternated in one process, SmolLM2's 120 layer
// linears), time panels / split tiles: DRAM-resident M = 32 0.87-0.96, 48 0.73, 64 0.80-0.85, 96 0.72, 128
// 0.74-0.79; one layer's linears (cache-resident) M = 5 1.34-1.45, 8 1.10-1.31, 16 0.95-0.98, 24 0.87, 32 0.83-0.86,
// hence kPanelMinRows = 24 (the repacking costs about as much as one pass of 6 x rows). Tried and not kept: a bf16
// panel of 32-bit column pairs (half the repacking, the split done in the tile): 1.05-1.24x the split tiles' time at
// M = 5-8 and 1.17-1.44x from M = 16 to 64 (cache-resident), where the fp32 panel took 0.83-0.98x.
#pragma once

#include "bf16_round_avx2.h"  // bf16_bits8, bf16_bits8_to_f32

constexpr int64_t kPanelMinRows = 24;  // x rows from which the panels beat the split tiles (see the header)
constexpr int64_t kPanelRows = 16;     // W rows per panel: two fp32 vectors per column
constexpr int64_t kPanelMaxTileX = 6;  // x rows per tile: 2 x 6 accumulators + 2 panel vectors + 1 broadcast

// 8 vectors rows[i] (8 values of W row i) -> out + p * kPanelRows (8 rows' values of column p), p = 0..7.
__attribute__((target("avx2,fma"), always_inline)) inline void transpose8_store(const __m256 (&rows)[8], float* out) {
  const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
  const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
  const __m256 t4 = _mm256_unpacklo_ps(rows[4], rows[5]), t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
  const __m256 t6 = _mm256_unpacklo_ps(rows[6], rows[7]), t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
  const __m256 s[8] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE),
                       _mm256_shuffle_ps(t4, t6, 0x44), _mm256_shuffle_ps(t4, t6, 0xEE),
                       _mm256_shuffle_ps(t5, t7, 0x44), _mm256_shuffle_ps(t5, t7, 0xEE)};
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    _mm256_storeu_ps(out + p * kPanelRows, _mm256_permute2f128_ps(s[p], s[p + 4], 0x20));
    _mm256_storeu_ps(out + (p + 4) * kPanelRows, _mm256_permute2f128_ps(s[p], s[p + 4], 0x31));
  }
}

// 16 W rows from w (row stride k) -> panel [k][16] fp32 in x_split's column order: each full 16-column block split
// as split16_256 splits it, the k % 16 tail in natural order. `next` (the following 16 rows, or null) is prefetched
// into L2 a line per row and 32 columns, so the next repack finds its rows on the way.
template <typename T, bool kIsHalf>
__attribute__((target("avx2,fma,f16c"))) void pack_panel16(const uint16_t* w, int64_t k, float* panel,
                                                            const uint16_t* next) {
  const int64_t k16 = k & ~int64_t(15);
  for (int64_t c = 0; c < k16; c += 16) {
    if (next != nullptr && (c & 31) == 0) {
      for (int64_t r = 0; r < kPanelRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * k + c), _MM_HINT_T1);
    }
#pragma GCC unroll 2
    for (int64_t half = 0; half < 2; ++half) {  // rows 0-7, then 8-15 of the panel
      __m256 lo[8], hi[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) split16_256<kIsHalf>(w + (8 * half + i) * k + c, lo[i], hi[i]);
      transpose8_store(lo, panel + c * kPanelRows + 8 * half);
      transpose8_store(hi, panel + (c + 8) * kPanelRows + 8 * half);
    }
  }
  const T* wt = reinterpret_cast<const T*>(w);
  for (int64_t c = k16; c < k; ++c)
    for (int64_t r = 0; r < kPanelRows; ++r) panel[c * kPanelRows + r] = static_cast<float>(wt[r * k + c]);
}

// out[j][r] = sum_c panel[c][r] * xs[j * k + c] for MX x rows (x_split rows) and the panel's 16 W rows; `next`
// (a prepacked panel the next tiles read, or null) is prefetched into L2 a line per column on the way.
template <int MX>
__attribute__((target("avx2,fma"))) void panel_tile_avx2(const float* panel, int64_t k, const float* xs,
                                                          float (&out)[kPanelMaxTileX][kPanelRows],
                                                          const float* next) {
  __m256 lo[MX], hi[MX];
#pragma GCC unroll 6
  for (int j = 0; j < MX; ++j) {
    lo[j] = _mm256_setzero_ps();
    hi[j] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < k; ++c) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + c * kPanelRows), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(panel + c * kPanelRows), w1 = _mm256_loadu_ps(panel + c * kPanelRows + 8);
#pragma GCC unroll 6
    for (int j = 0; j < MX; ++j) {
      const __m256 xb = _mm256_broadcast_ss(xs + j * k + c);
      lo[j] = _mm256_fmadd_ps(w0, xb, lo[j]);
      hi[j] = _mm256_fmadd_ps(w1, xb, hi[j]);
    }
  }
  // (every loop over the accumulators is unrolled: an indexed one makes GCC keep them in memory, storing all 12
  // each column)
#pragma GCC unroll 6
  for (int j = 0; j < MX; ++j) {
    _mm256_storeu_ps(out[j], lo[j]);
    _mm256_storeu_ps(out[j] + 8, hi[j]);
  }
}

void panel_tile_mx(const float* panel, int64_t k, const float* xs, int64_t mx,
                   float (&out)[kPanelMaxTileX][kPanelRows], const float* next) {
  switch (mx) {  // 4 <= mx <= 6 when m >= kPanelMinRows (passes as even as possible)
    case 6: panel_tile_avx2<6>(panel, k, xs, out, next); break;
    case 5: panel_tile_avx2<5>(panel, k, xs, out, next); break;
    case 4: panel_tile_avx2<4>(panel, k, xs, out, next); break;
    default: panel_tile_avx2<3>(panel, k, xs, out, next); break;
  }
}

// One tile row's 16 outputs (W rows n0 .. n0 + 15 of x row m_idx) -> out, as 16 calls of a.store would write them:
// bias added in fp32, rounded once to bf16 (fp32 out: that value widened). Vectorized for bf16, where a.store per
// element (its branches re-read per call) took ~10 % of a panel call at M = 35; fp16 keeps a.store.
template <bool kIsHalf>
__attribute__((target("avx2,fma"))) inline void store_panel_row(const GemvArgs& a, int64_t m_idx, int64_t n0,
                                                                const float* acc) {
  if constexpr (kIsHalf) {
    for (int64_t r = 0; r < kPanelRows; ++r) a.store(m_idx, n0 + r, acc[r]);
  } else {
    __m256 lo = _mm256_loadu_ps(acc), hi = _mm256_loadu_ps(acc + 8);
    if (a.bias != nullptr) {
      const auto* b = static_cast<const uint16_t*>(a.bias) + n0;
      lo = _mm256_add_ps(lo, bf16_bits8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
      hi = _mm256_add_ps(hi, bf16_bits8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8))));
    }
    const __m128i bits_lo = bf16_bits8(lo), bits_hi = bf16_bits8(hi);
    const int64_t at = m_idx * a.n + n0;
    if (a.out_f32) {
      float* o = static_cast<float*>(a.out) + at;
      _mm256_storeu_ps(o, bf16_bits8_to_f32(bits_lo));
      _mm256_storeu_ps(o + 8, bf16_bits8_to_f32(bits_hi));
    } else {
      auto* o = static_cast<uint16_t*>(a.out) + at;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), bits_lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), bits_hi);
    }
  }
}

// W rows [row_begin, row_end) against all a.m x rows (a.x_split): whole panels of 16 rows repacked and run in
// passes of at most 6 x rows; the rows left over (fewer than 16) take the split tiles of gemv_avx2.h.
// With a.panels (pack_panels' layout) a panel that starts at a multiple of 16 rows is read from there instead.
template <typename T, bool kIsHalf>
void run_rows_panel_avx2(const GemvArgs& a, int64_t row_begin, int64_t row_end) {
  static thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(a.k * kPanelRows));
  const int64_t passes = (a.m + kPanelMaxTileX - 1) / kPanelMaxTileX;
  const auto* w = static_cast<const uint16_t*>(a.w);
  int64_t n0 = row_begin;
  for (; n0 + kPanelRows <= row_end; n0 += kPanelRows) {
    const bool prepacked = a.panels != nullptr && n0 % kPanelRows == 0;
    const float* rows = prepacked ? a.panels + n0 * a.k : panel.data();
    const float* next = prepacked && n0 + 2 * kPanelRows <= row_end ? rows + kPanelRows * a.k : nullptr;
    if (!prepacked) {  // no prepacked panel n0 / 16 here: repack it from W's rows
      const uint16_t* next_rows = n0 + 2 * kPanelRows <= row_end ? w + (n0 + kPanelRows) * a.k : nullptr;
      pack_panel16<T, kIsHalf>(w + n0 * a.k, a.k, panel.data(), next_rows);
    }
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int64_t mx = pass_rows(a.m, passes, p);
      float out[kPanelMaxTileX][kPanelRows];
      panel_tile_mx(rows, a.k, a.x_split + m0 * a.k, mx, out, p == 0 ? next : nullptr);
      for (int64_t j = 0; j < mx; ++j) store_panel_row<kIsHalf>(a, m0 + j, n0, out[j]);
      m0 += mx;
    }
  }
  if (n0 < row_end) run_rows_split_avx2<T, kIsHalf>(a, n0, row_end);
}

