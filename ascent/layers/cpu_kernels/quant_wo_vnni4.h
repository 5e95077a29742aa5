// W4A16 kernel for 16-bit (bf16 / fp16) activations on AVX512-VNNI: exact integer dot products; included by
// quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after quant_wo_bf16.h (it shares
// prefetch_weights).
//
// Activations: each row of x becomes 16-bit fixed point with a power-of-two step 2^e chosen so that
// max|x| / 2^e <= kX16Max: x^ = nearbyint(x / 2^e), |x - x^ 2^e| <= 2^(e-1) < max|x| / 32639 (a bf16 x carries 8
// significant bits, so every element down to max|x| / 2^7 is exact, and the rest err by less than 1 / 64 of the
// largest's own bf16 rounding). x^ = 256 hi + lo with hi, lo in [-128, 127] (hi = (x^ + 128) >> 8): two s8 operands.
// Weights: a 64-byte chunk of a packed row (128 columns; byte j holds column 2j in its low nibble, 2j + 1 in its
// high one, u = q + 8) gives L = v & 15 (the even columns) and H = v >> 4 & 15 (the odd ones) as u8 operands.
// VPDPBUSD then sums u * hi and u * lo exactly in int32; dword lane l of a chunk covers bytes 4l .. 4l + 3, i.e.
// columns 8l .. 8l + 7 of the chunk, so every lane lies inside one scale group (groups are multiples of 32 columns).
// Per chunk: t = 256 * (L . hi_e + H . hi_o) + (L . lo_e + H . lo_o) - 8 * sum(x^ over the lane's columns), exact
// (|t| < 2^23 per lane, so its conversion to fp32 is exact too), then y += t * scale(lane's group) in fp32 and
// finally y * 2^e. Four VPDPBUSD and three integer ops per 128 weights, against four VDPBF16PS slowed by their
// bit-trick operands on this CPU (quant_wo_bf16.h). Measured, SmolLM2-135M shapes, bf16 x, group 64, M = 1: per
// call 1.4-1.6x faster on 1 thread (gate_up 99 -> 62 us, lm_head 1.51 -> 1.01 ms); a W4A16 decode step (2 threads)
// 5.8 -> 4.8 ms. Accuracy on real SmolLM2 activations (max/median up to 1500): the same error distribution against
// an fp64 reference as the VDPBF16PS kernel (both set by the bf16 output rounding).
// Rows of x are prepared independently (own step, own buffers): a row's output does not depend on the batch.
#pragma once

constexpr int32_t kX16Max = 32767 - 128;  // |x^| bound keeping hi = (x^ + 128) >> 8 inside int8
int g_wo4_vnni = 1;                       // tests: 0 = the VDPBF16PS kernel for 16-bit x

// Per-call operands: prepared x rows and the per-chunk scale lookup.
struct Wo4VnniArgs {
  const uint8_t* w;      // packed nibble rows [N, ldw]
  int64_t ldw;           // bytes per weight row (ceil(K / 2))
  int64_t nblocks;       // 64-byte chunks per row (the last may be partial)
  const int8_t* xb;      // [M][nblocks][4][64]: hi of the even columns, hi of the odd ones, lo even, lo odd
  const int32_t* corr;   // [M][nblocks][16]: -8 * sum of x^ over each lane's 8 columns
  const float* step;     // [M]: 2^e
  const float* scale;    // [N, G]
  int64_t groups;
  const int32_t* lane_group;  // [nblocks][16]: lane's group - the chunk's first group (grouped only)
  const int64_t* first_group;  // [nblocks]
};

struct Wo4VnniScratch {
  std::vector<int8_t> xb;
  std::vector<int32_t> corr;
  std::vector<float> step;
  std::vector<int32_t> lane_group;
  std::vector<int64_t> first_group;
};

bool wo4_vnni_applies(const at::Tensor& x) {
  return g_wo4_vnni && use_vnni() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

// Row m of x as x^ = nearbyint(x / step) into its chunks (scalar: the definition the vector path reproduces).
void wo4_vnni_fill_row(const float* xf, int64_t k, float inv_step, int8_t* xb, int32_t* corr) {
  for (int64_t j = 0; j < k; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xf[j] * inv_step));
    const int32_t hi = (v + 128) >> 8, lo = v - hi * 256;
    const int64_t b = j / 128, within = j % 128, slot = (within & 1) * 64 + within / 2;
    xb[b * 256 + slot] = static_cast<int8_t>(hi);
    xb[b * 256 + 128 + slot] = static_cast<int8_t>(lo);
    corr[b * 16 + within / 8] -= 8 * v;
  }
}

// max |x| of a bf16 row (exact: a bf16 value widens exactly), vectorised.
__attribute__((target("avx512f,avx512bw"))) float bf16_row_amax(const uint16_t* p, int64_t k) {
  __m512i mx = _mm512_setzero_si512();  // |x| bits: non-negative floats (inf, NaN above) order as integers
  const __m512i magnitude = _mm512_set1_epi32(0x7FFF0000);
  for (int64_t j = 0; j < k; j += 32) {
    const __mmask32 mask = k - j >= 32 ? ~0u : (1u << (k - j)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi16(mask, p + j);  // dword i: x[2i] low, x[2i + 1] high
    mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_slli_epi32(v, 16), magnitude));
    mx = _mm512_max_epu32(mx, _mm512_and_si512(v, magnitude));
  }
  const uint32_t bits = _mm512_reduce_max_epu32(mx);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// wo4_vnni_fill_row for a bf16 row, 32 columns per step: the even / odd columns of a 32-column piece are the low /
// high halves of its dwords, which is the chunk's even / odd byte order already.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo4_vnni_fill_bf16(const uint16_t* p, int64_t k,
                                                                             float inv_step, int8_t* xb,
                                                                             int32_t* corr) {
  const __m512 inv = _mm512_set1_ps(inv_step);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)), round = _mm512_set1_epi32(128);
  alignas(64) int32_t sums[16];
  for (int64_t j = 0; j < k; j += 32) {
    const __mmask32 mask = k - j >= 32 ? ~0u : (1u << (k - j)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi16(mask, p + j);
    const __m512i even = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), inv));
    const __m512i odd = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), inv));
    const __m512i hi_e = _mm512_srai_epi32(_mm512_add_epi32(even, round), 8);
    const __m512i hi_o = _mm512_srai_epi32(_mm512_add_epi32(odd, round), 8);
    int8_t* chunk = xb + (j / 128) * 256 + (j % 128) / 2;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk), _mm512_cvtepi32_epi8(hi_e));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 64), _mm512_cvtepi32_epi8(hi_o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 128),
                     _mm512_cvtepi32_epi8(_mm512_sub_epi32(even, _mm512_slli_epi32(hi_e, 8))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 192),
                     _mm512_cvtepi32_epi8(_mm512_sub_epi32(odd, _mm512_slli_epi32(hi_o, 8))));
    _mm512_store_si512(sums, _mm512_add_epi32(even, odd));  // dword i: columns j + 2i, j + 2i + 1
    int32_t* c = corr + (j / 128) * 16 + (j % 128) / 8;
    for (int q = 0; q < 4; ++q) c[q] -= 8 * (sums[4 * q] + sums[4 * q + 1] + sums[4 * q + 2] + sums[4 * q + 3]);
  }
}

// The x buffers of every row and the chunks' group lookup; false when x has a non-finite value (the caller then
// takes the floating-point kernel, which propagates it).
bool wo4_vnni_prepare(const at::Tensor& x, int64_t k, int64_t groups, Wo4VnniArgs& a, Wo4VnniScratch& s) {
  const int64_t m_rows = x.size(0), ld = x.stride(0), nb = a.nblocks;
  s.xb.assign(static_cast<size_t>(m_rows * nb * 256), 0);
  s.corr.assign(static_cast<size_t>(m_rows * nb * 16), 0);
  s.step.assign(static_cast<size_t>(m_rows), 1.f);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xf;
  for (int64_t m = 0; m < m_rows; ++m) {
    const uint16_t* row = bits + m * ld;
    float amax = 0.f;
    if (bf16) {
      amax = bf16_row_amax(row, k);
    } else {
      xf.resize(static_cast<size_t>(k));
      const c10::Half* h = reinterpret_cast<const c10::Half*>(row);
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(xf[j] = static_cast<float>(h[j])));
    }
    if (!std::isfinite(amax)) return false;
    if (amax == 0.f) continue;  // x^ = 0: the buffers' zeros
    int e = 0;
    std::frexp(amax / static_cast<float>(kX16Max), &e);  // amax / kX16Max <= 2^e < 2 * amax / kX16Max
    e = std::max(e, -126);
    s.step[m] = std::ldexp(1.f, e);
    int8_t* xb = s.xb.data() + m * nb * 256;
    int32_t* corr = s.corr.data() + m * nb * 16;
    if (bf16) wo4_vnni_fill_bf16(row, k, std::ldexp(1.f, -e), xb, corr);
    else wo4_vnni_fill_row(xf.data(), k, std::ldexp(1.f, -e), xb, corr);
  }
  s.lane_group.assign(static_cast<size_t>(nb * 16), 0);
  s.first_group.assign(static_cast<size_t>(nb), 0);
  const int64_t gs = k / groups;
  for (int64_t b = 0, g = 0; b < nb && groups > 1; ++b) {  // group of column c: a counter (no divisions per call)
    for (int64_t l = 0; l < 16; ++l) {
      while (g + 1 < groups && (g + 1) * gs <= b * 128 + 8 * l) ++g;
      if (l == 0) s.first_group[b] = g;
      s.lane_group[b * 16 + l] = static_cast<int32_t>(g - s.first_group[b]);
    }
  }
  a.xb = s.xb.data();
  a.corr = s.corr.data();
  a.step = s.step.data();
  a.groups = groups;
  a.lane_group = s.lane_group.data();
  a.first_group = s.first_group.data();
  return true;
}

// acc[r] = sum_g s[n + r, g] * (x_g . q_g) of x row m for weight rows n .. n + R - 1.
template <int R, bool kGrouped>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void wo4_vnni_rows(const Wo4VnniArgs& a, int64_t n,
                                                                                   int64_t m, float* acc) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int8_t* xb = a.xb + m * a.nblocks * 256;
  const int32_t* corr = a.corr + m * a.nblocks * 16;
  const uint8_t* w = a.w + n * a.ldw;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nblocks; ++b) {
    const __m512i xeh = _mm512_loadu_si512(xb + b * 256), xoh = _mm512_loadu_si512(xb + b * 256 + 64);
    const __m512i xel = _mm512_loadu_si512(xb + b * 256 + 128), xol = _mm512_loadu_si512(xb + b * 256 + 192);
    const __m512i c = _mm512_loadu_si512(corr + b * 16);
    const int64_t left = a.ldw - b * 64;
    const __mmask64 bytes = left >= 64 ? ~0ULL : (1ULL << left) - 1;
    __m512i idx = _mm512_setzero_si512();
    __mmask16 have = 0;
    if constexpr (kGrouped) {
      idx = _mm512_loadu_si512(a.lane_group + b * 16);
      const int64_t avail = a.groups - a.first_group[b];
      have = avail >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << avail) - 1);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w + r * a.ldw + b * 64;
      prefetch_weights(p, a.ldw);
      const __m512i v = _mm512_maskz_loadu_epi8(bytes, p);
      const __m512i lo_n = _mm512_and_si512(v, nib), hi_n = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo_n, xeh);
      hi = _mm512_dpbusd_epi32(hi, hi_n, xoh);
      __m512i lo = _mm512_dpbusd_epi32(c, lo_n, xel);
      lo = _mm512_dpbusd_epi32(lo, hi_n, xol);
      const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
      if constexpr (kGrouped) {
        const __m512 s = _mm512_maskz_loadu_ps(have, a.scale + (n + r) * a.groups + a.first_group[b]);
        y[r] = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(idx, s), y[r]);
      } else {
        y[r] = _mm512_add_ps(y[r], t);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float sum = _mm512_reduce_add_ps(y[r]) * a.step[m];
    acc[r] = kGrouped ? sum : sum * a.scale[n + r];
  }
}

// acc [rows] for weight rows [n, n + rows) and x row m.
void wo4_vnni_block(const Wo4VnniArgs& a, int64_t n, int64_t rows, int64_t m, float* acc) {
  const bool grouped = a.groups > 1;
  if (rows == kRowBlock) {
    (grouped ? wo4_vnni_rows<kRowBlock, true> : wo4_vnni_rows<kRowBlock, false>)(a, n, m, acc);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) (grouped ? wo4_vnni_rows<1, true> : wo4_vnni_rows<1, false>)(a, n + r, m, acc + r);
}
