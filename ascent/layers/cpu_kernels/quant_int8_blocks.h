// Int8 x int8 (W8A8) block kernels and activation quantization of quant_gemv_cpu.cpp; included there inside
// namespace ascent_quant's anonymous namespace, after quant_wo_blocks.h.
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// W8A8: int8 activations x int8 weights, exact int32 accumulators acc[mb][R].
// ---------------------------------------------------------------------------------------------------------------

struct I8Args {
  const uint8_t* xq;  // [M, ldx]: u8 = q + 128 (VNNI) or the int8 bits of q (generic); zero padded
  int64_t ldx;
  const int8_t* w;    // [N, K]
  int64_t k;
  const int16_t* x16 = nullptr;  // [M, ldx]: q widened to int16 (the AVX2 path; set by int8_linear)
  bool x_has_min = false;         // whether some q is -128 (the AVX2 stream kernel then stands aside)
};

template <int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void i8_block_vnni(const I8Args& a, int64_t n,
                                                                                   const uint8_t* x, int32_t* acc) {
  __m512i s[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) s[r][m] = _mm512_setzero_si512();
  const int8_t* w = a.w + n * a.k;
  for (int64_t k = 0; k < a.k; k += 64) {
    const __mmask64 mask = a.k - k >= 64 ? ~0ULL : ((1ULL << (a.k - k)) - 1);
    for (int r = 0; r < R; ++r) prefetch_weights(reinterpret_cast<const uint8_t*>(w + r * a.k + k), a.k);
    __m512i xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_si512(x + m * a.ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + r * a.k + k);
      for (int m = 0; m < MB; ++m) s[r][m] = _mm512_dpbusd_epi32(s[r][m], xv[m], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[m * R + r] = _mm512_reduce_add_epi32(s[r][m]);
}

void i8_block_generic(const I8Args& a, int64_t n, int64_t rows, int64_t mb, const uint8_t* x, int32_t* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < mb; ++m) {
      const int8_t* xr = reinterpret_cast<const int8_t*>(x + m * a.ldx);
      const int8_t* wr = a.w + (n + r) * a.k;
      int32_t dot = 0;
      for (int64_t k = 0; k < a.k; ++k) dot += static_cast<int32_t>(xr[k]) * static_cast<int32_t>(wr[k]);
      acc[m * rows + r] = dot;
    }
}

#include "quant_int8_avx2.h"

using I8BlockFn = void (*)(const I8Args&, int64_t, const uint8_t*, int32_t*);

template <int R>
I8BlockFn i8_block_fn(int64_t mb) {
  switch (mb) {
    case 1: return i8_block_vnni<R, 1>;
    case 2: return i8_block_vnni<R, 2>;
    case 3: return i8_block_vnni<R, 3>;
    default: return i8_block_vnni<R, 4>;
  }
}

// Exact sum_k q_x[m, k] * W[n + r, k] for r < rows, tokens [m0, m0 + mb); vnni: the u8 sums less 128 * row_sum.
void i8_block(const I8Args& a, bool vnni, const int32_t* row_sum, int64_t n, int64_t rows, int64_t m0, int64_t mb,
              int32_t* acc) {
  const uint8_t* x = a.xq + m0 * a.ldx;
  if (!vnni && a.x16 != nullptr) return i8_block_avx2(a, n, rows, mb, a.x16 + m0 * a.ldx, acc);
  if (!vnni) return i8_block_generic(a, n, rows, mb, x, acc);
  if (rows == kRowBlock) {
    i8_block_fn<kRowBlock>(mb)(a, n, x, acc);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      int32_t one[4];
      i8_block_fn<1>(mb)(a, n + r, x, one);
      for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
    }
  }
  for (int64_t m = 0; m < mb; ++m)
    for (int64_t r = 0; r < rows; ++r) acc[m * rows + r] -= 128 * row_sum[n + r];
}

// Runs the int8 product over all rows and calls epi(m, n, acc) -> fp32 y for each output.
template <typename Epilogue>
at::Tensor int8_linear(const at::Tensor& x, const std::vector<uint8_t>& xq, int64_t ldx, bool vnni,
                       const at::Tensor& w, const int32_t* row_sum, Epilogue epi) {
  const int64_t m_rows = x.size(0), n_out = w.size(0);
  I8Args a{xq.data(), ldx, w.data_ptr<int8_t>(), w.size(1)};
  std::vector<int16_t> x16;
  if (!vnni && use_avx2()) {
    x16.resize(xq.size());
    widen_x16(xq.data(), static_cast<int64_t>(xq.size()), x16.data());
    a.x16 = x16.data();
    a.x_has_min = std::find(xq.begin(), xq.end(), uint8_t{0x80}) != xq.end();
  }
  auto out = at::empty({m_rows, n_out}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const Store store{out.data_ptr(), out.scalar_type(), n_out};
  const int64_t span = a.x16 != nullptr ? kSpanRows : kRowBlock;  // rows per kernel call
  const auto emit = [&](int64_t m, int64_t n, int64_t rows, const int32_t* sums) {
    float y[std::max(kRowBlock, kSpanRows)];
    for (int64_t r = 0; r < rows; ++r) y[r] = epi(m, n + r, sums[r]);
    store.row(m, n, rows, y);
  };
  parallel_rows(n_out, [&](int64_t begin, int64_t end) {
    int32_t acc[4 * std::max(kRowBlock, kSpanRows)];
    if (a.x16 != nullptr && m_rows <= 4) begin = i8_linear_streams_avx2(a, begin, end, m_rows, emit);
    for (int64_t n = begin; n < end; n += span) {
      const int64_t rows = std::min(span, end - n);
      for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
        const int64_t mb = std::min<int64_t>(4, m_rows - m0);
        i8_block(a, vnni, row_sum, n, rows, m0, mb, acc);
        for (int64_t m = 0; m < mb; ++m) emit(m0 + m, n, rows, acc + m * rows);
      }
    }
  });
  return out;
}

// q (int8 value) -> stored byte: q + 128 for VNNI (u8 operand), the two's-complement bits otherwise.
inline uint8_t stored(int32_t q, bool vnni) { return static_cast<uint8_t>(vnni ? q + 128 : q); }

// max |p[j]|, NaN when a p[j] is NaN (max alone would skip it).
inline float amax_scalar(const float* p, int64_t k) {
  float r = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    if (std::isnan(p[j])) return p[j];
    r = std::max(r, std::fabs(p[j]));
  }
  return r;
}

__attribute__((target("avx512f"))) float amax_avx512(const float* p, int64_t k) {
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
  }
  float r = _mm512_reduce_max_ps(mx);
  for (; j < k; ++j) r = std::isnan(p[j]) ? p[j] : std::max(r, std::fabs(p[j]));
  return nan ? std::numeric_limits<float>::quiet_NaN() : r;
}

// out[j] = stored(clamp(nearbyint(p[j] / div), -128, 127)): IEEE division and round-half-even as the scalar path.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quant_row_avx512(const float* p, int64_t k, float div,
                                                                           bool vnni, uint8_t* out) {
  const __m512 d = _mm512_set1_ps(div), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512i shift = _mm512_set1_epi32(vnni ? 128 : 0);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(p + j), d),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, shift)));
  }
  for (; j < k; ++j)
    out[j] = stored(static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(p[j] / div)))), vnni);
}

// out[j] = stored(clamp(nearbyint(p[j] / s + z), -128, 127)) (static quantization, the scalar path's operations).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quant_row_static_avx512(const float* p, int64_t k, float s,
                                                                                  float z, bool vnni, uint8_t* out) {
  const __m512 d = _mm512_set1_ps(s), off = _mm512_set1_ps(z), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512i shift = _mm512_set1_epi32(vnni ? 128 : 0);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(p + j), d), off),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, shift)));
  }
  for (; j < k; ++j)
    out[j] = stored(static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(p[j] / s + z)))), vnni);
}

// amax_scalar with AVX2 (CPUs without AVX512): max |p[j]|, NaN when a p[j] is NaN.
__attribute__((target("avx2"))) float amax_avx2(const float* p, int64_t k) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, _mm256_and_ps(v, magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float r = 0.f;
  for (float v : lanes) r = std::max(r, v);
  for (; j < k; ++j) r = std::isnan(p[j]) ? p[j] : std::max(r, std::fabs(p[j]));
  return _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : r;
}

// out[j] = stored(clamp(nearbyint(p[j] / div + z), -128, 127)) with AVX2: IEEE division and round-half-even as the
// scalar paths (z = 0: the dynamic quantizer, as + 0 changes no quotient's rounding).
__attribute__((target("avx2"))) void quant_row_avx2(const float* p, int64_t k, float div, float z, bool vnni,
                                                    uint8_t* out) {
  const __m256 d = _mm256_set1_ps(div), off = _mm256_set1_ps(z), lo = _mm256_set1_ps(-128.f),
               hi = _mm256_set1_ps(127.f);
  const __m256i shift = _mm256_set1_epi32(vnni ? 128 : 0);
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 v = _mm256_round_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(p + j), d), off),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi)), shift);
    // int32 lanes (all in [-128, 255]) -> 8 bytes: 16-bit packs per 128-bit lane, then the two lanes' low qwords
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0x08);
    const __m128i b8 = _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_castsi256_si128(w16));
    const __m128i s8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_castsi256_si128(w16));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), vnni ? b8 : s8);
  }
  for (; j < k; ++j)
    out[j] = stored(static_cast<int32_t>(std::min(127.f, std::max(-128.f, std::nearbyint(p[j] / div + z)))), vnni);
}

void check_int8_weight(const at::Tensor& w, const at::Tensor& row_sum) {
  check_weight(w, at::kChar);
  TORCH_CHECK(w.size(1) <= kMaxK, "K = ", w.size(1), " exceeds ", kMaxK);
  check_vec(row_sum, "row_sum", w.size(0), at::kInt);
}

