// Fused CPU kernels for the decode hot path (the CPU profile's RUNTIME_CUSTOM_OPS capability).
//
// Each kernel reproduces the rounding of the op-by-op torch path it replaces (fp32 arithmetic, one rounding to the
// tensor dtype where torch rounds), so results equal the torch ops up to the summation order of a row reduction.
// All tensors are CPU, row-major in their last dim; float32, bfloat16 and float16 are supported.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "out_rows.h"
#include "parallel_team.h"

namespace {

// Rows per parallel chunk for a row kernel doing `cost` element operations per row (SiLU counts its exp as ~8): a
// chunk is at least kChunkWork of them (a few microseconds, well above a pool wake-up), so batches of a few rows
// stay on the calling thread and larger ones split.
constexpr int64_t kChunkWork = 8192;
inline int64_t row_grain(int64_t cost) { return std::max<int64_t>(1, kChunkWork / std::max<int64_t>(cost, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous in its last dim");
}

using ascent_out::out_or_new;

// y = x / sqrt(mean(x^2) + eps) * w over each row of s (fp32 statistics, one rounding), as F.rms_norm.
template <typename T>
void rms_norm_row(const T* s, const T* w, T* y, int64_t h, float eps) {
  float acc = 0.f;
  for (int64_t j = 0; j < h; ++j) {
    const float v = static_cast<float>(s[j]);
    acc += v * v;
  }
  const float r = 1.f / std::sqrt(acc / static_cast<float>(h) + eps);
  for (int64_t j = 0; j < h; ++j) {
    y[j] = static_cast<T>(static_cast<float>(s[j]) * r * static_cast<float>(w[j]));
  }
}

// exp(x) for the SiLU: Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (relative
// error < 2 ulp for x in [-87, 88]; inputs are clamped there, where silu is x or 0 to fp32 precision anyway).
// Branch-free so the compiler vectorises the loop that calls it.
inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.f), 88.f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest integer
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33333377e-3f +
                  r * 1.38888892e-3f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#include "avx512_bf16.h"
#include "avx2_bf16.h"
#include "avx512_attention.h"
#include "avx2_attention.h"
#include "split_attention.h"
#include "amx_attention.h"
#include "avx512_prefill_attention.h"
#include "amx_prefill_attention.h"
#include "avx2_prefill_attention.h"

}  // namespace

// out[T, H] = rms_norm(x), into out_into when defined (see out_or_new), else a new tensor.
at::Tensor rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out_into) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [H] with x's dtype");
  const at::Tensor out = out_or_new(out_into, x.size(0), x.size(1), x);
  const int64_t rows = x.size(0), h = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    ascent_par::parallel_for(0, rows, row_grain(2 * h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if constexpr (std::is_same_v<scalar_t, bf16>) {
          if (has_avx512()) {
            rms_norm_row_avx512(as_bf16(xp + i * xs), as_bf16(wp), as_bf16(op + i * h), h, static_cast<float>(eps));
            continue;
          }
          if (has_avx2_fma()) {
            rms_norm_row_avx2(as_bf16(xp + i * xs), as_bf16(wp), as_bf16(op + i * h), h, static_cast<float>(eps));
            continue;
          }
        }
        rms_norm_row(xp + i * xs, wp, op + i * h, h, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_into(x, weight, eps, at::Tensor());
}

// out = rms_norm(x + residual), sum = x + residual: the sum is rounded to the dtype first, as torch's add would. out
// and sum: contiguous [T, H] tensors of x's dtype, overlapping neither x nor residual.
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       const at::Tensor& out_into, const at::Tensor& sum_into) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have the same shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [H] with x's dtype");
  const at::Tensor out = out_or_new(out_into, x.size(0), x.size(1), x);
  const at::Tensor sum = out_or_new(sum_into, x.size(0), x.size(1), x);
  const int64_t rows = x.size(0), h = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    ascent_par::parallel_for(0, rows, row_grain(2 * h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* srow = sp + i * h;
        if constexpr (std::is_same_v<scalar_t, bf16>) {
          if (has_avx512()) {
            add_rms_norm_row_avx512(as_bf16(xp + i * xs), as_bf16(rp + i * rs), as_bf16(wp), as_bf16(srow),
                                    as_bf16(op + i * h), h, static_cast<float>(eps));
            continue;
          }
          if (has_avx2_fma()) {
            add_rms_norm_row_avx2(as_bf16(xp + i * xs), as_bf16(rp + i * rs), as_bf16(wp), as_bf16(srow),
                                  as_bf16(op + i * h), h, static_cast<float>(eps));
            continue;
          }
        }
        for (int64_t j = 0; j < h; ++j) {
          srow[j] = static_cast<scalar_t>(static_cast<float>(xp[i * xs + j]) + static_cast<float>(rp[i * rs + j]));
        }
        rms_norm_row(srow, wp, op + i * h, h, static_cast<float>(eps));
      }
    });
  });
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps) {
  const at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const at::Tensor sum = at::empty({x.size(0), x.size(1)}, x.options());
  add_rms_norm_into(x, residual, weight, eps, out, sum);
  return {out, sum};
}

// In place on x[T, heads * head_size] (a column slice of a wider row-major tensor is fine):
// x' = round(round(x * cos) + round(swap(x) * sin)) on the first rotary_dim dims of every head, where
// cos_sin[T, 2 * rotary_dim] holds the expanded cosines then the expanded, signed sines (RotaryEmbedding's cache
// layout) and swap pairs (i, i + rotary_dim / 2) for NeoX style, (2i, 2i + 1) otherwise.
void rotary_(at::Tensor& x, const at::Tensor& cos_sin, int64_t head_size, int64_t rotary_dim, bool neox) {
  check_rows(x, "x");
  check_rows(cos_sin, "cos_sin");
  TORCH_CHECK(cos_sin.size(0) == x.size(0) && cos_sin.size(1) == 2 * rotary_dim, "cos_sin must be [T, 2*rotary_dim]");
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type(), "cos_sin must have x's dtype");
  TORCH_CHECK(x.size(1) % head_size == 0 && rotary_dim <= head_size && rotary_dim % 2 == 0, "bad head/rotary dims");
  const int64_t rows = x.size(0), heads = x.size(1) / head_size, xs = x.stride(0), cs = cos_sin.stride(0);
  const int64_t half = rotary_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos_sin.data_ptr<scalar_t>();
    ascent_par::parallel_for(0, rows, row_grain(heads * rotary_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* cosr = cp + t * cs;
        const scalar_t* sinr = cosr + rotary_dim;
        for (int64_t hd = 0; hd < heads; ++hd) {
          scalar_t* v = xp + t * xs + hd * head_size;
          if constexpr (std::is_same_v<scalar_t, bf16>) {
            if (neox && has_avx512()) {
              rotary_neox_head_avx512(as_bf16(v), as_bf16(cosr), as_bf16(sinr), half);
              continue;
            }
            if (neox && has_avx2_fma()) {
              rotary_neox_head_avx2(as_bf16(v), as_bf16(cosr), as_bf16(sinr), half);
              continue;
            }
          }
          for (int64_t p = 0; p < half; ++p) {
            const int64_t a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
            const float va = static_cast<float>(v[a]), vb = static_cast<float>(v[b]);
            const float ca = static_cast<scalar_t>(va * static_cast<float>(cosr[a]));
            const float cb = static_cast<scalar_t>(vb * static_cast<float>(cosr[b]));
            const float sa = static_cast<scalar_t>(vb * static_cast<float>(sinr[a]));
            const float sb = static_cast<scalar_t>(va * static_cast<float>(sinr[b]));
            v[a] = static_cast<scalar_t>(ca + sa);
            v[b] = static_cast<scalar_t>(cb + sb);
          }
        }
      }
    });
  });
}

// out[T, d] = round(round(silu(x[:, :d])) * x[:, d:]) with silu in fp32 (exp_approx), as F.silu(a) * b; into
// out_into when defined (see out_or_new), else a new tensor.
at::Tensor silu_and_mul_into(const at::Tensor& x, const at::Tensor& out_into) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  const int64_t rows = x.size(0), d = x.size(1) / 2, xs = x.stride(0);
  const at::Tensor out = out_or_new(out_into, rows, d, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    ascent_par::parallel_for(0, rows, row_grain(8 * d), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = xp + i * xs;
        if constexpr (std::is_same_v<scalar_t, bf16>) {
          if (has_avx512()) {
            silu_and_mul_row_avx512(as_bf16(g), as_bf16(op + i * d), d);
            continue;
          }
          if (has_avx2_fma()) {
            silu_and_mul_row_avx2(as_bf16(g), as_bf16(op + i * d), d);
            continue;
          }
        }
        for (int64_t j = 0; j < d; ++j) {
          const float a = static_cast<float>(g[j]);
          const float s = static_cast<scalar_t>(a / (1.f + exp_approx(-a)));
          op[i * d + j] = static_cast<scalar_t>(s * static_cast<float>(g[d + j]));
        }
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) { return silu_and_mul_into(x, at::Tensor()); }

#include "paged_attention_cpu.h"

// Causal prefill attention (avx512_prefill_attention.h, amx_prefill_attention.h, avx2_prefill_attention.h): q [tq, heads * d], k / v [tk, kv_heads * d] (row-strided
// views are fine), all bf16; query i sits at position q_offset + i with tk == q_offset + tq; window > 0 keeps the last
// `window` keys of each query. Returns [tq, heads * d] bf16: out_rows when given (a contiguous bf16 tensor of that
// shape, e.g. the caller's output rows, written in place: no copy afterwards), else a new one. Only where
// prefill_attention_available(d).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_heads,
                             double scale, int64_t q_offset, int64_t window, const c10::optional<at::Tensor>& out_rows) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: q, k and v must be bfloat16");
  TORCH_CHECK(num_heads > 0 && q.size(1) % num_heads == 0, "prefill_attention: q width ", q.size(1),
              " is not a multiple of num_heads ", num_heads);
  const int64_t d = q.size(1) / num_heads, tq = q.size(0), tk = k.size(0);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) % d == 0 && num_heads % (k.size(1) / d) == 0,
              "prefill_attention: k/v must be [tk, kv_heads * ", d, "] with kv_heads dividing ", num_heads);
  TORCH_CHECK(q_offset >= 0 && tk == q_offset + tq, "prefill_attention: tk (", tk, ") must equal q_offset (",
              q_offset, ") + tq (", tq, ")");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0");
  const bool amx = amx_prefill_applies(d), avx512 = !amx && prefill_attention_applies(d);
  TORCH_CHECK(amx || avx512 || avx2_prefill_applies(d), "prefill_attention: needs AMX (head dim 32, 64 or ",
              "128), or AVX512-BF16 or AVX2 and a head dim that is a multiple of 32 up to ", kMaxHeadDim, ", got ", d);
  at::Tensor out = out_rows.has_value() ? *out_rows : at::empty({tq, q.size(1)}, q.options());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == tq &&
                  out.size(1) == q.size(1), "prefill_attention: out must be a contiguous bf16 [", tq, ", ", q.size(1),
              "] tensor");
  if (tq == 0) return out;
  const PrefillAttnArgs args{q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), q.stride(0), k.stride(0),
                             v.stride(0), tq, tk, num_heads, k.size(1) / d, d, q_offset, window,
                             static_cast<float>(scale), out.data_ptr<bf16>()};
  if (amx) prefill_attention_amx(args);
  else if (avx512) prefill_attention_avx512(args);
  else prefill_attention_avx2(args);
  return out;
}

bool prefill_attention_available(int64_t d) {
  return amx_prefill_applies(d) || prefill_attention_applies(d) || avx2_prefill_applies(d);
}

int64_t set_prefill_attention(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 3, "prefill attention mode must be -1 (auto), 0 (off), 1 (the AVX512-BF16 kernel), ",
              "2 (the AMX kernel) or 3 (the AVX2 kernel), got ", mode);
  const int64_t previous = g_prefill_attention;
  g_prefill_attention = static_cast<int>(mode);
  return previous;
}

int64_t set_isa_limit(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= 2, "isa level must be 0 (scalar), 1 (AVX2+FMA) or 2 (AVX512), got ", level);
  const int64_t previous = g_fused_isa;
  g_fused_isa = static_cast<int>(level);
  return previous;
}

int64_t set_amx_attention(int64_t on) {
  const int64_t previous = g_amx_attention;
  g_amx_attention = on != 0;
  return previous;
}

bool amx_attention_available(int64_t d, int64_t group) { return amx_attention_applies(d, group); }

#ifndef ASCENT_EMBEDDED_KERNELS  // decode_stack_cpu.cpp includes this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "rms_norm(x [T,H], weight [H], eps) -> [T,H]");
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm(x, residual, weight, eps) -> [norm(x+residual), x+residual]");
  m.def("rotary_", &rotary_, "rotary_(x [T, heads*head_size], cos_sin [T, 2*rd], head_size, rotary_dim, neox)");
  m.def("paged_kv_write", &paged_kv_write, "paged_kv_write(kv_cache [2,S,W], k [T,W], v [T,W], slots [T])");
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged_decode_attention(q [n, heads*d], kv_cache [2,S,kvh,d], slots [n,L], seq_lens [n], heads, scale, window)");
  m.def("context_slots", &context_slots,
        "context_slots(block_rows int32 [R,B], block_size, length, lens int64 [R] or empty) -> int64 [R, length]");
  m.def("prefill_attention", &prefill_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("num_heads"),
        py::arg("scale"), py::arg("q_offset"), py::arg("window"), py::arg("out") = py::none(),
        "prefill_attention(q [tq, H*d], k [tk, KV*d], v, num_heads, scale, q_offset, window, out=None) -> [tq, H*d] "
        "(bf16; written into out, a contiguous [tq, H*d] bf16 tensor such as a row slice, when given)");
  m.def("prefill_attention_available", &prefill_attention_available,
        "prefill_attention_available(head_dim) -> whether prefill_attention runs here");
  m.def("set_split_attention", [](int64_t on) { return std::exchange(g_split_attention, on != 0); },
        "set_split_attention(1|0) -> previous (0: long decode contexts in one pass, as short ones; tests)");
  m.def("set_prefill_attention", &set_prefill_attention,
        "set_prefill_attention(-1 auto | 0 off | 1 AVX512-BF16 | 2 AMX | 3 AVX2 kernel) -> previous (tests)");
  m.def("silu_and_mul", &silu_and_mul, "silu_and_mul(x [T, 2d]) -> [T, d]");
  m.def("set_isa_limit", &set_isa_limit, "set_isa_limit(level) -> previous (0 scalar, 1 AVX2+FMA, 2 AVX512)");
  m.def("set_amx_attention", &set_amx_attention, "set_amx_attention(1|0) -> previous (tests: 0 = the AVX512 kernels)");
  m.def("amx_attention_available", &amx_attention_available, "amx_attention_available(d, group) -> bool");
}
#endif
