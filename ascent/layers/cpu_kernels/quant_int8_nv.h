// W8A8 kernels on the row-interleaved layout of quant_wo_nv.h, with signed weight bytes (wo_nv_pack with offset 0):
// one VPDPBUSD per 16 output rows and 4 columns, x's quantized bytes (u = q + 128, quantize_rows_*) broadcast.
// acc = sum u w - 128 row_sum(w) = sum q w exactly (|acc| < 2^31 for K <= 65536), then the same per-element epilogue
// as the row-layout kernels (int8_linear), so the results are bit-identical to kernels.int8_linear_dynamic / static.
// Included by quant_gemv_cpu.cpp in namespace ascent_quant after quantize_rows_dynamic / _static.
#pragma once

constexpr int64_t kNvInt8MaxMB = 4;  // x rows per pass over a super-block (16 int32 accumulators)

// acc[m][16 v0 .. 16 (v0 + NV)) (acc [MB][64]) for x rows m0 .. m0 + MB - 1 and vectors v0 .. v0 + NV - 1 of
// super-block sb (NV = 4: the whole super-block, 2: a half; before the row-sum correction).
template <int MB, int NV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void int8_nv_vectors(
    const uint8_t* w, int64_t steps, const uint8_t* xq, int64_t ldx, int64_t m0, int64_t sb, int64_t v0,
    int32_t* acc) {
  const uint8_t* p = w + sb * steps * kNvStepBytes + 64 * v0;
  __m512i a[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NV; ++b) a[m][b] = _mm512_setzero_si512();
  for (int64_t s = 0; s < steps; ++s, p += kNvStepBytes) {
    for (int b = 0; b < NV; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(p + kNvPrefetchBytes + 64 * b), _MM_HINT_T2);
    __m512i v[NV];
    for (int b = 0; b < NV; ++b) v[b] = _mm512_loadu_si512(p + 64 * b);
    for (int m = 0; m < MB; ++m) {
      int32_t x4;
      std::memcpy(&x4, xq + (m0 + m) * ldx + 4 * s, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      for (int b = 0; b < NV; ++b) a[m][b] = _mm512_dpbusd_epi32(a[m][b], xb, v[b]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NV; ++b) _mm512_storeu_si512(acc + m * kNvRows + 16 * (v0 + b), a[m][b]);
}

using Int8NvFn = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int32_t*);

// The epilogues of a whole super-block (64 rows from row0) for one x row, vectorised with the scalar epilogues' exact
// operations and order (so bit-identical to them): a = acc - 128 row_sum, then
//   dynamic: y = (float(a) * sx) * w_scale[j] (+ bias[j]);   static: y = float(a + quant_bias[j]) * deq[j] (+ bias[j]).
// (A per-element scalar epilogue and store had cost ~10 % of a batch-1 W8A8 call.)
__attribute__((target("avx512f"))) inline __m512i nv_int8_sums(const int32_t* acc, const int32_t* row_sum) {
  return _mm512_sub_epi32(_mm512_loadu_si512(acc), _mm512_slli_epi32(_mm512_loadu_si512(row_sum), 7));
}

__attribute__((target("avx512f"))) void nv_epilogue_dynamic(const int32_t* acc, const int32_t* row_sum, float sx,
                                                            const float* w_scale, const float* bias, float* y) {
  for (int b = 0; b < 4; ++b) {
    const __m512 a = _mm512_cvtepi32_ps(nv_int8_sums(acc + 16 * b, row_sum + 16 * b));
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(sx)), _mm512_loadu_ps(w_scale + 16 * b));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * b));
    _mm512_storeu_ps(y + 16 * b, v);
  }
}

__attribute__((target("avx512f"))) void nv_epilogue_static(const int32_t* acc, const int32_t* row_sum,
                                                           const int32_t* quant_bias, const float* deq,
                                                           const float* bias, float* y) {
  for (int b = 0; b < 4; ++b) {
    __m512i a = nv_int8_sums(acc + 16 * b, row_sum + 16 * b);
    if (quant_bias != nullptr) a = _mm512_add_epi32(a, _mm512_loadu_si512(quant_bias + 16 * b));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(deq + 16 * b));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * b));
    _mm512_storeu_ps(y + 16 * b, v);
  }
}

// The packed weight of an N-row int8 NV projection for K columns (K from x, <= kMaxK): checks its layout and
// returns its bytes.
const uint8_t* int8_nv_weight(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(k > 0 && k <= kMaxK, "K must be in [1, ", kMaxK, "], got ", k);
  TORCH_CHECK(use_vnni(), "int8 NV kernels need AVX512-VNNI");
  const int64_t blocks = nv_padded(n, kNvRows) / kNvRows, steps = nv_padded(k, 4) / 4;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == blocks * steps * kNvStepBytes,
              "packed must be a contiguous uint8 [", blocks, ", ", steps, ", 4, 64]");
  return packed.data_ptr<uint8_t>();
}

// y [M, N] = epi(m, n, x_q . W_q) on the packed signed layout (w as int8_nv_weight checked it); xq [M, ldx] as
// quantize_rows_*(vnni = true) gives.
// block_epi(m, row0, acc, y) computes epi for the 64 rows of a whole super-block at once (fp32 y), bf16 and fp32
// outputs are stored 64 at a time; a partial last super-block, a half super-block (parallel_halves) and fp16 outputs
// go element by element.
template <typename Epilogue, typename BlockEpilogue>
at::Tensor int8_nv_linear(const at::Tensor& x, const std::vector<uint8_t>& xq, int64_t ldx, const uint8_t* w,
                          int64_t n, int64_t k, const int32_t* row_sum, Epilogue epi, BlockEpilogue block_epi) {
  const int64_t m_rows = x.size(0), npad = nv_padded(n, kNvRows), steps = nv_padded(k, 4) / 4;
  static const Int8NvFn fns[2][kNvInt8MaxMB] = {
      {int8_nv_vectors<1, 2>, int8_nv_vectors<2, 2>, int8_nv_vectors<3, 2>, int8_nv_vectors<4, 2>},
      {int8_nv_vectors<1, 4>, int8_nv_vectors<2, 4>, int8_nv_vectors<3, 4>, int8_nv_vectors<4, 4>}};
  auto out = at::empty({m_rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const Store store{out.data_ptr(), out.scalar_type(), n};
  const bool block_store = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat;
  parallel_halves(npad / kNvRows, [&](int64_t sb, int64_t v0, int64_t vectors) {
    int32_t acc[kNvInt8MaxMB * kNvRows];
    float y[kNvRows];
    const int64_t row0 = sb * kNvRows, first = row0 + 16 * v0, last = std::min(first + 16 * vectors, n);
    if (first >= n) return;  // a half of padding rows
    for (int64_t m0 = 0; m0 < m_rows; m0 += kNvInt8MaxMB) {
      const int64_t mb = std::min(kNvInt8MaxMB, m_rows - m0);
      fns[vectors == 4 ? 1 : 0][mb - 1](w, steps, xq.data(), ldx, m0, sb, v0, acc);
      for (int64_t m = 0; m < mb; ++m) {
        if (block_store && vectors == 4 && row0 + kNvRows <= n) {
          block_epi(m0 + m, row0, acc + m * kNvRows, y);
          if (out.scalar_type() == at::kBFloat16)
            store_bf16_rows(y, static_cast<uint16_t*>(store.base) + (m0 + m) * n + row0);
          else
            std::memcpy(static_cast<float*>(store.base) + (m0 + m) * n + row0, y, sizeof(y));
          continue;
        }
        for (int64_t r = first; r < last; ++r)
          store(m0 + m, r, epi(m0 + m, r, acc[m * kNvRows + (r - row0)] - 128 * row_sum[r]));
      }
    }
  });
  return out;
}

// A dynamic W8A8 projection on the layout with its weight-side operands checked once and held as raw pointers into
// tensors the caller keeps alive (the decode stack runs it every step, when those tensors' metadata is cold). Only
// pointers are kept, so in-place updates of the tensors' values are seen.
struct W8A8DynamicNv {
  const uint8_t* packed = nullptr;
  const int32_t* row_sum = nullptr;
  const float* w_scale = nullptr;
  c10::optional<at::Tensor> bias;
  int64_t n = 0, k = 0;
};

W8A8DynamicNv plan_w8a8_dynamic_nv(const at::Tensor& packed, const at::Tensor& row_sum, const at::Tensor& w_scale,
                                   const c10::optional<at::Tensor>& bias, int64_t k) {
  const int64_t n = row_sum.numel();
  check_vec(row_sum, "row_sum", n, at::kInt);
  check_vec(w_scale, "w_scale", n, at::kFloat);
  float_bias(bias, n);  // checks it
  return {int8_nv_weight(packed, n, k), row_sum.data_ptr<int32_t>(), w_scale.data_ptr<float>(), bias, n, k};
}

// y = x W^T, bit-identical to w8a8_dynamic_linear (packed = wo_nv_pack(W, 8, offset 0)); x [..., plan.k].
at::Tensor run_w8a8_dynamic_nv(const at::Tensor& x_in, const W8A8DynamicNv& plan) {
  const int64_t k = plan.k, ldx = (k + 63) / 64 * 64;
  const at::Tensor x = rows_of(x_in, k);
  std::vector<uint8_t> xq;
  std::vector<float> sx;
  quantize_rows_dynamic(x, k, ldx, /*vnni=*/true, xq, sx);
  const std::vector<float> b = float_bias(plan.bias, plan.n);
  const float* ws = plan.w_scale;
  const int32_t* rs = plan.row_sum;
  const auto epi = [&](int64_t m, int64_t j, int32_t acc) {
    const float y = static_cast<float>(acc) * sx[m] * ws[j];
    return b.empty() ? y : y + b[j];
  };
  const auto block_epi = [&](int64_t m, int64_t row0, const int32_t* acc, float* y) {
    nv_epilogue_dynamic(acc, rs + row0, sx[m], ws + row0, b.empty() ? nullptr : b.data() + row0, y);
  };
  return like_x(int8_nv_linear(x, xq, ldx, plan.packed, plan.n, k, rs, epi, block_epi), x_in);
}

// Dynamic W8A8 on the layout: bit-identical to w8a8_dynamic_linear (packed = wo_nv_pack(W, 8, offset 0)).
at::Tensor w8a8_dynamic_linear_nv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& row_sum,
                                  const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  return run_w8a8_dynamic_nv(x_in, plan_w8a8_dynamic_nv(packed, row_sum, w_scale, bias, x_in.size(-1)));
}

// A static W8A8 projection on the layout, checked once as W8A8DynamicNv is.
struct W8A8StaticNv {
  const uint8_t* packed = nullptr;
  const int32_t* row_sum = nullptr;
  const float* deq = nullptr;
  const int32_t* quant_bias = nullptr;  // nullptr when absent
  c10::optional<at::Tensor> bias;
  const float* input_scale_offset = nullptr;  // fp32 [input_scale, input_offset]
  int64_t n = 0, k = 0;
};

W8A8StaticNv plan_w8a8_static_nv(const at::Tensor& packed, const at::Tensor& row_sum,
                                 const float* input_scale_offset, const at::Tensor& deq,
                                 const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& bias,
                                 int64_t k) {
  const int64_t n = row_sum.numel();
  const uint8_t* w = int8_nv_weight(packed, n, k);
  check_vec(row_sum, "row_sum", n, at::kInt);
  check_vec(deq, "deq", n, at::kFloat);
  float_bias(bias, n);  // checks it
  return {w, row_sum.data_ptr<int32_t>(), deq.data_ptr<float>(), quant_bias_of(quant_bias, n), bias, input_scale_offset,
          n, k};
}

// y = x W^T, bit-identical to w8a8_static_linear (same quantization and epilogue); x [..., plan.k].
at::Tensor run_w8a8_static_nv(const at::Tensor& x_in, const W8A8StaticNv& plan) {
  const int64_t k = plan.k, ldx = (k + 63) / 64 * 64;
  const at::Tensor x = rows_of(x_in, k);
  std::vector<uint8_t> xq;
  quantize_rows_static(x, k, ldx, /*vnni=*/true, plan.input_scale_offset[0], plan.input_scale_offset[1], xq);
  const std::vector<float> b = float_bias(plan.bias, plan.n);
  const float* dp = plan.deq;
  const int32_t *rs = plan.row_sum, *qb = plan.quant_bias;
  const auto epi = [&](int64_t, int64_t j, int32_t acc) {
    const int32_t a = qb ? static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(qb[j])) : acc;
    const float y = static_cast<float>(a) * dp[j];
    return b.empty() ? y : y + b[j];
  };
  const auto block_epi = [&](int64_t, int64_t row0, const int32_t* acc, float* y) {
    nv_epilogue_static(acc, rs + row0, qb ? qb + row0 : nullptr, dp + row0, b.empty() ? nullptr : b.data() + row0, y);
  };
  return like_x(int8_nv_linear(x, xq, ldx, plan.packed, plan.n, k, rs, epi, block_epi), x_in);
}

// Static W8A8 on the layout: bit-identical to w8a8_static_linear (same quantization and epilogue).
at::Tensor w8a8_static_linear_nv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& row_sum,
                                 double input_scale, double input_offset, const at::Tensor& deq,
                                 const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& bias) {
  const float scale_offset[2] = {static_cast<float>(input_scale), static_cast<float>(input_offset)};
  return run_w8a8_static_nv(x_in, plan_w8a8_static_nv(packed, row_sum, scale_offset, deq, quant_bias, bias,
                                                       x_in.size(-1)));
}
