// The decoder-layer stack of a dense Llama-style model for one decode step, as one C++ call.
//
// After the weight stream of a decode step the caches are cold, and every Python-level op (module call, attribute
// lookup, tensor view, dispatch) then costs several microseconds; across ~12 module calls per layer that is a few
// milliseconds per step, a third of a batch-1 SmolLM2 step. DecodeStack holds the layer weights once and runs, per
// layer, exactly the kernels the Python modules call (fused_cpu.cpp, gemv_cpu.cpp, included below), in the same order
// with the same arguments, so its output is bit-identical to the module path.
#define ASCENT_EMBEDDED_KERNELS
#include "fused_cpu.cpp"
#include "gemv_cpu.cpp"
#include "quant_gemv_cpu.cpp"
#include "amx_linear_cpu.cpp"
#undef ASCENT_EMBEDDED_KERNELS

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <memory>
#include <tuple>
#include <vector>

namespace {

c10::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// cpu_packing.packed_linear: an fp32 GEMM copy (CPUs without native 16-bit GEMM) takes x widened to fp32 and rounds
// once to x's dtype; a oneDNN-packed weight goes to torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [],
// "") through the dispatcher (boxed: the op's C++ signature is not part of torch's public headers).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  if (packed.scalar_type() == at::kFloat) {
    const c10::optional<at::Tensor> bias32 =
        bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    at::Tensor out = at::linear(x.to(at::kFloat), packed, bias32);
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<c10::Scalar>>(),
                          c10::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// cpu_packing.cpu_linear's choice for an unquantized projection: the AMX tiles up to amx_max rows (0 = none), else the
// small-M kernel up to small_m_max rows (0 = no plain weight kept), else the oneDNN-packed weight when there is one,
// else F.linear.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias_t,
                        const at::Tensor& packed, const at::Tensor& amx, const at::Tensor& panels,
                        int64_t small_m_max, int64_t amx_max) {
  const c10::optional<at::Tensor> bias = optional_tensor(bias_t);
  if (x.size(0) <= amx_max) return ascent_amx::amx_linear(x, amx, bias);
  if (x.size(0) <= small_m_max) return linear_small_m(x, weight, bias, false, optional_tensor(panels));
  if (packed.defined() && packed.numel() > 0) return packed_linear(x, packed, bias);
  return at::linear(x, weight, bias);
}

// `reuse` as a contiguous [like rows, n] tensor of like's dtype (like 2-D): a step buffer of the decode stack,
// allocated when it is not one already (the step's first layer).
const at::Tensor& step_buffer(at::Tensor& reuse, const at::Tensor& like, int64_t n) {
  if (!reuse.defined() || reuse.size(0) != like.size(0) || reuse.size(1) != n ||
      reuse.scalar_type() != like.scalar_type())
    reuse = at::empty({like.size(0), n}, like.options());
  return reuse;
}

// One projection of a layer: which kernel computes x @ W^T (+ bias) and the operands it takes, in the order the
// Python side (``LinearMethod.decode_stack_call``) gives them.
// An empty tensor stands for an absent optional operand. The small-M dense, NV-layout and weight-only kinds check
// their weight-side operands at their first call and then keep raw pointers into `tensors` (which keep them alive):
// the per-step call no longer reads those tensors' metadata, which the weight stream has evicted from the caches by
// then (measured on a Zen 4, SmolLM2 decode stack + head, interleaved pairs: W8A8 1.018-1.033x, bf16 1.018x, W8A16
// 1.035x, W4A16 1.051x on the NV layout; on a Zen 3, the stack alone, the AVX2 weight-only kernels: W4A16 blocked
// 0.977x, W8A16 0.974x the time).
struct LinearCall {
  enum Kind : int64_t {
    kDense = 0, kW8A16 = 1, kW4A16 = 2, kW8A8Dynamic = 3, kW8A8DynamicAmx = 4, kW8A8StaticAmx = 5,
    kW8A16Amx = 6, kW8A8Static = 7, kWoNv = 8, kW8A8DynamicNv = 9,
    kW8A8StaticNv = 10, kWoAmx = 11
  };
  int64_t kind = kDense;
  // kDense: [weight [N, K] bf16/fp16 (empty when no plain copy is kept), bias, oneDNN-packed weight, AMX tiles,
  // the small-M kernel's prepacked panels (pack_panels)] with ints [small-M kernel row limit, AMX row limit];
  // kW8A16 / kW4A16: [weight (int8 [N, K] / packed int4), scale,
  // zero, bias] with ints [K, 1 when the weight is in the blocked layout (quant_w4_layouts.h) else 0] for kW4A16;
  // kW8A8Dynamic: [weight int8 [N, K], row_sum, w_scale, bias]; kW8A8DynamicAmx: [AMX-INT8 packed weight, w_scale,
  // bias, unused]; kW8A8StaticAmx: [packed weight, deq, quant_bias, bias, fp32 [input_scale, input_offset]];
  // kW8A16Amx: kW8A16's tensors and the AMX-INT8 packed weight, ints [small-M row limit] (the small-M kernel up to
  // it, the AMX one above); kW8A8Static: [weight int8 [N, K], row_sum, deq, quant_bias, bias, fp32 [input_scale,
  // input_offset]]; kWoNv: [packed (wo_nv_pack), scale [N, G], zero [N, G], scale_nv, zero * scale nv, bias] with
  // ints [bits, N, K]; kW8A8DynamicNv / kW8A8StaticNv: kW8A8Dynamic's / kW8A8Static's with the weight packed
  // (wo_nv_pack offset 0); kWoAmx: [tiles, coef (amx_w4_pack / amx_w8_pack), bias, the inner call's tensors] with
  // ints [row limit, inner kind, the inner call's ints]: the inner call up to the limit, amx_wo_linear above it.
  // See quantization/kernels.py.
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> ints;
  mutable ascent_quant::W8A8DynamicNv w8a8_nv;  // kW8A8DynamicNv's operands, checked at its first call
  mutable ascent_quant::W8A8StaticNv w8a8_static_nv;  // kW8A8StaticNv's, likewise
  mutable ascent_quant::WoNvPlan wo_nv;                // kWoNv's, likewise
  mutable SmallMLinear small_m;                  // kDense's small-M kernel operands, checked at its first call
  mutable ascent_quant::WoPlan wo;               // kW8A16's, kW4A16's and kW8A16Amx's, likewise
  std::shared_ptr<const LinearCall> inner;       // kWoAmx's call for the rows below its limit
  mutable ascent_par::StreamHint amx_stream;     // stream_hint's for amx_rows rows
  mutable int64_t amx_rows = -1;

  // The weight-only operands (kW8A16 / kW8A16Amx: tensors 0-3; kW4A16: tensors 0-3 and ints [K, blocked]).
  const ascent_quant::WoPlan& wo_plan() const {
    const auto& t = tensors;
    if (wo.args.w == nullptr)
      wo = kind == kW4A16 ? ascent_quant::plan_w4a16(t[0], ints[0], t[1], optional_tensor(t[2]),
                                                     optional_tensor(t[3]), ints[1] != 0)
                          : ascent_quant::plan_w8a16(t[0], t[1], optional_tensor(t[2]), optional_tensor(t[3]));
    return wo;
  }

  // y [M, N] = x [M, K] @ W^T (+ bias). The kernels that write into a given tensor (the small-M dense one, the
  // weight-only ones) write into `reuse`, (re)allocated as [M, N] first when it is not that already: a step's buffer
  // that every layer reuses (a decode step then allocates per step, not per layer). Other kinds return a new tensor.
  at::Tensor run(const at::Tensor& x, at::Tensor& reuse) const {
    const auto& t = tensors;
    switch (kind) {
      case kDense: {
        if (x.size(0) <= ints[1] || x.size(0) > ints[0])
          return dense_linear(x, t[0], t[1], t[2], t[3], t[4], ints[0], ints[1]);
        if (small_m.weight == nullptr)
          small_m = plan_linear_small_m(t[0], optional_tensor(t[1]), optional_tensor(t[4]));
        return run_linear_small_m(x, small_m, step_buffer(reuse, x, small_m.n));
      }
      case kW8A16:
      case kW4A16: return ascent_quant::run_wo(x, wo_plan(), step_buffer(reuse, x, wo_plan().n));
      case kW8A8Dynamic: return ascent_quant::w8a8_dynamic_linear(x, t[0], t[1], t[2], optional_tensor(t[3]));
      case kW8A8DynamicAmx: return ascent_quant::w8a8_dynamic_linear_amx(x, t[0], t[1], optional_tensor(t[2]));
      case kW8A16Amx: {
        const auto small_m = [&] { return ascent_quant::run_wo(x, wo_plan()); };
        const bool x16 = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
        if (x.size(0) <= ints[0] || !x16) return small_m();
        at::Tensor y = ascent_quant::w8a16_linear_amx(x, t[4], t[1].view({-1}), optional_tensor(t[3]));
        return y.defined() ? y : small_m();  // x with a NaN / inf
      }
      case kW8A8StaticAmx: {
        const float* so = t[4].data_ptr<float>();
        return ascent_quant::w8a8_static_linear_amx(x, t[0], so[0], so[1], t[1], optional_tensor(t[2]),
                                                    optional_tensor(t[3]));
      }
      case kW8A8Static: {
        const float* so = t[5].data_ptr<float>();
        return ascent_quant::w8a8_static_linear(x, t[0], t[1], so[0], so[1], t[2], optional_tensor(t[3]),
                                                optional_tensor(t[4]));
      }
      case kW8A8DynamicNv: {
        const int64_t k = x.size(-1);
        if (w8a8_nv.packed == nullptr || w8a8_nv.k != k)
          w8a8_nv = ascent_quant::plan_w8a8_dynamic_nv(t[0], t[1], t[2], optional_tensor(t[3]), k);
        return ascent_quant::run_w8a8_dynamic_nv(x, w8a8_nv);
      }
      case kW8A8StaticNv: {
        const int64_t k = x.size(-1);
        if (w8a8_static_nv.packed == nullptr || w8a8_static_nv.k != k)
          w8a8_static_nv = ascent_quant::plan_w8a8_static_nv(t[0], t[1], t[5].data_ptr<float>(), t[2],
                                                             optional_tensor(t[3]), optional_tensor(t[4]), k);
        return ascent_quant::run_w8a8_static_nv(x, w8a8_static_nv);
      }
      case kWoNv:
        if (wo_nv.packed == nullptr)
          wo_nv = ascent_quant::plan_wo_nv(t[0], ints[0], ints[1], ints[2], t[1], optional_tensor(t[2]), t[3],
                                           optional_tensor(t[4]), optional_tensor(t[5]));
        return ascent_quant::run_wo_nv(x, wo_nv);
      case kWoAmx:
        if (x.size(0) <= ints[0] || x.scalar_type() != at::kBFloat16) return inner->run(x, reuse);
        return ascent_amx::amx_wo_linear(x, t[0], t[1], optional_tensor(t[2]));
      default: TORCH_CHECK(false, "DecodeStack: unknown linear kind ", kind);
    }
  }

  // The weight stream run(x of `rows` rows) reads, for the team's warm-ahead (warm_ahead.h): the AMX bf16 tiles' and
  // the AMX-INT8 tiles' one-row stream (kept from the first call on, like the kernels' operands); empty otherwise.
  ascent_par::StreamHint stream_hint(int64_t rows) const {
    const bool amx_int8 = kind == kW8A8DynamicAmx || kind == kW8A8StaticAmx;
    if (!(kind == kDense && rows <= ints[1]) && !amx_int8) return {};
    if (amx_rows != rows) {
      amx_stream = amx_int8 ? ascent_quant::amx_i8_stream(tensors[0], rows) : ascent_amx::amx_stream(tensors[3], rows);
      amx_rows = rows;
    }
    return amx_stream;
  }

  static LinearCall make(int64_t kind, std::vector<at::Tensor> tensors, std::vector<int64_t> ints) {
    if (kind == kWoAmx) return make_wo_amx(std::move(tensors), std::move(ints));
    const size_t want_tensors = kind == kDense || kind == kW8A8StaticAmx || kind == kW8A16Amx ? 5
                                : kind == kW8A8Static || kind == kWoNv || kind == kW8A8StaticNv ? 6 : 4;
    const size_t want_ints = kind == kDense || kind == kW4A16 ? 2 : (kind == kW8A16Amx ? 1 : (kind == kWoNv ? 3 : 0));
    TORCH_CHECK(kind >= kDense && kind <= kW8A8StaticNv && tensors.size() == want_tensors &&
                    ints.size() == want_ints,
                "DecodeStack: linear kind ", kind, " with ", tensors.size(), " tensors / ", ints.size(), " ints");
    const bool amx = kind == kW8A8DynamicAmx || kind == kW8A8StaticAmx;
    const bool nv = kind == kWoNv || kind == kW8A8DynamicNv || kind == kW8A8StaticNv;
    TORCH_CHECK(tensors[0].dim() == (amx || nv ? 4 : 2) ||
                    (kind == kDense && ints[0] == 0),
                "DecodeStack: weight operand of kind ", kind, " has ", tensors[0].dim(), " dims");
    if (kind == kW8A8StaticAmx || kind == kW8A8Static || kind == kW8A8StaticNv) {
      const at::Tensor& so = tensors.back();
      TORCH_CHECK(so.scalar_type() == at::kFloat && so.numel() == 2 && so.is_contiguous(),
                  "DecodeStack: kind ", kind, " needs fp32 [input_scale, input_offset]");
    }
    return LinearCall{kind, std::move(tensors), std::move(ints)};
  }

  static LinearCall make_wo_amx(std::vector<at::Tensor> tensors, std::vector<int64_t> ints) {
    TORCH_CHECK(tensors.size() > 3 && ints.size() >= 2 && ints[1] != kWoAmx && tensors[0].dim() == 4,
                "DecodeStack: linear kind ", kWoAmx, " with ", tensors.size(), " tensors / ", ints.size(), " ints");
    LinearCall call{kWoAmx, {tensors.begin(), tensors.begin() + 3}, {ints[0]}};
    call.inner = std::make_shared<const LinearCall>(
        make(ints[1], {tensors.begin() + 3, tensors.end()}, {ints.begin() + 2, ints.end()}));
    return call;
  }
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;
  at::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_size] (Qwen3), undefined when the model has none
  LinearCall qkv, o, gate_up, down;
  at::Tensor kv_planes;  // [2, S, kv_heads * head_size] view of the layer's cache
  at::Tensor kv_heads4;  // [2, S, kv_heads, head_size] view of the same storage
  int64_t window = 0;    // sliding window (0 = full attention)
};

using LinearSpec = std::tuple<int64_t, std::vector<at::Tensor>, std::vector<int64_t>>;

LinearCall make_call(const LinearSpec& spec) {
  return LinearCall::make(std::get<0>(spec), std::get<1>(spec), std::get<2>(spec));
}

// RotaryEmbedding.forward's torch ops (the path of q/k-normed models): x [T, heads * hs] -> rotated, new tensor.
at::Tensor rotate_like_torch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t hs,
                             int64_t rd, bool neox) {
  const int64_t t = x.size(0);
  at::Tensor heads = x.view({t, -1, hs});
  auto swap = [&](const at::Tensor& r) {
    if (neox) return at::cat({r.narrow(-1, rd / 2, rd / 2), r.narrow(-1, 0, rd / 2)}, -1);
    at::Tensor pairs = r.unflatten(-1, {-1, 2});
    return at::stack({pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(-2);
  };
  if (rd == hs) return at::add(at::mul(heads, cos), at::mul(swap(heads), sin)).view({t, -1});
  at::Tensor rot = heads.narrow(-1, 0, rd);
  at::Tensor rotated = at::add(at::mul(rot, cos), at::mul(swap(rot), sin));
  return at::cat({rotated, heads.narrow(-1, rd, hs - rd)}, -1).view({t, -1});
}

// A decode step's buffers, allocated at its first layer and written in place by the later ones: a step allocates a
// dozen tensors, not a dozen per layer, and views qkv's columns once (measured on a Zen 3, SmolLM2's stack alone,
// alternated in one process against a fresh set per layer: W4A16 0.900x, W8A16 0.900x, bf16 0.930x the time).
struct StepBuffers {
  at::Tensor normed, qkv, attn, o, gate_up, act, down;
  at::Tensor sums[2];  // residual sums, alternately: add_rms_norm's sum must not overlap its residual input
  int next_sum = 0;
  at::Tensor views_of;  // the qkv output the views below are of (held: its address is not reused meanwhile)
  at::Tensor q_rows, k_rows, v_rows, qk;

  // The next residual sum buffer, [rows, h] of like's dtype.
  const at::Tensor& sum(const at::Tensor& like) {
    at::Tensor& s = sums[next_sum];
    next_sum ^= 1;
    return step_buffer(s, like, like.size(1));
  }

  // qkv's q, k, v and q-and-k column ranges (q + kv + kv columns), made once per buffer.
  void view_qkv(const at::Tensor& qkv_rows, int64_t q, int64_t kv) {
    if (views_of.is_same(qkv_rows)) return;
    q_rows = qkv_rows.narrow(1, 0, q);
    k_rows = qkv_rows.narrow(1, q, kv);
    v_rows = qkv_rows.narrow(1, q + kv, kv);
    qk = qkv_rows.narrow(1, 0, q + kv);
    views_of = qkv_rows;
  }
};

}  // namespace

class DecodeStack {
 public:
  // Geometry shared by all layers; eps of the layer norms; rotary_dim/neox of the shared rotary embedding.
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double scale, double eps,
              int64_t rotary_dim, bool neox)
      : heads_(num_heads), kv_heads_(num_kv_heads), d_(head_size), scale_(scale), eps_(eps), rotary_dim_(rotary_dim),
        neox_(neox) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_size > 0,
                "DecodeStack: bad head geometry");
  }

  // Appends one layer. Each projection is (kind, tensors, ints) as ``LinearCall`` documents. kv_cache: the layer's
  // cache (any contiguous [2, ...] layout of width kv_heads * head_size).
  void add_layer(const at::Tensor& input_norm, const LinearSpec& qkv, const LinearSpec& o,
                 const at::Tensor& post_norm, const LinearSpec& gate_up, const LinearSpec& down,
                 const at::Tensor& kv_cache, int64_t window, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm) {
    const int64_t kv = kv_heads_ * d_;
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2 && kv_cache.numel() % (2 * kv) == 0,
                "DecodeStack: kv_cache must be a contiguous [2, ...] cache of width ", kv);
    DecodeLayer layer;
    layer.input_norm = input_norm;
    layer.post_norm = post_norm;
    layer.qkv = make_call(qkv);
    layer.o = make_call(o);
    layer.gate_up = make_call(gate_up);
    layer.down = make_call(down);
    layer.kv_planes = kv_cache.view({2, -1, kv});
    layer.kv_heads4 = kv_cache.view({2, -1, kv_heads_, d_});
    layer.window = window;
    for (const LinearCall* call : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      dense_rows_limit_ = std::min(dense_rows_limit_, own_kernel_rows(*call));
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value() && (!q_norm.has_value() || q_norm->numel() == d_),
                "DecodeStack: q_norm/k_norm must both be [head_size] or both absent");
    if (q_norm.has_value()) {
      layer.q_norm = *q_norm;
      layer.k_norm = *k_norm;
    }
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, H] (embeddings), cos_sin [T, 2 * rotary_dim] (the rotary cache rows of the positions), write_slots
  // int64 [T], decode_slots int64 [T, L], seq_lens int64 [T] -> (hidden, residual), each [T, H]; every token is a
  // decode token (one per request, rows in metadata order). With final_norm ([H], eps final_eps) hidden is the final
  // norm of hidden + residual and residual that sum (RMSNorm.forward(hidden, residual)); else both as the last layer
  // left them.
  // Steps of up to team_rows() rows run as one team of torch's threads (parallel_team.h): the same kernels, loops
  // and splits, without a fork and join per loop.
  std::vector<at::Tensor> forward(const at::Tensor& embeddings, const at::Tensor& cos_sin, const at::Tensor& write_slots,
                                  const at::Tensor& decode_slots, const at::Tensor& seq_lens,
                                  const c10::optional<at::Tensor>& final_norm, double final_eps) const {
    const auto layers = [&] {
      return forward_layers(embeddings, cos_sin, write_slots, decode_slots, seq_lens, final_norm, final_eps);
    };
    if (embeddings.size(0) <= team_rows()) return ascent_par::run_as_team(layers);
    return layers();
  }

  // The largest step run as a team: kTeamMaxRows, or less where a dense projection would leave this directory's
  // kernels for oneDNN / torch (whose own threads a team would serialize); set_team_rows(0) turns teams off.
  int64_t team_rows() const { return std::min(team_rows_, dense_rows_limit_); }
  void set_team_rows(int64_t rows) { team_rows_ = rows; }

 private:
  std::vector<at::Tensor> forward_layers(const at::Tensor& embeddings, const at::Tensor& cos_sin,
                                         const at::Tensor& write_slots, const at::Tensor& decode_slots,
                                         const at::Tensor& seq_lens, const c10::optional<at::Tensor>& final_norm,
                                         double final_eps) const {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
    StepBuffers buf;
    at::Tensor hidden = embeddings, residual = embeddings;
    const int64_t rows = embeddings.size(0);
    // Before each projection, the one after it: its weights are warmed while a thread waits (warm_ahead.h).
    const auto next_stream = [&](const LinearCall* call) {
      ascent_par::set_next_stream(call != nullptr ? call->stream_hint(rows) : ascent_par::StreamHint{});
    };
    next_stream(&layers_[0].qkv);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecodeLayer& l = layers_[i];
      if (i == 0) {
        rms_norm_into(hidden, l.input_norm, eps_, step_buffer(buf.normed, hidden, hidden.size(1)));
      } else {
        const at::Tensor& sum = buf.sum(hidden);
        const at::Tensor& normed = step_buffer(buf.normed, hidden, hidden.size(1));
        add_rms_norm_into(hidden, residual, l.input_norm, eps_, normed, sum);
        residual = sum;
      }
      next_stream(&l.o);
      const at::Tensor qkv = l.qkv.run(buf.normed, buf.qkv);
      const at::Tensor attn = attention(l, qkv, cos_sin, write_slots, decode_slots, seq_lens, buf);
      next_stream(&l.gate_up);
      const at::Tensor o = l.o.run(attn, buf.o);
      const at::Tensor& sum = buf.sum(o);
      add_rms_norm_into(o, residual, l.post_norm, eps_, step_buffer(buf.normed, o, o.size(1)), sum);
      residual = sum;
      next_stream(&l.down);
      const at::Tensor gate_up = l.gate_up.run(buf.normed, buf.gate_up);
      silu_and_mul_into(gate_up, step_buffer(buf.act, gate_up, gate_up.size(1) / 2));
      next_stream(i + 1 < layers_.size() ? &layers_[i + 1].qkv : nullptr);
      hidden = l.down.run(buf.act, buf.down);
    }
    if (final_norm.has_value()) return add_rms_norm(hidden, residual, *final_norm, final_eps);
    return {hidden, residual};
  }

  // One layer's attention from its qkv projection [T, q + 2 kv]: q and k normed (q/k-normed models) and rotated, k
  // and v written to the cache, the attention of q over it -> [T, q] (buf.attn, or a new tensor on the q/k-normed
  // path's torch ops).
  at::Tensor attention(const DecodeLayer& l, const at::Tensor& qkv, const at::Tensor& cos_sin,
                       const at::Tensor& write_slots, const at::Tensor& decode_slots, const at::Tensor& seq_lens,
                       StepBuffers& buf) const {
    const int64_t q = heads_ * d_, kv = kv_heads_ * d_;
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q + 2 * kv, "DecodeStack: qkv projection gave ", qkv.sizes());
    buf.view_qkv(qkv, q, kv);
    at::Tensor q_rows = buf.q_rows, k_rows = buf.k_rows;
    if (l.q_norm.defined()) {  // RopeSelfAttention with qk_norm: torch rms_norm per head, then torch RoPE
      const int64_t t = qkv.size(0);
      auto cs = cos_sin.unsqueeze(1).split(rotary_dim_, -1);
      q_rows = rotate_like_torch(at::rms_norm(q_rows.view({t, heads_, d_}), {d_}, l.q_norm, eps_).view({t, q}),
                                 cs[0], cs[1], d_, rotary_dim_, neox_);
      k_rows = rotate_like_torch(at::rms_norm(k_rows.view({t, kv_heads_, d_}), {d_}, l.k_norm, eps_).view({t, kv}),
                                 cs[0], cs[1], d_, rotary_dim_, neox_);
    } else {  // q and k columns rotated in place in one pass
      rotary_(buf.qk, cos_sin, d_, rotary_dim_, neox_);
    }
    at::Tensor planes = l.kv_planes;
    paged_kv_write(planes, k_rows, buf.v_rows, write_slots);
    return paged_decode_attention_into(q_rows, l.kv_heads4, decode_slots, seq_lens, heads_, scale_, l.window,
                                       step_buffer(buf.attn, q_rows, q));
  }

  // The rows up to which a dense projection stays on this directory's kernels (AMX tiles / small-M kernel).
  static int64_t own_kernel_rows(const LinearCall& call) {
    return call.kind == LinearCall::kDense ? std::max(call.ints[0], call.ints[1]) : kTeamMaxRows;
  }

  static constexpr int64_t kTeamMaxRows = 64;
  int64_t team_rows_ = kTeamMaxRows;
  int64_t dense_rows_limit_ = kTeamMaxRows;
  int64_t heads_, kv_heads_, d_;
  double scale_, eps_;
  int64_t rotary_dim_;
  bool neox_;
  std::vector<DecodeLayer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, bool>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("scale"), py::arg("eps"), py::arg("rotary_dim"),
           py::arg("neox"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("team_rows", &DecodeStack::team_rows)
      .def("set_team_rows", &DecodeStack::set_team_rows)
      .def("forward", &DecodeStack::forward, py::arg("embeddings"), py::arg("cos_sin"), py::arg("write_slots"),
           py::arg("decode_slots"), py::arg("seq_lens"), py::arg("final_norm") = py::none(),
           py::arg("final_eps") = 0.0);
}
