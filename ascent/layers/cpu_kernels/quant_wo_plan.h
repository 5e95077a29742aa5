// Weight-only linears (W8A16, W4A16 in either int4 layout) as a plan of checked operands and its run, and the
// tensor-level entry points built on them. Included into quant_gemv_cpu.cpp after weight_only_linear, inside
// namespace ascent_quant.
#pragma once

namespace {

// The checked operands of w4a16_linear (packed [N, ceil(K/2)], G = 1 or K/G % 32 == 0) without x.
WoArgs w4a16_args(const at::Tensor& packed, int64_t k, const at::Tensor& scale) {
  check_weight(packed, at::kByte);
  const int64_t n = packed.size(0);
  TORCH_CHECK(k > 0 && packed.size(1) == (k + 1) / 2, "packed must be [N, ", (k + 1) / 2, "] for K = ", k,
              ", got ", packed.sizes());
  const int64_t groups = check_scales(scale, n, k);
  TORCH_CHECK(groups == 1 || (k / groups) % 32 == 0, "int4 group size must be a multiple of 32, got ", k / groups);
  const int64_t kp = (k + 31) / 32 * 32;  // the fp32 path's x: de-interleaved 32-column blocks, zero padded
  return WoArgs{nullptr, 0, packed.data_ptr(), packed.size(1), kp, scale.data_ptr<float>(), groups,
                groups == 1 ? kp : k / groups};
}

}  // namespace

// A weight-only projection's operands, checked once. The decode stack plans each projection at its first call and
// then runs it every step without reading the operand tensors' metadata, which the weight stream has evicted from the
// caches by then.
struct WoPlan {
  WoArgs args{};
  bool int4 = false;
  int64_t k = 0, n = 0;
  at::Tensor weight, scale;  // the blocked layout's fallback (run_wo)
  c10::optional<at::Tensor> zero, bias;
};

// q int8 [N, K], scale / zero fp32 [N, G].
WoPlan plan_w8a16(const at::Tensor& weight, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                  const c10::optional<at::Tensor>& bias) {
  check_weight(weight, at::kChar);
  const int64_t n = weight.size(0), k = weight.size(1), groups = check_scales(scale, n, k);
  return {WoArgs{nullptr, 0, weight.data_ptr(), k, k, scale.data_ptr<float>(), groups, k / groups}, false, k, n,
          weight, scale, zero, bias};
}

// q from w4a16_pack's layout (G = 1 or K/G % 32 == 0), or from the blocked one (quant_w4_layouts.h; K and the group
// size multiples of 64).
WoPlan plan_w4a16(const at::Tensor& packed, int64_t k, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                  const c10::optional<at::Tensor>& bias, bool blocked) {
  WoPlan plan{w4a16_args(packed, k, scale), true, k, packed.size(0), packed, scale, zero, bias};
  TORCH_CHECK(!blocked || (k % 64 == 0 && (plan.args.groups == 1 || plan.args.gs % 64 == 0)),
              "the blocked int4 layout needs K and the group size to be multiples of 64, got K = ", k, ", group ",
              plan.args.gs);
  plan.args.blocked = blocked;
  return plan;
}

at::Tensor w4a16_block_unpack(const at::Tensor& blocked);

// y [..., N] = x [..., K] @ ((q - zero) * scale)^T (+ bias). The blocked layout is read by the AVX2 int4 kernel
// only: any other call (fp32 x, x with a NaN / inf, another CPU, the kernels switched off by tests) runs on the
// rows, restored for that call. Into out_into when defined (x_in then 2-D; see weight_only_linear), else a new tensor.
at::Tensor run_wo(const at::Tensor& x_in, const WoPlan& plan, const at::Tensor& out_into = at::Tensor()) {
  TORCH_CHECK(!out_into.defined() || x_in.dim() == 2, "run_wo: an out tensor needs a 2-D x, got ", x_in.sizes());
  const at::Tensor x = rows_of(x_in, plan.k);
  const at::Tensor y = weight_only_linear(x, plan.args, plan.int4, plan.k, plan.n, plan.zero, plan.bias, out_into);
  if (y.defined()) return like_x(y, x_in);
  const WoPlan rows = plan_w4a16(w4a16_block_unpack(plan.weight), plan.k, plan.scale, plan.zero, plan.bias, false);
  return run_wo(x_in, rows, out_into);
}

// y [M, N] = x [M, K] @ ((q - zero) * scale)^T (+ bias); q int8 [N, K], scale / zero fp32 [N, G].
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias) {
  return run_wo(x, plan_w8a16(weight, scale, zero, bias));
}

// y [M, N] = x [M, K] @ ((q - zero) * scale)^T (+ bias) with q from w4a16_pack's layout; G = 1 or K/G % 32 == 0.
at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t k, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias) {
  return run_wo(x, plan_w4a16(packed, k, scale, zero, bias, false));
}
