// AVX2 + FMA small-M kernels of gemv_cpu.cpp (CPUs without AVX512, e.g. AMD Zen 1-3), included there inside its
// anonymous namespace after GemvArgs. Up to kSplitXMinRows - 1 x rows: each W row is streamed front to back against
// the 16-bit x (the memory-bound decode case). From kSplitXMinRows rows on the call is compute-bound, so x is first
// widened once to fp32 in the split order the W loads produce (GemvArgs::x_split), and tiles of 2 W rows x up to 6
// x rows spend one FMA per W element and x load instead of re-splitting x for every W row.
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

// One W row (n) against MS x rows from m0, reading the row front to back, 32 values per step into four fp32
// accumulators per x row (two for 3-4 x rows, to stay within 16 registers). Rows are contiguous, so prefetching a
// fixed distance ahead also covers the next row: on a Zen 2 (K = 576 and 1536, DRAM-resident weights, 2 threads) this
// sweep streamed 22-24 GB/s where the 4-row blocks reached 18-19 GB/s (torch fp32 sum: 27-28 GB/s). On AMD CPUs one
// non-temporal prefetch per cache line kSeqPrefetchNta bytes ahead instead of the T0 1 KiB + T1 4 KiB pair: the 120
// linears of a SmolLM2-135M step 0.81-0.85x the time (28-29 GB/s; distances 640-1280 B alike, 2048 B 0.99x); on
// Intel CPUs the pair (stream_prefetch.h).
template <typename T, bool kIsHalf, int MS>
__attribute__((target("avx2,fma,f16c"))) void gemv_row_seq_avx2(const GemvArgs& a, int64_t n, int64_t m0) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.k;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.k;
  const char* wb = reinterpret_cast<const char*>(w);
  constexpr int NA = MS <= 2 ? 4 : 2;  // accumulators per x row (16 ymm registers: MS * NA + 4 W + 2 x)
  __m256 acc[MS][NA];
  zero_accumulators(acc);
  const bool nta = ascent_prefetch::nta_streams();
  int64_t i = 0;
  for (; i + 32 <= a.k; i += 32) {
    ascent_prefetch::stream_line(wb + 2 * i, nta, kSeqPrefetchNta);
    __m256 w0, w1, w2, w3;
    split16_256<kIsHalf>(w + i, w0, w1);
    split16_256<kIsHalf>(w + i + 16, w2, w3);
#pragma GCC unroll 8
    for (int j = 0; j < MS; ++j) {
      __m256 x0, x1;
      split16_256<kIsHalf>(x + j * a.k + i, x0, x1);
      acc[j][0] = _mm256_fmadd_ps(w0, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(w1, x1, acc[j][1]);
      split16_256<kIsHalf>(x + j * a.k + i + 16, x0, x1);
      acc[j][2 % NA] = _mm256_fmadd_ps(w2, x0, acc[j][2 % NA]);
      acc[j][3 % NA] = _mm256_fmadd_ps(w3, x1, acc[j][3 % NA]);
    }
  }
  if (i + 16 <= a.k) {
    __m256 w0, w1;
    split16_256<kIsHalf>(w + i, w0, w1);
#pragma GCC unroll 8
    for (int j = 0; j < MS; ++j) {
      __m256 x0, x1;
      split16_256<kIsHalf>(x + j * a.k + i, x0, x1);
      acc[j][0] = _mm256_fmadd_ps(w0, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(w1, x1, acc[j][1]);
    }
    i += 16;
  }
  const T* xt = static_cast<const T*>(a.x) + m0 * a.k;
  const T* wt = static_cast<const T*>(a.w) + n * a.k;
  for (int j = 0; j < MS; ++j) {
    __m256 total = _mm256_add_ps(acc[j][0], acc[j][1]);
    if constexpr (NA == 4) total = _mm256_add_ps(total, _mm256_add_ps(acc[j][2 % NA], acc[j][3 % NA]));
    float sum = hsum256(total);
    for (int64_t t = i; t < a.k; ++t) sum += static_cast<float>(wt[t]) * static_cast<float>(xt[j * a.k + t]);
    a.store(m0 + j, n, sum);
  }
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

constexpr int64_t kSplitXMinRows = 5;  // x rows from which the AVX2 path widens x once (x_split)
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
      const int64_t mx = a.m / passes + (p < a.m % passes ? 1 : 0);
      int64_t n = b0;
      for (; n + kSplitTileRowsW <= b1; n += kSplitTileRowsW) {
        gemv_tile_split_rows<T, kIsHalf, kSplitTileRowsW>(a, n, m0, mx, p == 0);
      }
      for (; n < b1; ++n) gemv_tile_split_rows<T, kIsHalf, 1>(a, n, m0, mx, p == 0);
      m0 += mx;
    }
  }
}

// x rows in passes of up to 4 (gemv_row_seq_avx2, one W row after another), or the split tiles when x_split is set.
template <typename T, bool kIsHalf>
void run_rows_avx2(const GemvArgs& a, int64_t row_begin, int64_t row_end) {
  if (a.x_split != nullptr) {
    run_rows_split_avx2<T, kIsHalf>(a, row_begin, row_end);
    return;
  }
  for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
    const int64_t ms = std::min<int64_t>(4, a.m - m0);
    for (int64_t n = row_begin; n < row_end; ++n) {
      switch (ms) {
        case 4: gemv_row_seq_avx2<T, kIsHalf, 4>(a, n, m0); break;
        case 3: gemv_row_seq_avx2<T, kIsHalf, 3>(a, n, m0); break;
        case 2: gemv_row_seq_avx2<T, kIsHalf, 2>(a, n, m0); break;
        default: gemv_row_seq_avx2<T, kIsHalf, 1>(a, n, m0); break;
      }
    }
  }
}
