// The AMX-INT8 entry points of quant_gemv_cpu.cpp (W8A8 dynamic / static, W8A16 per channel) and their operand
// preparation; included there inside namespace ascent_quant (public), after the shared x-quantization helpers. The
// tile kernels are in quant_amx_int8.h.
#pragma once

bool amx_int8_available() { return amx_int8_usable(); }

// int8 W [N, K] -> the AMX-INT8 packed layout (quant_amx_int8.h).
at::Tensor w8a8_amx_pack(const at::Tensor& w) {
  check_weight(w, at::kChar);
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 64 == 0, "w8a8_amx_pack: needs N % 16 == 0 and K % 64 == 0, got ", w.sizes());
  return w.view({n / 16, 16, k / 64, 16, 4}).permute({0, 2, 3, 1, 4}).contiguous().view({n / 16, k / 64, 16, 64});
}

// N of an AMX-INT8 packed weight (and the checks every AMX call makes).
int64_t check_amx_pack(const at::Tensor& wp) {
  TORCH_CHECK(amx_int8_usable(), "w8a8 AMX kernels: AMX-INT8 is not available");
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 64 &&
                  wp.is_contiguous(), "w8a8 AMX kernels: wp must come from w8a8_amx_pack");
  return wp.size(0) * 16;
}

// The weight stream amx_i8_run reads for one row of x, as its loop splits it (warm_ahead.h); empty for the tiles.
ascent_par::StreamHint amx_i8_stream(const at::Tensor& wp, int64_t m) {
  if (m != 1 || !use_vnni()) return {};
  return {static_cast<const char*>(wp.data_ptr()), wp.size(0), kI8GemvGrain, wp.size(1) * 1024, kI8GemvStreams};
}

// The tiles over all column-block pairs, split over torch's threads; returns out.
at::Tensor amx_i8_run(const AmxI8Operands& o, int64_t m, const at::Tensor& out) {
  const int64_t pairs = (o.n / 16 + 1) / 2;
  if (m == 1 && use_vnni()) {  // one row: VNNI dot products on the tiles' layout (i8_gemv_unit)
    ascent_par::parallel_blocks<kI8GemvStreams>(
        0, o.n / 16, kI8GemvGrain, [] { return 0; },
        [&](int, const int64_t (&nbs)[kI8GemvStreams], int count) { i8_gemv_unit(o, nbs, count); });
  } else if (m > 32 && m <= 64) {  // one pass over the weight (amx_i8_block64)
    ascent_par::parallel_for(0, o.n / 16, 8, [&](int64_t begin, int64_t end) { amx_i8_blocks64(o, m, begin, end); });
  } else if (m > 0) {
    ascent_par::parallel_for(0, pairs, 4, [&](int64_t begin, int64_t end) { amx_i8_pairs(o, m, begin, end); });
  }
  return out;
}

// w8a8_dynamic_linear (bit-identical) on AMX-INT8 tiles: wp = w8a8_amx_pack(W).
at::Tensor w8a8_dynamic_linear_amx(const at::Tensor& x_in, const at::Tensor& wp, const at::Tensor& w_scale,
                                   const c10::optional<at::Tensor>& bias) {
  const int64_t n = check_amx_pack(wp), k = wp.size(1) * 64;
  const at::Tensor x = rows_of(x_in, k);
  check_vec(w_scale, "w_scale", n, at::kFloat);
  std::vector<uint8_t> xq;
  std::vector<float> sx;
  quantize_rows_dynamic(x, k, k, /*vnni=*/false, xq, sx);
  const std::vector<float> b = float_bias(bias, n);
  auto out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const AmxI8Operands o{reinterpret_cast<const int8_t*>(xq.data()), k, wp.data_ptr<int8_t>(), k / 64, n, sx.data(),
                        w_scale.data_ptr<float>(), nullptr, b.empty() ? nullptr : b.data(), out.scalar_type(),
                        out.data_ptr()};
  return like_x(amx_i8_run(o, x.size(0), out), x_in);
}

// max |p[j]| as the largest magnitude bit pattern: a NaN anywhere gives a NaN (max_ps would drop it), inf gives inf.
__attribute__((target("avx512f"))) float amax_bits_avx512(const float* p, int64_t k) {
  __m512i mx = _mm512_setzero_si512();
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t j = 0; j < k; j += 16)  // k % 16 == 0
    mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(p + j), magnitude));
  const uint32_t bits = _mm512_reduce_max_epu32(mx);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void fixed_point_row_avx512(const float* p, int64_t k, float inv,
                                                                                  int8_t* hi, int8_t* lo) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < k; j += 16) split16(_mm512_loadu_ps(p + j), vinv, hi + j, lo + j);
}

// x [M, K] (bf16 / fp16) as 16-bit fixed point rows (quant_wo_vnni.h's step and rounding): hi / lo [M, K] s8 and
// the steps [M]; false when x has a non-finite value.
bool fixed_point_rows(const at::Tensor& x, int64_t k, std::vector<int8_t>& hi, std::vector<int8_t>& lo,
                      std::vector<float>& steps) {
  const int64_t m_rows = x.size(0);
  hi.assign(static_cast<size_t>(m_rows * k), 0);
  lo.assign(static_cast<size_t>(m_rows * k), 0);
  steps.assign(static_cast<size_t>(m_rows), 1.f);
  std::atomic<bool> finite{true};
  for_float_rows(x, k, [&](int64_t m, const float* p) {  // k % 64 == 0 here (AMX packing)
    const float amax = amax_bits_avx512(p, k);
    if (!std::isfinite(amax)) {
      finite.store(false, std::memory_order_relaxed);
      return;
    }
    if (amax == 0.f) return;
    int e = 0;
    std::frexp(amax / static_cast<float>(kX16Max), &e);
    e = std::max(e, -126);
    steps[m] = std::ldexp(1.f, e);
    fixed_point_row_avx512(p, k, std::ldexp(1.f, -e), hi.data() + m * k, lo.data() + m * k);
  });
  return finite.load();
}

// W8A16 (per-channel scale [N], no zero point) with 16-bit x on AMX-INT8 tiles: y = x^ . W * step * scale (+ bias),
// x^ the fixed-point x (exact integer sums over K). Empty tensor when x has a NaN / inf (the caller falls back).
at::Tensor w8a16_linear_amx(const at::Tensor& x_in, const at::Tensor& wp, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  const int64_t n = check_amx_pack(wp), k = wp.size(1) * 64;
  const at::Tensor x = rows_of(x_in, k);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "w8a16_linear_amx: x must be 16-bit");
  check_vec(scale, "scale", n, at::kFloat);
  std::vector<int8_t> hi, lo;
  std::vector<float> steps;
  if (!fixed_point_rows(x, k, hi, lo, steps)) return at::Tensor();
  const std::vector<float> b = float_bias(bias, n);
  auto out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const AmxFxOperands f{hi.data(), lo.data(), steps.data(),
                        {nullptr, k, wp.data_ptr<int8_t>(), k / 64, n, nullptr, scale.data_ptr<float>(), nullptr,
                         b.empty() ? nullptr : b.data(), out.scalar_type(), out.data_ptr()}};
  const int64_t m = x.size(0), pairs = (n / 16 + 1) / 2;
  if (m > 16 && m <= 32) {  // one pass over the weight (amx_fx_block32)
    ascent_par::parallel_for(0, n / 16, 8, [&](int64_t begin, int64_t end) { amx_fx_blocks32(f, m, begin, end); });
  } else if (m > 0) {
    ascent_par::parallel_for(0, pairs, 4, [&](int64_t begin, int64_t end) { amx_fx_pairs(f, m, begin, end); });
  }
  return like_x(out, x_in);
}

// w8a8_static_linear (bit-identical) on AMX-INT8 tiles: wp = w8a8_amx_pack(W).
at::Tensor w8a8_static_linear_amx(const at::Tensor& x_in, const at::Tensor& wp, double input_scale,
                                  double input_offset, const at::Tensor& deq,
                                  const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& bias) {
  const int64_t n = check_amx_pack(wp), k = wp.size(1) * 64;
  const at::Tensor x = rows_of(x_in, k);
  check_vec(deq, "deq", n, at::kFloat);
  const int32_t* qb = quant_bias_of(quant_bias, n);
  std::vector<uint8_t> xq;
  quantize_rows_static(x, k, k, /*vnni=*/false, static_cast<float>(input_scale), static_cast<float>(input_offset),
                       xq);
  const std::vector<float> b = float_bias(bias, n);
  auto out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const AmxI8Operands o{reinterpret_cast<const int8_t*>(xq.data()), k, wp.data_ptr<int8_t>(), k / 64, n, nullptr,
                        deq.data_ptr<float>(), qb, b.empty() ? nullptr : b.data(), out.scalar_type(), out.data_ptr()};
  return like_x(amx_i8_run(o, x.size(0), out), x_in);
}
