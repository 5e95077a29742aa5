// Weight-only (W8A16 / W4A16) block kernels of quant_gemv_cpu.cpp; included there inside namespace
// ascent_quant's anonymous namespace, after the shared helpers.
#pragma once

// Software prefetch of the weight line kPrefetchRows / 2 rows ahead into L1 and 2 * kPrefetchRows rows ahead into
// L2 (T2): measured best of T0 / T1 / T2 at 8..64 rows, one or two hints (1 thread, DRAM-resident weights; no
// prefetch costs ~40%); on a Zen 4 the W8A8 kernels' single T0 hint 16 rows ahead left a SmolLM2 decode step 1.6x
// slower than with this pair. Past the end of the matrix is harmless. (The target attribute matters: GCC drops
// _mm_prefetch from a plain inline function inlined into these target("avx512...") kernels.)
__attribute__((target("avx512f"), always_inline)) inline void prefetch_weights(const uint8_t* p, int64_t ldw) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows / 2 * ldw), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 2 * kPrefetchRows * ldw), _MM_HINT_T2);
}

// ---------------------------------------------------------------------------------------------------------------
// Weight-only (W8A16 / W4A16): per (row, token) the group dot products are scaled and summed; out acc[mb][R].
// ---------------------------------------------------------------------------------------------------------------

struct WoArgs {
  const float* xf;      // [M, ldx] fp32 activations (zero padded)
  int64_t ldx;
  const void* w;        // int8 [N, K] or packed uint8 [N, ldw]
  int64_t ldw;          // bytes per weight row
  int64_t kp;           // columns iterated (K, or Kp for int4)
  const float* scale;   // [N, G]
  int64_t groups, gs;   // G, columns per group (per-channel: G = 1, gs = kp)
  bool blocked = false; // int4 weights in quant_w4_layouts.h's blocked layout
};

template <int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo8_block_avx512(const WoArgs& a, int64_t n,
                                                                           const float* x, float* acc) {
  __m512 y[R][MB], d[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[r][m] = _mm512_setzero_ps();
  const int8_t* w = static_cast<const int8_t*>(a.w) + n * a.ldw;
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) d[r][m] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * a.gs;
    for (int64_t k = g * a.gs; k < k1; k += 16) {
      const __mmask16 mask = k1 - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (k1 - k)) - 1);
      if ((k & 63) == 0)  // more misses in flight than the hardware prefetchers alone
        for (int r = 0; r < R; ++r) prefetch_weights(reinterpret_cast<const uint8_t*>(w + r * a.ldw + k), a.ldw);
      __m512 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * a.ldx + k);
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * a.ldw + k)));
        for (int m = 0; m < MB; ++m) d[r][m] = _mm512_fmadd_ps(wv, xv[m], d[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(a.scale[(n + r) * a.groups + g]);
      for (int m = 0; m < MB; ++m) y[r][m] = _mm512_fmadd_ps(d[r][m], s, y[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[m * R + r] = _mm512_reduce_add_ps(y[r][m]);
}

template <int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo4_block_avx512(const WoArgs& a, int64_t n,
                                                                           const float* x, float* acc) {
  __m512 y[R][MB], d[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[r][m] = _mm512_setzero_ps();
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + n * a.ldw;
  const __m128i nib = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) d[r][m] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * a.gs;
    for (int64_t k = g * a.gs; k < k1; k += 32) {
      const int64_t left = a.ldw - k / 2;  // bytes of the row from here
      const __mmask16 bmask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      if ((k & 127) == 0)
        for (int r = 0; r < R; ++r)
          prefetch_weights(reinterpret_cast<const uint8_t*>(w + r * a.ldw + k / 2), a.ldw);
      __m512 xa[MB], xb[MB];
      for (int m = 0; m < MB; ++m) {
        xa[m] = _mm512_loadu_ps(x + m * a.ldx + k);
        xb[m] = _mm512_loadu_ps(x + m * a.ldx + k + 16);
      }
      for (int r = 0; r < R; ++r) {
        const __m128i b = _mm_maskz_loadu_epi8(bmask, w + r * a.ldw + k / 2);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, nib), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nib), eight);
        const __m512 wa = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        const __m512 wb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
        for (int m = 0; m < MB; ++m) {
          d[r][m] = _mm512_fmadd_ps(wa, xa[m], d[r][m]);
          d[r][m] = _mm512_fmadd_ps(wb, xb[m], d[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(a.scale[(n + r) * a.groups + g]);
      for (int m = 0; m < MB; ++m) y[r][m] = _mm512_fmadd_ps(d[r][m], s, y[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[m * R + r] = _mm512_reduce_add_ps(y[r][m]);
}

// Signed weight value of row n, column k of either layout.
inline int wo_value(const WoArgs& a, bool int4, int64_t n, int64_t k) {
  if (!int4) return static_cast<const int8_t*>(a.w)[n * a.ldw + k];
  // de-interleaved column k: block k / 32, position k % 32 < 16 -> even column 2 (k % 16), else odd 2 (k % 16) + 1
  const int64_t byte_idx = (k / 32) * 16 + (k % 16);
  if (byte_idx >= a.ldw) return 0;  // padding (x is zero there)
  const uint8_t byte = static_cast<const uint8_t*>(a.w)[n * a.ldw + byte_idx];
  return ((k % 32) < 16 ? (byte & 0x0F) : (byte >> 4)) - 8;
}

void wo_block_generic(const WoArgs& a, bool int4, int64_t n, int64_t rows, int64_t mb, const float* x, float* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < mb; ++m) {
      float y = 0.f;
      for (int64_t g = 0; g < a.groups; ++g) {
        float dot = 0.f;
        for (int64_t k = g * a.gs; k < (g + 1) * a.gs; ++k) dot += x[m * a.ldx + k] * wo_value(a, int4, n + r, k);
        y += dot * a.scale[(n + r) * a.groups + g];
      }
      acc[m * rows + r] = y;
    }
}

#include "quant_wo_avx2.h"

using WoBlockFn = void (*)(const WoArgs&, int64_t, const float*, float*);

template <int R>
WoBlockFn wo_block_fn(bool int4, int64_t mb) {
  if (int4) return mb == 1 ? wo4_block_avx512<R, 1> : wo4_block_avx512<R, 2>;
  return mb == 1 ? wo8_block_avx512<R, 1> : wo8_block_avx512<R, 2>;
}

// acc [mb, rows] for weight rows [n, n + rows) and tokens [m0, m0 + mb).
void wo_block(const WoArgs& a, bool int4, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  const float* x = a.xf + m0 * a.ldx;
  if (!use_avx512()) {
    if (use_avx2()) return wo_block_avx2(a, int4, n, rows, mb, x, acc);
    return wo_block_generic(a, int4, n, rows, mb, x, acc);
  }
  if (rows == kRowBlock) return wo_block_fn<kRowBlock>(int4, mb)(a, n, x, acc);
  for (int64_t r = 0; r < rows; ++r) {  // tail rows one at a time
    float one[2];
    wo_block_fn<1>(int4, mb)(a, n + r, x, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}

int64_t check_scales(const at::Tensor& scale, int64_t n, int64_t k) {
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "scale must be a contiguous float32 CPU tensor");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) >= 1 && k % scale.size(1) == 0,
              "scale must be [N, G] with G dividing K (N = ", n, ", K = ", k, "), got ", scale.sizes());
  return scale.size(1);
}

// [M, G] fp32 sums of x over each group of K / G columns (the zero-point term), empty without zero points.
std::vector<float> x_group_sums(const at::Tensor& x, int64_t groups, bool needed) {
  std::vector<float> out;
  if (!needed) return out;
  const int64_t m_rows = x.size(0), k = x.size(1), ld = x.stride(0), gs = k / groups;
  out.assign(static_cast<size_t>(m_rows * groups), 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "x_group_sums", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t j = 0; j < k; ++j) out[m * groups + j / gs] += static_cast<float>(p[m * ld + j]);
  });
  return out;
}
