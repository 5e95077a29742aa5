// W8A16 with 16-bit x on AVX2 CPUs without AVX512 (e.g. AMD Zen 2): x as 16-bit fixed point per token, int8 weights,
// exact integer dot products. Included by quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace,
// after quant_wo_vnni.h (g_wo_vnni: the tests' switch between the fixed-point and the floating-point kernels) and
// quant_int8_blocks.h (i8_span_avx2, the W8A8 AVX2 kernel's int8 x int16 column loop, amax_avx2).
//
// The fp32 row kernel (wo8_row_avx2) spends per 8 weights a sign extension to int32, an int -> float convert and an
// FMA against fp32 x. Here each token's x row becomes x^ = nearbyint(x / step), step = 2^e the power of two that puts
// max |x| just under 2^15 (a value rounding to 2^15 is clamped to 2^15 - 1); per 32 weights 2 sign-extending loads,
// 2 VPMADDWD (x^ from L1) and 2 adds give exact int32 sums, flushed to fp32 (convert, times the group's scale) at
// every scale group and at least every kWo8FixedFlush columns. y = step * sum_g s_g (x^_g . q_g); zero points stay with
// weight_only_linear's epilogue. x^ is exact for every bf16 element down to 2^-7 of the row maximum; smaller ones are
// rounded to the step, as the VNNI kernels do. Rows with a NaN / inf fall back to the floating-point kernel (prepare
// returns false).
#pragma once

constexpr int64_t kWo8FixedMaxM = 4;      // tokens per pass over a weight row
// Columns an ungrouped (per-channel) row sums in int32 before a flush: a lane of the flushed vector then holds 2048 / 8
// products of |q x^| <= 128 * 32767 < 2^22, under 2^30. One span covers a whole row of K <= 2048: with 512, a K = 576
// row ran a second, 64-column span with its own set-up and flush, and the per-channel W8A16 lm_head (K = 576) ran
// 13-31 % slower than W8A8's single-span int8 rows on the same weights; with 2048, 0-8 % (Zen 2, 2 threads, alternating
// processes).
constexpr int64_t kWo8FixedFlush = 2048;

struct Wo8FixedArgs {
  const int8_t* w;      // [N, ldw] int8 weights, K columns used
  int64_t ldw, k;
  const float* scale;   // [N, groups]
  int64_t groups, gs;
  const int16_t* x;     // [M, ldx] x^, zero padded (ldx a multiple of 32)
  int64_t ldx;
  const float* step;    // [M] the tokens' fixed-point steps
};

struct Wo8FixedScratch {
  std::vector<int16_t> x;
  std::vector<float> step;
};

// Whether this kernel takes the call: bf16 x (fp16's 11 significant bits would lose more to the step: it keeps the
// floating-point kernel), AVX2 without AVX512, group sizes a multiple of 32 columns and at most 4096 (an int32 lane
// then sums at most 4096 / 16 products of |q x^| < 2^22).
bool wo8_fixed_applies(const at::Tensor& x, int64_t groups, int64_t gs) {
  return g_wo_vnni && x.scalar_type() == at::kBFloat16 && use_avx2() && !use_avx512() &&
         (groups == 1 || (gs % 32 == 0 && gs <= 4096));
}

// out[j] = clamp(nearbyint(p[j] * inv), -32767, 32767) (inv a power of two: the product is exact).
__attribute__((target("avx2"))) void fixed_row16_avx2(const float* p, int64_t k, float inv, int16_t* out) {
  const __m256 scale = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-32767.f), hi = _mm256_set1_ps(32767.f);
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), scale),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0x08);  // lanes' low qwords: 8 int16
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm256_castsi256_si128(w16));
  }
  for (; j < k; ++j) out[j] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(p[j] * inv))));
}

// Fills x^ and the steps for x [M, K]; false when a row holds a NaN / inf (the caller then runs another kernel).
bool wo8_fixed_prepare(const at::Tensor& x, int64_t k, Wo8FixedArgs& a, Wo8FixedScratch& s) {
  const int64_t m_rows = x.size(0);
  a.ldx = (k + 31) / 32 * 32;
  const std::vector<float> xf = float_rows(x, k);
  s.x.assign(static_cast<size_t>(m_rows * a.ldx), 0);
  s.step.assign(static_cast<size_t>(m_rows), 1.f);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* p = xf.data() + m * k;
    const float amax = amax_avx2(p, k);
    if (!std::isfinite(amax)) return false;
    if (amax == 0.f) continue;  // x^ = 0
    int e2 = 0;
    std::frexp(amax, &e2);  // amax < 2^e2
    const float inv = std::ldexp(1.f, 15 - e2);  // x / step with step = 2^(e2 - 15): |x / step| < 2^15
    s.step[m] = std::ldexp(1.f, e2 - 15);
    fixed_row16_avx2(p, k, inv, s.x.data() + m * a.ldx);  // only a value within half a step of 2^15 is clamped
  }
  a.x = s.x.data();
  a.step = s.step.data();
  return true;
}

// out[m] = step[m] * sum_g s[n, g] * (x^_g . q_g) for MB tokens of weight row n.
template <int MB>
__attribute__((target("avx2,fma"))) void wo8_fixed_row_avx2(const Wo8FixedArgs& a, int64_t n, int64_t m0,
                                                            float* out) {
  const int8_t* w = a.w + n * a.ldw;
  const int16_t* x = a.x + m0 * a.ldx;
  __m256 y[MB];
  float tail[MB] = {};
  for (int m = 0; m < MB; ++m) y[m] = _mm256_setzero_ps();
  const int64_t span = a.groups == 1 ? kWo8FixedFlush : a.gs;
  for (int64_t k0 = 0; k0 < a.k; k0 += span) {
    const float sg = a.scale[n * a.groups + (a.groups == 1 ? 0 : k0 / a.gs)];
    __m256i lanes[MB];
    int32_t rest[MB];  // the last K % 16 columns (ungrouped rows only: groups are multiples of 32)
    i8_span_avx2<MB>(w, x, a.ldx, k0, std::min(a.k, k0 + span), lanes, rest);
    for (int m = 0; m < MB; ++m) {
      tail[m] += static_cast<float>(rest[m]) * sg;
      y[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[m]), _mm256_set1_ps(sg), y[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = a.step[m0 + m] * (hsum_wo_avx2(y[m]) + tail[m]);
}

// acc [mb, rows] for weight rows [n, n + rows) and tokens [m0, m0 + mb) (mb <= kWo8FixedMaxM), row after row.
void wo8_fixed_block_avx2(const Wo8FixedArgs& a, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float one[kWo8FixedMaxM];
    switch (mb) {
      case 1: wo8_fixed_row_avx2<1>(a, n + r, m0, one); break;
      case 2: wo8_fixed_row_avx2<2>(a, n + r, m0, one); break;
      case 3: wo8_fixed_row_avx2<3>(a, n + r, m0, one); break;
      default: wo8_fixed_row_avx2<4>(a, n + r, m0, one); break;
    }
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}

// Side-by-side weight streams (as W8A8's i8_linear_streams_avx2): kWo8Streams weight rows far apart read at once,
// so one thread keeps several sequential streams in flight where a row after row leaves the memory system idle
// between its prefetches. Per 32 columns each row takes the row kernel's 2 sign-extending loads, VPMADDWD against the
// same x^ (loaded once for all rows) and adds; the int32 sums, their flushes and the final sums are the row kernel's,
// so the outputs are bit-identical to it. Measured on a Zen 3 (2 threads, the 120 linears + head of a SmolLM2-135M
// decode step, per-channel, DRAM-resident, alternating in one process): 0.79-0.83x the row kernel's time at 1 token
// (5.7 against 7.2 ms), 0.74-0.77x at 2, 0.85x at 3, 0.83-0.90x at 4.
constexpr int kWo8Streams = 4;

// out[r][m] for weight rows rows[r] and MB <= 3 tokens from m0 (4 rows x 4 tokens of int32 sums would spill).
template <int S, int MB>
__attribute__((target("avx2,fma"))) void wo8_fixed_rows_streams_avx2(const Wo8FixedArgs& a, const int64_t (&rows)[S],
                                                                     int64_t m0, float (&out)[S][MB]) {
  const int8_t* w[S];
  __m256 y[S][MB];
  float tail[S][MB];
  for (int r = 0; r < S; ++r) {
    w[r] = a.w + rows[r] * a.ldw;
    for (int m = 0; m < MB; ++m) y[r][m] = _mm256_setzero_ps(), tail[r][m] = 0.f;
  }
  const int16_t* x = a.x + m0 * a.ldx;
  const auto widen = [](const int8_t* p) __attribute__((always_inline)) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  const auto xs = [&](int m, int64_t k) __attribute__((always_inline)) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * a.ldx + k));
  };
  const bool nta = ascent_prefetch::nta_streams();
  const int64_t span = a.groups == 1 ? kWo8FixedFlush : a.gs;
  for (int64_t k0 = 0; k0 < a.k; k0 += span) {
    const int64_t k1 = std::min(a.k, k0 + span);
    __m256i s[S][MB];
    for (int r = 0; r < S; ++r)
      for (int m = 0; m < MB; ++m) s[r][m] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      if ((k & 63) == 0)
        for (int r = 0; r < S; ++r)
          ascent_prefetch::stream_line(reinterpret_cast<const char*>(w[r] + k), nta, kInt8PrefetchNta);
      __m256i x0[MB], x1[MB];
      for (int m = 0; m < MB; ++m) x0[m] = xs(m, k), x1[m] = xs(m, k + 16);
#pragma GCC unroll 4
      for (int r = 0; r < S; ++r) {
        const __m256i w0 = widen(w[r] + k), w1 = widen(w[r] + k + 16);
        for (int m = 0; m < MB; ++m)
          s[r][m] = _mm256_add_epi32(_mm256_add_epi32(s[r][m], _mm256_madd_epi16(w0, x0[m])),
                                     _mm256_madd_epi16(w1, x1[m]));
      }
    }
    if (k + 16 <= k1) {
      for (int r = 0; r < S; ++r) {
        const __m256i w0 = widen(w[r] + k);
        for (int m = 0; m < MB; ++m) s[r][m] = _mm256_add_epi32(s[r][m], _mm256_madd_epi16(w0, xs(m, k)));
      }
      k += 16;
    }
    for (int r = 0; r < S; ++r) {
      const float sg = a.scale[rows[r] * a.groups + (a.groups == 1 ? 0 : k0 / a.gs)];
      for (int m = 0; m < MB; ++m) {
        int32_t rest = 0;  // the last K % 16 columns (ungrouped rows only: groups are multiples of 32)
        for (int64_t j = k; j < k1; ++j)
          rest += static_cast<int32_t>(x[m * a.ldx + j]) * static_cast<int32_t>(w[r][j]);
        tail[r][m] += static_cast<float>(rest) * sg;
        y[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][m]), _mm256_set1_ps(sg), y[r][m]);
      }
    }
  }
  for (int r = 0; r < S; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = a.step[m0 + m] * (hsum_wo_avx2(y[r][m]) + tail[r][m]);
}

// Weight rows [begin, end) for all m_rows <= kWo8FixedMaxM tokens as kWo8Streams equal parts read side by side (1-3
// tokens in one pass, 4 as two passes of 2: the second reads the rows from L1), in spans of up to kSpanRows rows per
// part; emit(m, n0, rows, y) takes each span's outputs of token m (y[r], rows n0 + r; y may be changed in place).
// Returns the first row left over (end - (end - begin) % kWo8Streams) for the row kernel.
template <class Emit>
int64_t wo8_fixed_streams_avx2(const Wo8FixedArgs& a, int64_t begin, int64_t end, int64_t m_rows, const Emit& emit) {
  constexpr int S = kWo8Streams;
  if (!g_wo_streams) return begin;
  const int64_t part = (end - begin) / S;
  float sums[S][kWo8FixedMaxM][kSpanRows];
  const auto pass = [&](auto tokens, const int64_t (&rows)[S], int64_t m0, int64_t i) {
    constexpr int MB = decltype(tokens)::value;
    float out[S][MB];
    wo8_fixed_rows_streams_avx2<S, MB>(a, rows, m0, out);
    for (int r = 0; r < S; ++r)
      for (int m = 0; m < MB; ++m) sums[r][m0 + m][i] = out[r][m];
  };
  for (int64_t i0 = 0; i0 < part; i0 += kSpanRows) {
    const int64_t len = std::min(kSpanRows, part - i0);
    for (int64_t i = 0; i < len; ++i) {
      int64_t rows[S];
      for (int r = 0; r < S; ++r) rows[r] = begin + r * part + i0 + i;
      if (m_rows == 3) pass(std::integral_constant<int, 3>{}, rows, 0, i);
      else for (int64_t m0 = 0; m0 < m_rows; m0 += 2) {
        if (m_rows - m0 >= 2) pass(std::integral_constant<int, 2>{}, rows, m0, i);
        else pass(std::integral_constant<int, 1>{}, rows, m0, i);
      }
    }
    for (int r = 0; r < S; ++r)
      for (int64_t m = 0; m < m_rows; ++m) emit(m, begin + r * part + i0, len, sums[r][m]);
  }
  return begin + S * part;
}
