// Small-M (decode) integer-weight linear kernels: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), fp32 accumulation,
// output in x's dtype (float32 / bfloat16 / float16). Weights stream once per call at memory bandwidth; rows are
// processed in blocks of 4 (one load of each x chunk feeds 4 weight rows) and split over torch's intra-op threads.
//
// * w8a16_linear: int8 W [N, K], scale fp32 [N, G] (G groups of K/G columns), optional subtractive zero [N, G]:
//   W = (q - z) * s.  y = sum_g s[n,g] * (x_g . q_g - z[n,g] * sum(x_g)).
// * w4a16_pack / w4a16_linear: int4 values q in [-8, 7] stored as u = q + 8 nibbles, two per byte along K (column
//   2j in the low nibble of byte j, 2j + 1 in the high one): uint8 [N, ceil(K/2)], exactly the bytes of a
//   compressed-tensors ``weight_packed`` int32 [N, K/8] (little endian), so that tensor is used without a copy.
//   x is de-interleaved once per call (per 32 columns: the even ones, then the odd ones) so one 16-byte load feeds
//   two 16-lane FMAs. Same scale / zero math as W8A16.
//   16-bit x: on AVX512-VNNI each x row becomes 16-bit fixed point and the sums are exact in int32 (VPDPBUSD,
//   quant_wo_vnni.h; int4: any valid group size, int8: G = 1 or groups of a multiple of 4 columns; int4 on AVX2:
//   VPMADDWD, quant_wo_fixed_avx2.h; x with a NaN / inf takes the next kernel). Otherwise (64-byte weight chunks,
//   up to 4 rows of x per pass, bit-trick weight decoding, no int -> float converts): W4A16 with bf16 x on
//   AVX512-BF16 uses VDPBF16PS (quant_wo_bf16.h; G = 1 or groups of a multiple of 64 columns); W8A16 with bf16 /
//   fp16 x uses fp32 FMAs on weights 1 + u / 256 (quant_wo_fma8.h; G = 1 or groups of a multiple of 128).
//   Otherwise x is widened to fp32 and the weights converted to fp32 (quant_wo_blocks.h).
// * w8a8_dynamic_linear: per-token symmetric int8 quantization of x with the rounding of the torch reference
//   (s = max|x| / 127, q = clamp(nearbyint(x / s), -128, 127), all-zero rows s = 0), exact int32 x_q . W_q
//   (AVX512-VNNI u8 x s8 with u = q + 128 and the weight row sums as correction), y = acc * s_x * s_w (+ bias).
// * w8a8_static_linear: per-tensor q = clamp(nearbyint(x / s_x + z_x)), y = (acc + quant_bias) * deq (+ bias).
//
// Wide-ISA code lives in functions with target attributes, selected at runtime; the generic path is plain C++.
// Everything is in namespace ascent_quant, and the module definition is skipped under ASCENT_EMBEDDED_KERNELS, so
// another source (decode_stack_cpu.cpp) can include this file and call ascent_quant::w8a8_dynamic_linear etc.
#include <torch/extension.h>

#include "amx_tiles.h"
#include "out_rows.h"
#include "parallel_blocks.h"
#include "parallel_team.h"
#include "stream_prefetch.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ascent_quant {
namespace {

constexpr int64_t kRowBlock = 4;     // weight rows sharing one x chunk load
constexpr int64_t kRowGrain = 64;    // rows per parallel chunk (at least)
constexpr int64_t kSpanRows = 64;     // AVX2 int4 / int8 / W8A16 fixed-point kernels: weight rows per call (a call
                                     // per row block cost ~4 ns per 576-column int4 row in vzeroupper and set-up)
constexpr int64_t kPrefetchRows = 16;  // software prefetch distance in weight rows (past the end is harmless)
constexpr int64_t kMaxK = 1 << 16;   // int32 accumulators of the u8 x s8 products cannot overflow below this
int g_force_generic = 0;             // tests: 1 = portable path only, 2 = at most AVX2 (set_force_generic)

bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok && g_force_generic == 0;
}

bool use_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok && use_avx512();
}

bool use_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok && use_avx512();
}

// x [..., K] (CPU, float32 / bfloat16 / float16) as a 2-D [M, K] tensor with unit column stride.
at::Tensor rows_of(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x must be [..., K] with K = ", k, ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});
  return x2.stride(1) == 1 ? x2 : x2.contiguous();
}

// y [M, N] viewed with x's leading dims: [..., N].
at::Tensor like_x(const at::Tensor& y, const at::Tensor& x) {
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

void check_vec(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_weight(const at::Tensor& w, at::ScalarType dtype) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, "weight must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(w.scalar_type() == dtype, "weight must be ", dtype, ", got ", w.scalar_type());
}

// Destination column of x column j: itself (block 0), or its slot in the int4 kernels' de-interleaved blocks of
// `block` columns (the even columns of the block, then the odd ones).
inline int64_t x_slot(int64_t j, int64_t block) {
  return block ? (j & ~(block - 1)) + (j & 1) * (block / 2) + ((j & (block - 1)) >> 1) : j;
}

// x [M, K] -> fp32 rows [M, kp] zero padded (columns permuted by x_slot).
// One bf16 row widened to fp32 (exact: the bits shifted into the high half), 16 columns per step.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void bf16_row_to_float(const uint16_t* p, int64_t k, float* out) {
  for (int64_t j = 0; j < k; j += 16) {
    const __mmask16 mask = k - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - j)) - 1);
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p + j)), 16);
    _mm512_mask_storeu_ps(out + j, mask, _mm512_castsi512_ps(wide));
  }
}

// Row i of x as fp32 into out[0, kp) (zero padded past K; columns permuted by x_slot).
void float_row(const at::Tensor& x, int64_t i, int64_t kp, float* out, int64_t deinterleave = 0) {
  const int64_t k = x.size(1), ld = x.stride(0);
  if (x.scalar_type() == at::kBFloat16 && deinterleave == 0 && use_avx512()) {  // the decode hot path
    bf16_row_to_float(reinterpret_cast<const uint16_t*>(x.data_ptr()) + i * ld, k, out);
    std::fill(out + k, out + kp, 0.f);
    return;
  }
  std::fill(out, out + kp, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "float_rows", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>() + i * ld;
    for (int64_t j = 0; j < k; ++j) out[x_slot(j, deinterleave)] = static_cast<float>(p[j]);
  });
}

std::vector<float> float_rows(const at::Tensor& x, int64_t kp, int64_t deinterleave = 0) {
  std::vector<float> out(static_cast<size_t>(x.size(0) * kp));
  for (int64_t i = 0; i < x.size(0); ++i) float_row(x, i, kp, out.data() + i * kp, deinterleave);
  return out;
}

// row_fn(m, fp32 row m of x [M, K]) for every row; the rows are split over torch's threads once x has more than
// about kRowGrainValues values (a decode-sized x stays on the calling thread). A prefill-sized W8A8 call on AMX-INT8
// spent half its time quantizing x on one thread (2048 x 1536: 2.1 of 3.2 ms).
constexpr int64_t kRowGrainValues = 32768;

template <typename RowFn>
void for_float_rows(const at::Tensor& x, int64_t k, const RowFn& row_fn) {
  ascent_par::parallel_for(0, x.size(0), std::max<int64_t>(1, kRowGrainValues / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> row(static_cast<size_t>(k));
                     for (int64_t m = begin; m < end; ++m) {
                       float_row(x, m, k, row.data());
                       row_fn(m, row.data());
                     }
                   });
}

__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + j));
  float r = _mm512_reduce_add_ps(acc);
  for (; j < n; ++j) r += p[j];
  return r;
}

// sum(p[0:n]) in fp32 (vectorised where available; the order of the additions is unspecified).
float row_sum_f32(const float* p, int64_t n) {
  if (use_avx512()) return sum_avx512(p, n);
  float r = 0.f;
  for (int64_t j = 0; j < n; ++j) r += p[j];
  return r;
}

// bias (any float dtype, [N]) -> fp32, empty when absent.
std::vector<float> float_bias(const c10::optional<at::Tensor>& bias_in, int64_t n) {
  std::vector<float> out;
  if (!bias_in.has_value() || !bias_in->defined()) return out;
  TORCH_CHECK(bias_in->device().is_cpu() && bias_in->numel() == n, "bias must be a CPU tensor of ", n, " elements");
  const at::Tensor bias = bias_in->contiguous();
  out.resize(static_cast<size_t>(n));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bias.scalar_type(), "float_bias", [&] {
    const scalar_t* p = bias.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  });
  return out;
}

// body(begin, end) over [0, n) in chunks handed out dynamically to torch's intra-op threads: on a shared host a
// descheduled thread delays the call by at most its current chunk instead of half the matrix. Two chunks per thread
// (at least kRowGrain rows, whole kRowBlocks): every chunk start has its first rows' misses exposed (the software
// prefetch runs kPrefetchRows ahead within a chunk), which cost 13 % of a SmolLM2 step's W8A16 layers with 64-row
// chunks (30 layers, 2 threads: 7.1 -> 6.2 ms; 4 chunks per thread 6.5, 1 chunk per thread 8.5).
template <typename Body>
void parallel_rows(int64_t n, const Body& body) {
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const int64_t per_chunk = (n + 2 * threads - 1) / (2 * threads);
  const int64_t grain = std::max(kRowGrain, (per_chunk + kRowBlock - 1) / kRowBlock * kRowBlock);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t workers = std::min<int64_t>(threads, chunks);
  std::atomic<int64_t> next{0};
  ascent_par::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      body(c * grain, std::min(n, (c + 1) * grain));
  });
}

#include "quant_store.h"

#include "quant_wo_blocks.h"
#include "quant_wo_bf16.h"
#include "quant_wo_fma8.h"
#include "quant_wo_vnni.h"
#include "quant_wo_nv.h"
#include "quant_int8_blocks.h"
#include "quant_wo8_fixed_avx2.h"
#include "quant_amx_int8.h"

// y [M, N] = x @ ((q - zero) * scale)^T (+ bias) for either weight layout (K columns; base describes the weights
// and the fp32 path's x layout). acc = sum_g s * (x_g . q_g) from the block kernels, then y = acc - sum_g z * s *
// sum(x_g) (+ bias), rounded once to x's dtype; into out_into when defined (a contiguous [M, N] tensor of x's dtype
// that does not overlap x), else a new tensor.
at::Tensor weight_only_linear(const at::Tensor& x, const WoArgs& base, bool int4, int64_t k, int64_t n_out,
                              const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias,
                              const at::Tensor& out_into) {
  const int64_t m_rows = x.size(0), groups = base.groups;
  const bool has_zero = zero.has_value() && zero->defined();
  if (has_zero) check_vec(*zero, "zero", n_out * groups, at::kFloat);
  const float* zp = has_zero ? zero->data_ptr<float>() : nullptr;
  thread_local WoVnniScratch scratch_v;  // the workers read it during this call only
  WoVnniArgs v{static_cast<const uint8_t*>(base.w), base.ldw, (base.ldw + 63) / 64, nullptr, nullptr, nullptr,
               base.scale, groups, nullptr, nullptr, int4 && !use_vnni() ? zp : nullptr, nullptr};
  const bool vnni = wo_vnni_applies(x, int4, groups, k / groups) &&
                    (int4 ? wo_vnni_prepare<4>(x, k, groups, v, scratch_v)
                          : wo_vnni_prepare<8>(x, k, groups, v, scratch_v));
  if (base.blocked && (!vnni || use_vnni())) return at::Tensor();  // only the AVX2 int4 kernel reads blocks
  v.blocked = base.blocked;
  const bool bf16 = !vnni && wo_bf16_applies(x, int4, groups, k / groups);
  const bool fma8 = !int4 && !vnni && !bf16 && wo8_fma_applies(x, groups, k / groups);
  thread_local Wo8FixedScratch scratch_8;  // the workers read it during this call only
  Wo8FixedArgs f8{static_cast<const int8_t*>(base.w), base.ldw, k, base.scale, groups, k / groups, nullptr, 0, nullptr};
  const bool fixed8 = !int4 && !vnni && !bf16 && !fma8 && wo8_fixed_applies(x, groups, k / groups) &&
                      wo8_fixed_prepare(x, k, f8, scratch_8);
  const bool zero_folded = vnni && v.zero != nullptr;  // the AVX2 int4 kernel subtracts z * s * sum(x_g) itself
  const std::vector<float> xsum = x_group_sums(x, groups, (has_zero && !zero_folded) || fma8);
  WoArgs a = base;
  std::vector<float> xf;
  WoBf16Args b{static_cast<const uint8_t*>(base.w), base.ldw, (base.ldw + 63) / 64, base.ldw / 64, nullptr, 0,
               nullptr, 0, base.scale, groups, k / groups, 0};
  thread_local WoBf16Scratch scratch;  // the workers read it during this call only
  thread_local std::vector<float> scratch_f;
  const int64_t bw = int4 ? bf16_block(true) : 64;  // columns per 64-byte chunk
  b.span = groups == 1 ? b.nblocks : (b.gs % bw == 0 ? b.gs / bw : 1);
  WoFma8Args f{b, nullptr, xsum.data()};
  if (bf16) {
    wo_bf16_prepare(x, int4, b, scratch);
  } else if (fma8) {
    wo8_fma_prepare(x, f, scratch_f);
  } else if (!vnni && !fixed8) {
    xf = float_rows(x, base.kp, int4 ? 32 : 0);
    a.xf = xf.data();
    a.ldx = base.kp;
  }
  const std::vector<float> bv = float_bias(bias, n_out);
  const at::Tensor out = ascent_out::out_or_new(out_into, m_rows, n_out, x);
  const Store store{out.data_ptr(), out.scalar_type(), n_out};
  const int64_t m_step = vnni ? kVnniMaxM : (bf16 || fma8 ? kBf16MaxM : (fixed8 ? kWo8FixedMaxM : 2));
  const int64_t span = (vnni && !use_vnni()) || fixed8 ? kSpanRows : kRowBlock;  // rows per kernel call
  // y[r] (token m, rows n + r) -> the zero points' correction and the bias, then stored
  const auto finish = [&](int64_t m, int64_t n, int64_t rows, float* y) {
    for (int64_t r = 0; r < rows && ((has_zero && !zero_folded) || !bv.empty()); ++r) {
      if (has_zero && !zero_folded)
        for (int64_t g = 0; g < groups; ++g)
          y[r] -= zp[(n + r) * groups + g] * a.scale[(n + r) * groups + g] * xsum[m * groups + g];
      if (!bv.empty()) y[r] += bv[n + r];
    }
    store.row(m, n, rows, y);
  };
  parallel_rows(n_out, [&](int64_t begin, int64_t end) {
    float acc[std::max({kBf16MaxM * kRowBlock, kVnniMaxM * kSpanRows, kWo8FixedMaxM * kSpanRows})];
    if (fixed8 && m_rows <= kWo8FixedMaxM) begin = wo8_fixed_streams_avx2(f8, begin, end, m_rows, finish);
    if (vnni && v.blocked && !use_vnni() && m_rows == 1) begin = wo_fixed_blocked_streams(v, begin, end, finish);
    for (int64_t n = begin; n < end; n += span) {
      const int64_t rows = std::min(span, end - n);
      for (int64_t m0 = 0; m0 < m_rows; m0 += m_step) {
        const int64_t mb = std::min(m_step, m_rows - m0);
        if (vnni) wo_vnni_block(v, int4, n, rows, m0, mb, acc);
        else if (bf16) wo_bf16_block(b, int4, n, rows, m0, mb, acc);
        else if (fma8) wo8_fma_block(f, n, rows, m0, mb, acc);
        else if (fixed8) wo8_fixed_block_avx2(f8, n, rows, m0, mb, acc);
        else wo_block(a, int4, n, rows, m0, mb, acc);
        for (int64_t m = 0; m < mb; ++m) finish(m0 + m, n, rows, acc + m * rows);
      }
    }
  });
  return out;
}

}  // namespace

#include "quant_wo_plan.h"
#include "quant_w4_layouts.h"

// Per-token symmetric int8 quantization of x [M, K] with the torch reference's rounding (s = max|x| / 127, q =
// clamp(nearbyint(x / s), -128, 127), all-zero rows s = 0): xq [M, ldx] as stored(q, vnni), zero padded; sx [M].
void quantize_rows_dynamic(const at::Tensor& x, int64_t k, int64_t ldx, bool vnni, std::vector<uint8_t>& xq,
                           std::vector<float>& sx) {
  xq.assign(static_cast<size_t>(x.size(0) * ldx), 0);
  sx.assign(static_cast<size_t>(x.size(0)), 0.f);
  for_float_rows(x, k, [&](int64_t m, const float* p) {
    const float amax = use_avx512() ? amax_avx512(p, k) : (use_avx2() ? amax_avx2(p, k) : amax_scalar(p, k));
    if (!std::isfinite(amax)) {  // a NaN / inf in the row: its outputs are NaN, as dequantize -> matmul gives
      sx[m] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    sx[m] = amax / 127.f;
    const float div = sx[m] > 0.f ? sx[m] : 1.f;
    uint8_t* q = xq.data() + m * ldx;
    if (use_avx512()) return quant_row_avx512(p, k, div, vnni, q);
    if (use_avx2()) return quant_row_avx2(p, k, div, 0.f, vnni, q);
    for (int64_t j = 0; j < k; ++j)
      q[j] = stored(static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(p[j] / div)))), vnni);
  });
}

// Per-tensor static int8 quantization of x [M, K]: q = clamp(nearbyint(x / s + z), -128, 127) as stored(q, vnni) in
// xq [M, ldx], zero padded.
void quantize_rows_static(const at::Tensor& x, int64_t k, int64_t ldx, bool vnni, float s, float z,
                          std::vector<uint8_t>& xq) {
  xq.assign(static_cast<size_t>(x.size(0) * ldx), 0);
  for_float_rows(x, k, [&](int64_t m, const float* p) {
    uint8_t* q = xq.data() + m * ldx;
    if (use_avx512()) return quant_row_static_avx512(p, k, s, z, vnni, q);
    if (use_avx2()) return quant_row_avx2(p, k, s, z, vnni, q);
    for (int64_t j = 0; j < k; ++j)
      q[j] = stored(static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(p[j] / s + z)))), vnni);
  });
}

// Dynamic W8A8: y = (q_x . W_q) * s_x[m] * w_scale[n] (+ bias), q_x / s_x per-token symmetric int8 (torch rounding).
at::Tensor w8a8_dynamic_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& row_sum,
                               const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  check_int8_weight(weight, row_sum);
  const int64_t n = weight.size(0), k = weight.size(1), ldx = (k + 63) / 64 * 64;
  const at::Tensor x = rows_of(x_in, k);
  check_vec(w_scale, "w_scale", n, at::kFloat);
  const bool vnni = use_vnni();
  std::vector<uint8_t> xq;
  std::vector<float> sx;
  quantize_rows_dynamic(x, k, ldx, vnni, xq, sx);
  const std::vector<float> b = float_bias(bias, n);
  const float* ws = w_scale.data_ptr<float>();
  return like_x(int8_linear(x, xq, ldx, vnni, weight, row_sum.data_ptr<int32_t>(), [&](int64_t m, int64_t j,
                                                                                         int32_t acc) {
    const float y = static_cast<float>(acc) * sx[m] * ws[j];
    return b.empty() ? y : y + b[j];
  }), x_in);
}

// The static W8A8 quant_bias int32 [N] (checked), null when absent.
const int32_t* quant_bias_of(const c10::optional<at::Tensor>& quant_bias, int64_t n) {
  if (!quant_bias.has_value() || !quant_bias->defined()) return nullptr;
  check_vec(*quant_bias, "quant_bias", n, at::kInt);
  return quant_bias->data_ptr<int32_t>();
}

#include "quant_amx_ops.h"

#include "quant_int8_nv.h"

// Static W8A8: q_x = clamp(nearbyint(x / s_x + z_x)), y = (q_x . W_q + quant_bias[n]) * deq[n] (+ bias).
at::Tensor w8a8_static_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& row_sum,
                              double input_scale, double input_offset, const at::Tensor& deq,
                              const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& bias) {
  check_int8_weight(weight, row_sum);
  const int64_t n = weight.size(0), k = weight.size(1), ldx = (k + 63) / 64 * 64;
  const at::Tensor x = rows_of(x_in, k);
  check_vec(deq, "deq", n, at::kFloat);
  const int32_t* qb = quant_bias_of(quant_bias, n);
  const bool vnni = use_vnni();
  std::vector<uint8_t> xq;
  quantize_rows_static(x, k, ldx, vnni, static_cast<float>(input_scale), static_cast<float>(input_offset), xq);
  const std::vector<float> b = float_bias(bias, n);
  const float* dp = deq.data_ptr<float>();
  return like_x(int8_linear(x, xq, ldx, vnni, weight, row_sum.data_ptr<int32_t>(), [&](int64_t, int64_t j,
                                                                                         int32_t acc) {
    const int32_t a = qb ? static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(qb[j])) : acc;
    const float y = static_cast<float>(a) * dp[j];
    return b.empty() ? y : y + b[j];
  }), x_in);
}

// Tests: the best available ISA (0), the portable path only (1), or at most AVX2 + FMA (2: the weight-only AVX2
// kernels of quant_wo_avx2.h on any CPU that has AVX2); returns the previous setting.
int64_t set_force_generic(int64_t value) {
  TORCH_CHECK(value >= 0 && value <= 2, "set_force_generic: value must be 0, 1 or 2, got ", value);
  const int64_t old = g_force_generic;
  g_force_generic = static_cast<int>(value);
  return old;
}

// Tests: route W8A16 with bf16 x through the VDPBF16PS kernel (1) or the FMA one (0, default); returns the previous.
int64_t set_wo_bf16_int8(int64_t value) {
  const int64_t old = g_wo_bf16_int8;
  g_wo_bf16_int8 = static_cast<int>(value);
  return old;
}

// Tests: weight-only with 16-bit x through the VNNI fixed-point kernels (1, default) or the floating-point ones (0).
int64_t set_wo_vnni(int64_t value) {
  const int64_t old = g_wo_vnni;
  g_wo_vnni = static_cast<int>(value);
  return old;
}

// quant_wo_nv.h's kernels: y [M, N] = x [M, K] @ ((q - zero) * scale)^T (+ bias) on wo_nv_pack's layout.
at::Tensor wo_nv_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t bits, int64_t n, int64_t k,
                        const at::Tensor& scale_nk, const c10::optional<at::Tensor>& zero_nk,
                        const at::Tensor& scale_nv,
                        const c10::optional<at::Tensor>& zs_nv, const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = rows_of(x_in, k);
  return like_x(wo_nv_linear_impl(x, packed, bits, n, k, scale_nk, zero_nk, scale_nv, zs_nv, bias), x_in);
}

// Which ISA the kernels use now: "avx512[-vnni][-bf16]", "avx2" (weight-only kernels) or "generic".
std::string isa() {
  if (!use_avx512()) return use_avx2() ? "avx2" : "generic";
  return std::string("avx512") + (use_vnni() ? "-vnni" : "") + (use_bf16() ? "-bf16" : "");
}

}  // namespace ascent_quant

#ifndef ASCENT_EMBEDDED_KERNELS  // decode_stack_cpu.cpp may include this file into its own module

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a16_linear", &ascent_quant::w8a16_linear,
        "w8a16_linear(x [...,K], weight int8 [N,K], scale f32 [N,G], zero, bias) -> [...,N]");
  m.def("w4a16_pack", &ascent_quant::w4a16_pack, "w4a16_pack(q int8 [N,K] in [-8,7]) -> uint8 [N, ceil(K/2)]");
  m.def("w4a16_linear", &ascent_quant::w4a16_linear,
        "w4a16_linear(x [...,K], packed uint8, K, scale f32 [N,G], zero, bias) -> [...,N]");
  m.def("w4a16_block_pack", &ascent_quant::w4a16_block_pack, "w4a16_block_pack(packed [N,K/2]) -> the AVX2 blocks");
  m.def("w4a16_block_unpack", &ascent_quant::w4a16_block_unpack, "w4a16_block_unpack(blocked) -> w4a16_pack's rows");
  m.def("w4a16_linear_blocked", &ascent_quant::w4a16_linear_blocked,
        "w4a16_linear_blocked(x [...,K], blocked uint8, K, scale f32 [N,G], zero, bias) -> [...,N]");
  m.def("wo_nv_pack", &ascent_quant::wo_nv_pack, "wo_nv_pack(q int8 [N,K], bits, offset=-1) -> uint8 [Npad/64, "
        "K steps, 4, 64]", py::arg("q"), py::arg("bits"), py::arg("offset") = -1);
  m.def("w8a8_dynamic_linear_nv", &ascent_quant::w8a8_dynamic_linear_nv,
        "w8a8_dynamic_linear_nv(x [...,K], packed (offset 0), row_sum i32 [N], w_scale f32 [N], bias) -> [...,N]");
  m.def("w8a8_static_linear_nv", &ascent_quant::w8a8_static_linear_nv,
        "w8a8_static_linear_nv(x, packed (offset 0), row_sum, input_scale, input_offset, deq, quant_bias, bias)");
  m.def("wo_nv_linear", &ascent_quant::wo_nv_linear,
        "wo_nv_linear(x [...,K], packed, bits, N, K, scale [N,G], zero, scale_nv, zs_nv, bias) -> [...,N]");
  m.def("w8a8_dynamic_linear", &ascent_quant::w8a8_dynamic_linear,
        "w8a8_dynamic_linear(x [...,K], weight int8 [N,K], row_sum i32 [N], w_scale f32 [N], bias)");
  m.def("amx_int8_available", &ascent_quant::amx_int8_available, "amx_int8_available() -> AMX-INT8 usable");
  m.def("w8a8_amx_pack", &ascent_quant::w8a8_amx_pack, "w8a8_amx_pack(W int8 [N,K]) -> [N/16, K/64, 16, 64]");
  m.def("w8a8_dynamic_linear_amx", &ascent_quant::w8a8_dynamic_linear_amx,
        "w8a8_dynamic_linear_amx(x [...,K], wp, w_scale f32 [N], bias) -> [...,N] (bit-identical to the VNNI one)");
  m.def("w8a16_linear_amx", &ascent_quant::w8a16_linear_amx,
        "w8a16_linear_amx(x 16-bit [...,K], wp, scale f32 [N], bias) -> [...,N]; empty if x is not finite");
  m.def("w8a8_static_linear_amx", &ascent_quant::w8a8_static_linear_amx,
        "w8a8_static_linear_amx(x, wp, input_scale, input_offset, deq, quant_bias, bias) (bit-identical to VNNI)");
  m.def("w8a8_static_linear", &ascent_quant::w8a8_static_linear,
        "w8a8_static_linear(x, weight, row_sum, input_scale, input_offset, deq f32 [N], quant_bias i32 [N], bias)");
  m.def("set_force_generic", &ascent_quant::set_force_generic, "set_force_generic(1|0) -> previous");
  m.def("set_wo_bf16_int8", &ascent_quant::set_wo_bf16_int8, "set_wo_bf16_int8(1|0) -> previous (tests)");
  m.def("set_wo_vnni", &ascent_quant::set_wo_vnni, "set_wo_vnni(1|0) -> previous (tests)");
  m.def("set_wo_streams", &ascent_quant::set_wo_streams, "set_wo_streams(1|0) -> previous (tests)");
  m.def("isa", &ascent_quant::isa, "isa() -> the instruction set the kernels use");
}
#endif  // ASCENT_EMBEDDED_KERNELS
