// Weight-only (W8A16 / W4A16) kernels for bf16 activations on AVX512-BF16 (VDPBF16PS); included by
// quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after quant_wo_blocks.h.
//
// The weights become bf16 numbers by bit operations only (no int -> float conversions). For a nibble v in 0..15
// the bf16 bits 0x4300 | v are exactly 128 + v (exponent 2^7: the mantissa's last bit is worth 1) and 0x4500 | v
// exactly 2048 + 16 v (exponent 2^11: the last bit is worth 16). A 64-byte chunk of a weight row, read as 32
// 16-bit words w = b0 | b1 << 8 (b0 at the lower address), gives four bf16 vectors
//   A = (w & 15) ^ LO,  B = (w >> 4 & 15) ^ HI,  C = (w >> 8 & 15) ^ LO,  D = (w >> 12) ^ HI
// (xor = or here: the constants' low nibbles are zero or fold in a flip, see below):
// * int4 (nibbles u = q + 8, the even column in the low one; LO = HI = 0x4300): A..D hold 128 + u = 136 + q of
//   the columns 4i, 4i + 1, 4i + 2, 4i + 3 of a 128-column block (word i). Offset O = 136.
// * int8 (u = q + 128 = b ^ 0x80: u's low nibble is b's, its high nibble b's high nibble ^ 8; LO = 0x4300,
//   HI = 0x4508 folds that ^ 8 in): A = 128 + lo(u0), B = 2048 + 16 hi(u0), so A + B = 2176 + u0 = 2304 + q0; C, D
//   the same for b1. A, B multiply column 2i and C, D column 2i + 1 of a 64-column block. Offset O = 2304.
// x is stored permuted per block to match (x_slot_bf16: the P = BW / 32 phases j % P of the block one after the
// other), so fp32 lane l of a block's dot product holds BW / 16 consecutive columns: sum x_j (O + q_j) over them.
// Each block's chain starts from -O * (those columns' x sum) (noff, per call), so the large offset cancels within
// the block and the fp32 accumulators carry only x . q (no growth with K or with a non-zero mean of x).
// VDPBF16PS multiplies bf16 pairs exactly and adds in fp32 (round to nearest even, denormal inputs read as zero):
// the result is an fp32 dot product in another order, like the fp32 kernels.
// Used for int4 with bf16 x where the VNNI fixed-point kernel (quant_wo_vnni.h, ~1.5x faster here) does not apply
// or is switched off; the int8 variant is slower than quant_wo_fma8.h on this CPU (see wo_bf16_applies) and only
// runs when a test asks for it.
// Scales: G = 1 or groups of gs columns with gs % (BW / 2) == 0: lanes 0-7 of a block are its first half, lanes
// 8-15 the second, so one fma per span of blocks applies [s(first half) x 8, s(second half) x 8].
#pragma once

struct WoBf16Args {
  const uint8_t* w;      // weight rows: int8 [N, K] or packed int4 [N, ceil(K/2)]
  int64_t ldw;           // bytes per weight row
  int64_t nblocks;       // 64-byte chunks per row (the last one may be partial)
  int64_t nfull;         // complete 64-byte chunks per row
  const uint16_t* x;     // [M, ldx] x's bf16 bits, x_slot_bf16 order, zero padded to nblocks * BW columns
  int64_t ldx;
  const float* noff;     // [M, ldo] -O * sum of x over each block lane's columns
  int64_t ldo;           // nblocks * 16
  const float* scale;    // [N, G]
  int64_t groups, gs;    // G, columns per group
  int64_t span;          // blocks per scale vector: all (G = 1), gs / BW, or 1 (gs = BW / 2 mod BW)
};

constexpr int64_t kBf16MaxM = 4;  // x rows per pass over a weight row block
int g_wo_bf16_int8 = 0;  // tests: 1 = W8A16 with bf16 x takes the VDPBF16PS kernel too (slower here, kept correct)

// Columns per 64-byte weight chunk.
constexpr int64_t bf16_block(bool int4) { return int4 ? 128 : 64; }

// Slot of column j in the permuted x (block of bw columns: its P = bw / 32 phases j % P one after the other).
constexpr int64_t x_slot_bf16(int64_t j, int64_t bw) {
  const int64_t p = bw / 32;
  return (j & ~(bw - 1)) + (j % p) * 32 + (j & (bw - 1)) / p;
}

// Advances g0 / g1 to the groups of columns c0 and c0 + half (the halves of a span's first chunk; one group when
// the span is whole groups), clamped to the last group (padding columns). Counters instead of divisions: the
// columns only grow.
inline void next_groups(int64_t groups, int64_t gs, int64_t c0, int64_t half, int64_t& g0, int64_t& g1) {
  while (g0 + 1 < groups && (g0 + 1) * gs <= c0) ++g0;
  g1 = std::max(g1, g0);
  while (g1 + 1 < groups && (g1 + 1) * gs <= c0 + half) ++g1;
}

// Independent accumulator chains per (row, x row): VDPBF16PS has a long latency (~8 cycles measured, 1 per cycle
// throughput), so with few rows and x rows the four products of a chunk go to separate chains.
template <int R, int MB>
constexpr int bf16_chains() {
  return R * MB >= 12 ? 1 : (R * MB >= 8 ? 2 : 4);
}

// d[c][r][m] (+)= chunk b's x * (O + q) products, chain c taking the products c * 4 / C ... of (A, B, C, D); chain 0
// starts each chunk from noff (the chunk's -O * sum(x), so the offset cancels per chunk) and is added to d[0].
// first: the span's first chunk (assign). kTail: the partial last chunk (masked load, zeros past the row).
template <bool kInt4, bool kTail, int C, int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void chunk_dots(
    const WoBf16Args& a, const uint8_t* w, int64_t b, __mmask64 tail, bool first, const uint16_t* x,
    const float* noff, __m512 (&d)[C][R][MB]) {
  const __m512i nib = _mm512_set1_epi16(0x000F), lo = _mm512_set1_epi16(0x4300);
  const __m512i hi = _mm512_set1_epi16(kInt4 ? 0x4300 : 0x4508);
  constexpr int kAndXor = 0x6A;  // ternary logic (A & B) ^ C
  constexpr int kPer = 4 / C;    // products per chain
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = w + r * a.ldw + b * 64;
    prefetch_weights(p, a.ldw);
    const __m512i v = kTail ? _mm512_maskz_loadu_epi8(tail, p) : _mm512_loadu_si512(p);
    __m512bh wv[4];
    wv[0] = (__m512bh)_mm512_ternarylogic_epi32(v, nib, lo, kAndXor);
    wv[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, hi, kAndXor);
    wv[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nib, lo, kAndXor);
    wv[3] = (__m512bh)_mm512_xor_si512(_mm512_srli_epi16(v, 12), hi);
    for (int m = 0; m < MB; ++m) {
      // x vectors of the products: int8 (even, even, odd, odd) columns of the block, int4 phases 0, 1, 2, 3
      const uint16_t* xp = x + m * a.ldx + b * bf16_block(kInt4);
      __m512bh xv[4];
      for (int i = 0; i < 4; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(xp + 32 * (kInt4 ? i : i / 2));
      for (int c = 0; c < C; ++c) {
        __m512 t = c == 0 ? _mm512_loadu_ps(noff + m * a.ldo + b * 16) : (first ? _mm512_setzero_ps() : d[c][r][m]);
        for (int i = c * kPer; i < (c + 1) * kPer; ++i) t = _mm512_dpbf16_ps(t, wv[i], xv[i]);
        d[c][r][m] = c == 0 && !first ? _mm512_add_ps(d[0][r][m], t) : t;
      }
    }
  }
}

// acc[m * R + r] = sum_g s[n + r, g] * (x_g . q_g) for weight rows n..n+R-1 and MB rows of x.
template <bool kInt4, int C, int R, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void wo_bf16_rows_c(const WoBf16Args& a, int64_t n,
                                                                                   const uint16_t* x,
                                                                                   const float* noff, float* acc) {
  constexpr int64_t bw = bf16_block(kInt4);
  const uint8_t* w = a.w + n * a.ldw;
  __m512 y[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[r][m] = _mm512_setzero_ps();
  int64_t g0 = 0, g1 = 0;  // scale groups of the span's first chunk's halves
  for (int64_t s0 = 0; s0 < a.nblocks; s0 += a.span) {
    const int64_t s1 = std::min(a.nblocks, s0 + a.span), f1 = std::min(s1, a.nfull);
    __m512 d[C][R][MB];
    int64_t b = s0;
    if (b < f1) chunk_dots<kInt4, false, C, R, MB>(a, w, b++, 0, true, x, noff, d);
    for (; b < f1; ++b) chunk_dots<kInt4, false, C, R, MB>(a, w, b, 0, false, x, noff, d);
    if (b < s1) {  // the partial last chunk of the row
      const __mmask64 tail = (~0ull) >> (64 - (a.ldw - b * 64));
      if (b == s0) chunk_dots<kInt4, true, C, R, MB>(a, w, b, tail, true, x, noff, d);
      else chunk_dots<kInt4, true, C, R, MB>(a, w, b, tail, false, x, noff, d);
    }
    next_groups(a.groups, a.gs, s0 * bw, bw / 2, g0, g1);
    for (int r = 0; r < R; ++r) {
      const float* sr = a.scale + (n + r) * a.groups;
      const __m512 s = _mm512_mask_broadcastss_ps(_mm512_set1_ps(sr[g0]), 0xFF00, _mm_set_ss(sr[g1]));
      for (int m = 0; m < MB; ++m) {
        __m512 sum = d[0][r][m];
        for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, d[c][r][m]);
        y[r][m] = _mm512_fmadd_ps(sum, s, y[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[m * R + r] = _mm512_reduce_add_ps(y[r][m]);
}

// One chain per (row, x row) when a span is one chunk (the chunks' chains are independent then).
template <bool kInt4, int R, int MB>
void wo_bf16_rows(const WoBf16Args& a, int64_t n, const uint16_t* x, const float* noff, float* acc) {
  if (a.span == 1) return wo_bf16_rows_c<kInt4, 1, R, MB>(a, n, x, noff, acc);
  wo_bf16_rows_c<kInt4, bf16_chains<R, MB>(), R, MB>(a, n, x, noff, acc);
}

using WoBf16Fn = void (*)(const WoBf16Args&, int64_t, const uint16_t*, const float*, float*);

template <bool kInt4, int R>
WoBf16Fn wo_bf16_fn(int64_t mb) {
  switch (mb) {
    case 1: return wo_bf16_rows<kInt4, R, 1>;
    case 2: return wo_bf16_rows<kInt4, R, 2>;
    case 3: return wo_bf16_rows<kInt4, R, 3>;
    default: return wo_bf16_rows<kInt4, R, 4>;
  }
}

// Whether the bf16 kernels take this call: bf16 x, AVX512-BF16, and G = 1 or groups of whole block halves.
// int8 uses the FMA kernel (quant_wo_fma8.h) instead: measured on this project's Xeon (SPR class), a VDPBF16PS whose
// bf16 operand comes straight from integer ALU ops (ternlog / shift) runs at ~1/3 of its throughput (3.4 vs
// 1.2 ns per 7 ALU ops + 4 VDPBF16PS with independent operands; ALU ops feeding fp32 FMAs do not stall: 1.6 ns),
// so the 4 VDPBF16PS per 64 int8 weights lose to 4 FMAs per 64; int4 (128 weights per 4 VDPBF16PS vs 8 FMAs and 8
// shifts) still wins (an FMA int4 variant measured 10-20% slower).
bool wo_bf16_applies(const at::Tensor& x, bool int4, int64_t groups, int64_t gs) {
  if (!int4 && !g_wo_bf16_int8) return false;
  return x.scalar_type() == at::kBFloat16 && use_bf16() && (groups == 1 || gs % (bf16_block(int4) / 2) == 0);
}

// Per-call x buffers (reused by the calling thread; the row workers only read them during the call).
struct WoBf16Scratch {
  std::vector<uint16_t> x;
  std::vector<float> noff;
};

// Fills the permuted bf16 x and the per-lane offsets for x [M, K] (bf16, unit column stride); kBw columns per block
// (a compile-time constant: the slot arithmetic becomes shifts).
template <int64_t kBw>
void wo_bf16_fill(const at::Tensor& x, float offset, const WoBf16Args& a, WoBf16Scratch& s) {
  const int64_t m_rows = x.size(0), k = x.size(1), ld = x.stride(0);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < m_rows; ++m) {
    uint16_t* xr = s.x.data() + m * a.ldx;
    float* off = s.noff.data() + m * a.ldo;
    for (int64_t j = 0; j < k; ++j) {
      const uint16_t bits = src[m * ld + j];
      xr[x_slot_bf16(j, kBw)] = bits;
      const uint32_t f32 = static_cast<uint32_t>(bits) << 16;  // bf16 -> fp32 is exact
      float v;
      std::memcpy(&v, &f32, sizeof(v));
      off[j / (kBw / 16)] += v;
    }
    for (int64_t l = 0; l < a.ldo; ++l) off[l] *= -offset;
  }
}

void wo_bf16_prepare(const at::Tensor& x, bool int4, WoBf16Args& a, WoBf16Scratch& s) {
  const int64_t m_rows = x.size(0), bw = bf16_block(int4);
  a.ldx = a.nblocks * bw;
  a.ldo = a.nblocks * 16;
  s.x.assign(static_cast<size_t>(m_rows * a.ldx), 0);
  s.noff.assign(static_cast<size_t>(m_rows * a.ldo), 0.f);
  if (int4) wo_bf16_fill<bf16_block(true)>(x, 136.f, a, s);
  else wo_bf16_fill<bf16_block(false)>(x, 2304.f, a, s);
  a.x = s.x.data();
  a.noff = s.noff.data();
}

// acc [mb, rows] for weight rows [n, n + rows) and x rows [m0, m0 + mb) (mb <= kBf16MaxM).
void wo_bf16_block(const WoBf16Args& a, bool int4, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  const uint16_t* x = a.x + m0 * a.ldx;
  const float* noff = a.noff + m0 * a.ldo;
  if (rows == kRowBlock) {
    (int4 ? wo_bf16_fn<true, kRowBlock>(mb) : wo_bf16_fn<false, kRowBlock>(mb))(a, n, x, noff, acc);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // tail rows one at a time
    float one[kBf16MaxM];
    (int4 ? wo_bf16_fn<true, 1>(mb) : wo_bf16_fn<false, 1>(mb))(a, n + r, x, noff, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}
