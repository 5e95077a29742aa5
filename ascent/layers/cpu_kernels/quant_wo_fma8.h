// W8A16 kernel for 16-bit (bf16 / fp16) activations on AVX512 without VNNI (or with quant_wo_vnni.h switched off /
// not applicable): int8 weights become fp32 by bit operations only; included by quant_gemv_cpu.cpp inside namespace
// ascent_quant's anonymous namespace, after quant_wo_bf16.h (it shares WoBf16Args' chunk / span / scale layout and
// the chain count).
//
// A 64-byte chunk of a weight row, read as 16 dwords d = b0 | b1 << 8 | b2 << 16 | b3 << 24, gives four fp32
// vectors: phase p takes byte bp to bits 15..22 (d << 15, d << 7, d >> 1, d >> 9), keeps those bits and xors in
// 0x3FC00000 = 0x3F800000 (1.0) ^ 0x00400000 (flips the byte's top bit: u = b ^ 0x80 = q + 128), i.e. the float
// 1 + u / 256 exactly (u fills the 8 mantissa bits below the leading one). Phase p, lane i holds column 4i + p of
// the 64-column block; x is stored permuted to match (x_slot_fma8), in fp32.
// x * (1 + u / 256) is exact in the FMA for 16-bit x (8 / 11 + 9 significant bits), so per group
//   sum x q = 256 * sum x (1 + u / 256) - 384 * sum x,
// and acc = 256 * sum_g s_g * D_g - 384 * sum_g s_g * X_g (X_g the group sums of x). The offset 1.5 x per column
// is of the order of the data term (|q| / 256 <= 0.5), so cancellation costs ~2 bits, well inside a 16-bit output's
// rounding (fp32 x keeps the exact-q kernel wo8_block_avx512). Integer ops feeding FMAs run at full speed on this
// CPU, unlike integer ops feeding VDPBF16PS (quant_wo_bf16.h), and this needs no int -> float conversion uops:
// measured 1 thread, SmolLM2-135M shapes, bf16 x, vs wo8_block_avx512 ~10% faster DRAM-resident (M = 1..4) and in
// cache; the VDPBF16PS int8 variant is slower than both (kept for tests behind set_wo_bf16_int8).
#pragma once

struct WoFma8Args {
  WoBf16Args c;        // chunks, scales and spans as the VDPBF16PS kernels (64 columns per chunk, x unused)
  const float* xf;     // [M, ldx] fp32 x, x_slot_fma8 order, zero padded to nblocks * 64 columns
  const float* xg;     // [M, G] group sums of x
};

constexpr int64_t x_slot_fma8(int64_t j) { return (j & ~int64_t(63)) + (j & 3) * 16 + ((j & 63) >> 2); }

// d[c][r][m] (+)= chunk b's x * (1 + u / 256) products, chain c taking phases c * 4 / C ... (first: assign).
template <bool kTail, int C, int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void fma8_chunk(
    const WoFma8Args& a, const uint8_t* w, int64_t b, __mmask64 tail, bool first, const float* x,
    __m512 (&d)[C][R][MB]) {
  const __m512i keep = _mm512_set1_epi32(0x007F8000), one = _mm512_set1_epi32(0x3FC00000);
  constexpr int kAndXor = 0x6A;  // ternary logic (A & B) ^ C
  constexpr int kPer = 4 / C;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = w + r * a.c.ldw + b * 64;
    prefetch_weights(p, a.c.ldw);
    const __m512i v = kTail ? _mm512_maskz_loadu_epi8(tail, p) : _mm512_loadu_si512(p);
    __m512 wv[4];
    wv[0] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 15), keep, one, kAndXor));
    wv[1] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 7), keep, one, kAndXor));
    wv[2] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 1), keep, one, kAndXor));
    wv[3] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 9), keep, one, kAndXor));
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const float* xp = x + m * a.c.ldx + b * 64;
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        __m512 t = first ? _mm512_setzero_ps() : d[c][r][m];
#pragma GCC unroll 16
        for (int i = c * kPer; i < (c + 1) * kPer; ++i) t = _mm512_fmadd_ps(wv[i], _mm512_loadu_ps(xp + 16 * i), t);
        d[c][r][m] = t;
      }
    }
  }
}

// acc[m * R + r] = sum_g s[n + r, g] * (x_g . q_g) for weight rows n..n+R-1 and MB rows of x.
template <int C, int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo8_fma_rows_c(const WoFma8Args& a, int64_t n, int64_t m0,
                                                                        float* acc) {
  const WoBf16Args& c = a.c;
  const uint8_t* w = c.w + n * c.ldw;
  const float* x = a.xf + m0 * c.ldx;
  __m512 y[R][MB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) y[r][m] = _mm512_setzero_ps();
  int64_t g0 = 0, g1 = 0;  // scale groups of the span's first chunk's halves
  for (int64_t s0 = 0; s0 < c.nblocks; s0 += c.span) {
    const int64_t s1 = std::min(c.nblocks, s0 + c.span), f1 = std::min(s1, c.nfull);
    __m512 d[C][R][MB];
    int64_t b = s0;
    if (b < f1) fma8_chunk<false, C, R, MB>(a, w, b++, 0, true, x, d);
    for (; b < f1; ++b) fma8_chunk<false, C, R, MB>(a, w, b, 0, false, x, d);
    if (b < s1) {  // the partial last chunk of the row
      const __mmask64 tail = (~0ull) >> (64 - (c.ldw - b * 64));
      if (b == s0) fma8_chunk<true, C, R, MB>(a, w, b, tail, true, x, d);
      else fma8_chunk<true, C, R, MB>(a, w, b, tail, false, x, d);
    }
    next_groups(c.groups, c.gs, s0 * 64, 64 / 2, g0, g1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* sr = c.scale + (n + r) * c.groups;
      const __m512 s = _mm512_mask_broadcastss_ps(_mm512_set1_ps(sr[g0]), 0xFF00, _mm_set_ss(sr[g1]));
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        __m512 sum = d[0][r][m];
#pragma GCC unroll 16
        for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, d[i][r][m]);
        y[r][m] = _mm512_fmadd_ps(sum, s, y[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float off = 0.f;  // sum_g s_g X_g
      for (int64_t g = 0; g < c.groups; ++g) off += c.scale[(n + r) * c.groups + g] * a.xg[(m0 + m) * c.groups + g];
      acc[m * R + r] = 256.f * _mm512_reduce_add_ps(y[r][m]) - 384.f * off;
    }
}

using WoFma8Fn = void (*)(const WoFma8Args&, int64_t, int64_t, float*);

template <int R>
WoFma8Fn wo8_fma_fn(int64_t mb) {
  switch (mb) {
    case 1: return wo8_fma_rows_c<bf16_chains<R, 1>(), R, 1>;
    case 2: return wo8_fma_rows_c<bf16_chains<R, 2>(), R, 2>;
    case 3: return wo8_fma_rows_c<bf16_chains<R, 3>(), R, 3>;
    default: return wo8_fma_rows_c<bf16_chains<R, 4>(), R, 4>;
  }
}

// Whether the FMA int8 kernel takes this call: 16-bit x on AVX512, G = 1 or groups of a multiple of 128 columns.
// (The kernel also handles gs % 32 == 0 through the span / halves scales, but with a scale step every 64 columns it
// measured slower than wo8_block_avx512: gs = 64 215 vs 192 us, gs = 128 equal, G = 1 140 vs 157 us at 2048 x 1536.)
bool wo8_fma_applies(const at::Tensor& x, int64_t groups, int64_t gs) {
  return (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && use_avx512() && !g_wo_bf16_int8 &&
         (groups == 1 || gs % 128 == 0);
}

// Fills the permuted fp32 x (zero padded) for x [M, K].
void wo8_fma_prepare(const at::Tensor& x, WoFma8Args& a, std::vector<float>& xf) {
  const int64_t m_rows = x.size(0), k = x.size(1), ld = x.stride(0);
  a.c.ldx = a.c.nblocks * 64;
  xf.assign(static_cast<size_t>(m_rows * a.c.ldx), 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wo8_fma_prepare", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t j = 0; j < k; ++j) xf[m * a.c.ldx + x_slot_fma8(j)] = static_cast<float>(p[m * ld + j]);
  });
  a.xf = xf.data();
}

// acc [mb, rows] for weight rows [n, n + rows) and x rows [m0, m0 + mb) (mb <= kBf16MaxM).
void wo8_fma_block(const WoFma8Args& a, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  if (rows == kRowBlock) return wo8_fma_fn<kRowBlock>(mb)(a, n, m0, acc);
  for (int64_t r = 0; r < rows; ++r) {  // tail rows one at a time
    float one[kBf16MaxM];
    wo8_fma_fn<1>(mb)(a, n + r, m0, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}
