// Small-M dense linear kernels for CPU decode: y[M,N] = x[M,K] @ W[N,K]^T (+ bias[N]).
//
// W is the plain row-major [N,K] weight in bf16 or fp16, x has W's dtype, accumulation is fp32 (products of two
// 16-bit floats are exact in fp32), the result is rounded once to x's dtype, as F.linear does. A decode step is a
// weight stream: every output row reads its K weights once, so the kernels walk W row-block by row-block (4 rows,
// contiguous in memory) and reuse each loaded W vector for up to 4 rows of x. Rows are split over torch's intra-op
// threads. AVX512-BF16 (vdpbf16ps), AVX512F and AVX2+FMA (gemv_avx2.h: rows streamed one by one up to 4 x rows,
// register tiles over x widened once to fp32 above) paths are chosen at run time; a scalar path covers the rest.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "out_rows.h"
#include "parallel_team.h"
#include "stream_prefetch.h"

namespace {

constexpr int64_t kRowBlock = 4;   // output rows per block (W rows streamed together)
constexpr int64_t kMBlock = 4;     // x rows per pass over a W block
constexpr int64_t kPrefetchRows = 16;  // software prefetch distance in W rows (prefetching past the end is harmless)

// Software prefetch of W's line kPrefetchRows / 2 rows ahead into L1 and 2 * kPrefetchRows rows ahead into L2, as
// the quantized kernels do (quant_wo_bf16.h): on a Zen 4 with DRAM-resident weights and short rows (K = 576) the
// single L1 prefetch 16 rows ahead left the stream at 10-17 GB/s; two distances keep more lines in flight.
// (__builtin_prefetch needs no target attribute, so the AVX2 and AVX512 kernels share it.)
inline void prefetch_w_rows_ahead(const void* p, int64_t row_bytes) {
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchRows / 2 * row_bytes, 0, 3);
  __builtin_prefetch(static_cast<const char*>(p) + 2 * kPrefetchRows * row_bytes, 0, 1);
}

struct GemvArgs {
  const void* x;      // [M,K], 16-bit float (same type as W)
  const void* w;      // [N,K]
  const void* bias;   // [N] in x's dtype, or nullptr
  void* out;          // [M,N] in x's dtype, or fp32 when out_f32
  int64_t m, n, k;
  bool is_half;       // fp16 (else bf16) for x, W, bias and out
  const float* x_split = nullptr;  // x widened to fp32 in split order (AVX2 path from 2 rows), or null
  bool out_f32 = false;  // out is fp32: the values rounded to x's dtype, widened back (the lm_head's logits)
  const float* panels = nullptr;  // W rows [0, n / 16 * 16) as pack_panels lays them out (AVX2 panel path), or
                                  // null: the path then repacks each 16-row panel per call

  inline float bias_at(int64_t n_idx) const {
    if (bias == nullptr) return 0.f;
    return is_half ? static_cast<float>(static_cast<const c10::Half*>(bias)[n_idx])
                   : static_cast<float>(static_cast<const c10::BFloat16*>(bias)[n_idx]);
  }
  // Adds the bias in fp32 and rounds once to x's dtype (round-to-nearest-even), as F.linear does; an fp32 out
  // holds that rounded value, as F.linear(...).float() would.
  inline void store(int64_t m_idx, int64_t n_idx, float acc) const {
    const float v = acc + bias_at(n_idx);
    const int64_t at = m_idx * n + n_idx;
    if (out_f32) static_cast<float*>(out)[at] = is_half ? static_cast<float>(c10::Half(v))
                                                        : static_cast<float>(c10::BFloat16(v));
    else if (is_half) static_cast<c10::Half*>(out)[at] = c10::Half(v);
    else static_cast<c10::BFloat16*>(out)[at] = c10::BFloat16(v);
  }
};

// ----------------------------------------------------------------------------------------------------------------
// Scalar reference path (any CPU).
template <typename T>
void gemv_rows_scalar(const GemvArgs& a, int64_t row_begin, int64_t row_end) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  for (int64_t n = row_begin; n < row_end; ++n) {
    const T* wr = w + n * a.k;
    for (int64_t m = 0; m < a.m; ++m) {
      const T* xr = x + m * a.k;
      float acc = 0.f;
      for (int64_t i = 0; i < a.k; ++i) acc += static_cast<float>(wr[i]) * static_cast<float>(xr[i]);
      a.store(m, n, acc);
    }
  }
}

// ----------------------------------------------------------------------------------------------------------------
// AVX512-BF16: 32 bf16 products per vdpbf16ps, pairs summed into 16 fp32 lanes. R rows of W x MS rows of x, both
// compile-time so the R*MS accumulators stay in registers.
template <int R, int MS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void gemv_block_bf16_dp(const GemvArgs& a, int64_t n0, int64_t m0) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.k;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n0 * a.k;
  __m512 acc[R][MS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MS; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_main = a.k & ~int64_t(31);
  for (int64_t i = 0; i < k_main; i += 32) {
    __m512i xv[MS];
#pragma GCC unroll 16
    for (int j = 0; j < MS; ++j) xv[j] = _mm512_loadu_si512(x + j * a.k + i);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      prefetch_w_rows_ahead(w + r * a.k + i, a.k * 2);
      const __m512i wv = _mm512_loadu_si512(w + r * a.k + i);
#pragma GCC unroll 16
      for (int j = 0; j < MS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
  if (k_main < a.k) {
    const __mmask32 mask = (__mmask32(1) << (a.k - k_main)) - 1;
    __m512i xv[MS];
#pragma GCC unroll 16
    for (int j = 0; j < MS; ++j) xv[j] = _mm512_maskz_loadu_epi16(mask, x + j * a.k + k_main);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * a.k + k_main);
#pragma GCC unroll 16
      for (int j = 0; j < MS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MS; ++j)
      a.store(m0 + j, n0 + r, _mm512_reduce_add_ps(acc[r][j]));
}

template <int R>
void gemv_rows_bf16_dp(const GemvArgs& a, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= a.m; m0 += 4) gemv_block_bf16_dp<R, 4>(a, n0, m0);
  switch (a.m - m0) {
    case 3: gemv_block_bf16_dp<R, 3>(a, n0, m0); break;
    case 2: gemv_block_bf16_dp<R, 2>(a, n0, m0); break;
    case 1: gemv_block_bf16_dp<R, 1>(a, n0, m0); break;
    default: break;
  }
}

// AVX512F: widen 16 halves/bf16 to fp32 and FMA (fp16 weights, or bf16 without AVX512-BF16).
template <bool kIsHalf>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
inline __m512 widen16_512(const uint16_t* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  if constexpr (kIsHalf) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <bool kIsHalf>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void gemv_block_fma512(const GemvArgs& a, int64_t n0, int64_t rows, int64_t m0, int64_t ms) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  __m512 acc[kRowBlock][kMBlock];
  for (int r = 0; r < kRowBlock; ++r)
    for (int j = 0; j < kMBlock; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < a.k; i += 16) {
    const int64_t left = a.k - i;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 xv[kMBlock];
    for (int j = 0; j < kMBlock; ++j)
      xv[j] = j < ms ? widen16_512<kIsHalf>(x + (m0 + j) * a.k + i, mask) : _mm512_setzero_ps();
    for (int r = 0; r < kRowBlock; ++r) {
      if (r >= rows) break;
      if ((i & 31) == 0) prefetch_w_rows_ahead(w + (n0 + r) * a.k + i, a.k * 2);  // one per 64-byte line
      const __m512 wv = widen16_512<kIsHalf>(w + (n0 + r) * a.k + i, mask);
      for (int j = 0; j < kMBlock; ++j)
        if (j < ms) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < ms; ++j)
      a.store(m0 + j, n0 + r, _mm512_reduce_add_ps(acc[r][j]));
}

#include "gemv_avx2.h"

enum class Path { kScalar, kAvx2, kFma512, kBf16Dot };

// Highest instruction-set level the kernel may use (tests lower it to cover every path on one CPU):
// 0 scalar, 1 AVX2, 2 AVX512F, 3 AVX512-BF16.
int64_t g_isa_limit = 3;

// Whether the CPU has the AVX2 path's instructions (whatever the ISA limit).
bool has_avx2_path() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

Path pick_path(bool is_half) {
  const bool has_avx2 = has_avx2_path();
  static const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  static const bool has_bf16_dot = has512 && __builtin_cpu_supports("avx512bf16");
  if (!is_half && has_bf16_dot && g_isa_limit >= 3) return Path::kBf16Dot;
  if (has512 && g_isa_limit >= 2) return Path::kFma512;
  return has_avx2 && g_isa_limit >= 1 ? Path::kAvx2 : Path::kScalar;
}

void run_rows(const GemvArgs& a, Path path, bool is_half, int64_t row_begin, int64_t row_end) {
  if (path == Path::kScalar) {
    if (is_half) gemv_rows_scalar<c10::Half>(a, row_begin, row_end);
    else gemv_rows_scalar<c10::BFloat16>(a, row_begin, row_end);
    return;
  }
  if (path == Path::kAvx2) {
    if (is_half) run_rows_avx2<c10::Half, true>(a, row_begin, row_end);
    else run_rows_avx2<c10::BFloat16, false>(a, row_begin, row_end);
    return;
  }
  if (path == Path::kBf16Dot) {
    int64_t n0 = row_begin;
    for (; n0 + kRowBlock <= row_end; n0 += kRowBlock) gemv_rows_bf16_dp<kRowBlock>(a, n0);
    for (; n0 < row_end; ++n0) gemv_rows_bf16_dp<1>(a, n0);
    return;
  }
  for (int64_t n0 = row_begin; n0 < row_end; n0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, row_end - n0);
    for (int64_t m0 = 0; m0 < a.m; m0 += kMBlock) {
      const int64_t ms = std::min(kMBlock, a.m - m0);
      if (path == Path::kBf16Dot) continue;
      if (is_half) gemv_block_fma512<true>(a, n0, rows, m0, ms);
      else gemv_block_fma512<false>(a, n0, rows, m0, ms);
    }
  }
}

}  // namespace

// A small-M projection with its weight-side operands checked once and held as raw pointers into tensors the caller
// keeps alive (the decode stack runs it every step, when those tensors' metadata is cold).
struct SmallMLinear {
  const void* weight = nullptr;  // [n, k], contiguous
  const void* bias = nullptr;    // [n] or nullptr
  at::ScalarType dtype = at::kBFloat16;
  int64_t n = 0, k = 0;
  const float* panels = nullptr;  // pack_panels(weight), or nullptr
};

// weight [N, K] (bf16/fp16, contiguous) -> fp32 [N / 16, K, 16]: W's full 16-row panels as the AVX2 panel path
// repacks them per call (gemv_panel_avx2.h: panel p holds column c of rows 16p .. 16p + 15 at [p][c], columns in
// x_split's order), so calls that pass it skip the repacking. Rows past the last full panel are not included (the
// kernel reads them from the weight). Needs AVX2 + FMA + F16C.
torch::Tensor pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "pack_panels: a bf16/fp16 CPU weight, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "pack_panels: weight must be a contiguous [N, K]");
  TORCH_CHECK(has_avx2_path(), "pack_panels: the panel layout needs AVX2 + FMA + F16C");
  const int64_t k = weight.size(1), panels = weight.size(0) / kPanelRows;
  torch::Tensor out = torch::empty({panels, k, kPanelRows}, weight.options().dtype(at::kFloat));
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  float* dst = out.data_ptr<float>();
  const bool is_half = weight.scalar_type() == at::kHalf;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (is_half) pack_panel16<c10::Half, true>(w + p * kPanelRows * k, k, dst + p * kPanelRows * k, nullptr);
      else pack_panel16<c10::BFloat16, false>(w + p * kPanelRows * k, k, dst + p * kPanelRows * k, nullptr);
    }
  });
  return out;
}

// weight [N, K] (bf16/fp16, contiguous), bias [N] (same dtype) or None, panels pack_panels(weight) or None.
SmallMLinear plan_linear_small_m(const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& panels = c10::nullopt) {
  TORCH_CHECK(weight.device().is_cpu(), "linear_small_m: CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf,
              "linear_small_m: bf16/fp16 only, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "linear_small_m: weight must be a contiguous [N, K]");
  const int64_t n = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == weight.scalar_type() && bias->is_contiguous(),
                "linear_small_m: bias must be a contiguous [", n, "] in x's dtype");
  }
  const float* panel_data = nullptr;
  if (panels.has_value() && panels->defined() && panels->numel() > 0) {
    TORCH_CHECK(panels->scalar_type() == at::kFloat && panels->is_contiguous() && panels->dim() == 3 &&
                    panels->size(0) == n / kPanelRows && panels->size(1) == weight.size(1) &&
                    panels->size(2) == kPanelRows,
                "linear_small_m: panels must be pack_panels(weight), a contiguous fp32 [", n / kPanelRows, ", ",
                weight.size(1), ", ", kPanelRows, "], got ", panels->scalar_type(), " ", panels->sizes());
    panel_data = panels->data_ptr<float>();
  }
  return {weight.data_ptr(), has_bias ? bias->data_ptr() : nullptr, weight.scalar_type(), n, weight.size(1),
          panel_data};
}

// x [..., K] in the plan's dtype -> [..., N] in x's dtype: out_into when defined (a contiguous [M, N] tensor of x's
// dtype that does not overlap x, written in place; x then 2-D), else a new tensor. float_output: a new fp32 tensor
// of the same (rounded) values, written in one pass instead of a conversion after the call.
torch::Tensor run_linear_small_m(const torch::Tensor& x, const SmallMLinear& plan,
                                 const torch::Tensor& out_into = torch::Tensor(), bool float_output = false) {
  TORCH_CHECK(x.device().is_cpu(), "linear_small_m: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == plan.dtype, "linear_small_m: x dtype ", x.scalar_type(), " != weight dtype ",
              plan.dtype);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == plan.k, "linear_small_m: x last dim ", x.size(-1), " != weight K ",
              plan.k);
  const int64_t n = plan.n, k = plan.k;
  const torch::Tensor x2 = x.dim() == 2 && x.is_contiguous() ? x : x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  TORCH_CHECK(!out_into.defined() || x.dim() == 2, "linear_small_m: an out tensor needs a 2-D x, got ", x.sizes());
  TORCH_CHECK(!(float_output && out_into.defined()), "linear_small_m: float_output writes a new tensor");
  const torch::Tensor out = float_output ? torch::empty({m, n}, x.options().dtype(at::kFloat))
                                         : ascent_out::out_or_new(out_into, m, n, x);
  const bool is_half = x.scalar_type() == at::kHalf;
  const Path path = pick_path(is_half);
  GemvArgs a{x2.data_ptr(), plan.weight, plan.bias, out.data_ptr(), m, n, k, is_half};
  a.out_f32 = float_output;
  torch::Tensor x_split;
  if (path == Path::kAvx2 && m >= 2) {  // several x rows share one widening (gemv_avx2.h)
    x_split = torch::empty({m, k}, x.options().dtype(at::kFloat));
    const auto* x16 = static_cast<const uint16_t*>(x2.data_ptr());
    if (is_half) split_x_to_f32<true>(x16, x_split.data_ptr<float>(), m, k);
    else split_x_to_f32<false>(x16, x_split.data_ptr<float>(), m, k);
    a.x_split = x_split.data_ptr<float>();
  }
  // Tasks of whole 16-row panels when prepacked panels serve the call (each task's panels then start at a multiple
  // of 16 rows, where the prepacked layout has them), else of kRowBlock rows; every row's result is the same
  // either way.
  const bool panel_tasks = plan.panels != nullptr && path == Path::kAvx2 && m >= kPanelMinRows;
  if (panel_tasks) a.panels = plan.panels;
  const int64_t unit = panel_tasks ? kPanelRows : kRowBlock;
  const int64_t blocks = (n + unit - 1) / unit;
  // >= ~32 KiB of weights per task
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k) * kRowBlock / unit);
  ascent_par::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    run_rows(a, path, is_half, b0 * unit, std::min(n, b1 * unit));
  });
  if (x.dim() == 2) return out;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  return out.view(out_sizes);
}

// x [..., K] (bf16/fp16), weight [N, K] (same dtype, contiguous), bias [N] (same dtype) or None
// -> [..., N] in x's dtype, or fp32 holding those values when float_output.
// panels: pack_panels(weight) or None (the AVX2 panel path then repacks W per call).
torch::Tensor linear_small_m(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& bias, bool float_output,
                             const c10::optional<torch::Tensor>& panels = c10::nullopt) {
  return run_linear_small_m(x, plan_linear_small_m(weight, bias, panels), torch::Tensor(), float_output);
}

// Whether bf16 calls take the AVX512-BF16 dot-product path now (the Python side sizes the small-M range from it).
bool bf16_dot_path() { return pick_path(false) == Path::kBf16Dot; }

// The path calls of this dtype (fp16 if half, else bf16) take now: "bf16_dot", "avx512f", "avx2" or "scalar".
std::string kernel_path(bool half) {
  switch (pick_path(half)) {
    case Path::kBf16Dot: return "bf16_dot";
    case Path::kFma512: return "avx512f";
    case Path::kAvx2: return "avx2";
    default: return "scalar";
  }
}

int64_t set_gemv_isa_limit(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= 3, "set_isa_limit: level must be in [0, 3], got ", level);
  const int64_t previous = g_isa_limit;
  g_isa_limit = level;
  return previous;
}

#ifndef ASCENT_EMBEDDED_KERNELS  // decode_stack_cpu.cpp includes this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_small_m", &linear_small_m, "y = x @ W^T (+ bias) for small M, bf16/fp16, fp32 accumulation; "
        "float_output: the rounded values as fp32; panels: pack_panels(weight) (the AVX2 path's prepacked panels)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("float_output") = false,
        py::arg("panels") = py::none());
  m.def("pack_panels", &pack_panels, "pack_panels(weight [N, K] bf16/fp16) -> fp32 [N / 16, K, 16], the AVX2 "
        "panel path's layout of W's full 16-row panels", py::arg("weight"));
  m.def("bf16_dot_path", &bf16_dot_path, "bf16_dot_path() -> whether bf16 takes the AVX512-BF16 path");
  m.def("kernel_path", &kernel_path, "kernel_path(half) -> the path fp16 (half) or bf16 calls take now",
        py::arg("half"));
  m.def("nta_prefetch", [] { return ascent_prefetch::nta_streams(); },
        "nta_prefetch() -> whether the AVX2 row kernels stream with NTA prefetches (AMD CPUs; stream_prefetch.h)");
  m.def("set_isa_limit", &set_gemv_isa_limit, "set_isa_limit(level) -> previous (0 scalar, 1 AVX2, 2 AVX512F, "
        "3 AVX512-BF16; tests lower it to cover every path)");
}
#endif
