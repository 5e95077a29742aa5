// Weight-only (W4A16 / W8A16) kernels for 16-bit (bf16 / fp16) activations on AVX512-VNNI: exact integer dot
// products; included by quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after
// quant_wo_bf16.h (it shares prefetch_weights).
//
// Activations: each row of x becomes 16-bit fixed point with a power-of-two step 2^e chosen so that
// max|x| / 2^e <= kX16Max: x^ = nearbyint(x / 2^e), |x - x^ 2^e| <= 2^(e-1) < max|x| / 32639 (a bf16 x carries 8
// significant bits, so every element down to max|x| / 2^7 is exact, and the rest err by less than 1 / 64 of the
// largest's own bf16 rounding). x^ = 256 hi + lo with hi, lo in [-128, 127] (hi = (x^ + 128) >> 8): two s8 operands.
// int4 weights: a 64-byte chunk of a packed row (128 columns; byte j holds column 2j in its low nibble, 2j + 1 in
// its high one, u = q + 8) gives L = v & 15 (the even columns) and H = v >> 4 & 15 (the odd ones) as u8 operands;
// dword lane l of a chunk covers bytes 4l .. 4l + 3, i.e. columns 8l .. 8l + 7.
// int8 weights: a 64-byte chunk of a row (64 columns) as u = q + 128 = v ^ 0x80; lane l covers columns 4l .. 4l + 3.
// VPDPBUSD sums u * hi and u * lo exactly in int32. Per chunk t = 256 * (u . hi) + (u . lo) - O * sum(x^ over the
// lane's columns) (O = 8 / 128; exact in int32: |t| < 2^23 for int4, so its fp32 conversion is exact too; < 2^26 for
// int8), then y += t * scale(lane's group) in fp32 (a lane lies inside one group: the group size is a multiple of
// the lane's columns) and finally y * 2^e. int4: four VPDPBUSD and three integer ops per 128 weights, against four
// VDPBF16PS slowed by their bit-trick operands on this CPU (quant_wo_bf16.h); int8: one xor and two VPDPBUSD per 64.
// Measured, SmolLM2-135M shapes, bf16 x, M = 1: W4A16 (group 64) per call 1.4-1.6x faster on 1 thread (gate_up
// 99 -> 62 us, lm_head 1.51 -> 1.01 ms), a W4A16 decode step (2 threads) 5.8 -> 4.8 ms; W8A16 (per channel) 30
// layers + head 4.98 -> 4.07 ms (2 threads). Accuracy on real SmolLM2 activations (max/median up to 1500): the same
// error distribution against an fp64 reference as the VDPBF16PS kernel (both set by the bf16 output rounding).
// Rows of x are prepared independently (own step, own buffers): a row's output does not depend on the batch.
#pragma once

constexpr int32_t kX16Max = 32767 - 128;  // |x^| bound keeping hi = (x^ + 128) >> 8 inside int8
int g_wo_vnni = 1;                        // tests: 0 = the floating-point kernels for 16-bit x

// Chunk geometry of each weight width: columns per 64-byte chunk, columns per dword lane, x vectors per chunk
// (int4: hi even, hi odd, lo even, lo odd; int8: hi, lo) and the weight offset O (u = q + O).
template <int kBits>
struct VnniGeometry {
  static constexpr int64_t kCols = kBits == 4 ? 128 : 64;
  static constexpr int64_t kLaneCols = kCols / 16;
  static constexpr int64_t kParts = kBits == 4 ? 4 : 2;
  static constexpr int32_t kOffset = kBits == 4 ? 8 : 128;
  // Byte of column `within` (< kCols) inside its chunk's hi vector(s): int4 even columns first, then the odd ones.
  static constexpr int64_t slot(int64_t within) { return kBits == 4 ? (within & 1) * 64 + within / 2 : within; }
};

struct WoVnniArgs;
using WoVnniFn = void (*)(const WoVnniArgs&, int64_t, int64_t, float*);

// Per-call operands: prepared x rows and the per-chunk scale lookup.
struct WoVnniArgs {
  const uint8_t* w;      // weight rows [N, ldw]: packed nibbles (int4) or int8 values
  int64_t ldw;           // bytes per weight row
  int64_t nblocks;       // 64-byte chunks per row (the last may be partial)
  const int8_t* xb;      // [M][nblocks][parts][64]: x^'s hi vector(s), then its lo vector(s)
  const int32_t* corr;   // [M][nblocks][16]: -O * sum of x^ over each lane's columns
  const float* step;     // [M]: 2^e
  const float* scale;    // [N, G]
  int64_t groups;
  const int32_t* lane_group;   // [nblocks][16]: lane's group - the chunk's first group (grouped only)
  const int64_t* first_group;  // [nblocks]
  const float* zero;           // [N, G] subtractive zero points folded in by the AVX2 int4 kernel, or null
  const float* group_sum;      // with zero: [M, G] sum of x^ over each group (wo_vnni_prepare)
  int64_t group_halves = 0;    // AVX2 int4, grouped: 64-column halves per group when whole (gs % 64 == 0), else 0
  bool blocked = false;        // AVX2 int4: w in the blocked layout (quant_wo_fixed_avx2.h, w4a16_block_pack)
};

struct WoVnniScratch {
  std::vector<int8_t> xb;
  std::vector<int32_t> corr;
  std::vector<float> step;
  std::vector<int32_t> lane_group;
  std::vector<int64_t> first_group;
  std::vector<float> group_sum;
};

// 16-bit x, VNNI (or int4 on AVX2: quant_wo_fixed_avx2.h, groups of whole 32-column halves of its lanes), and every
// dword lane inside one scale group (int4 groups are multiples of 32 columns already).
bool wo_vnni_applies(const at::Tensor& x, bool int4, int64_t groups, int64_t gs) {
  const int64_t lane_cols = int4 ? VnniGeometry<4>::kLaneCols : VnniGeometry<8>::kLaneCols;
  const bool isa = use_vnni() || (int4 && use_avx2() && (groups == 1 || gs % 32 == 0));
  return g_wo_vnni && isa && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
         (groups == 1 || gs % lane_cols == 0);
}

// int4 on AVX2 (quant_wo_fixed_avx2.h): bf16 rows to fp32, the x fill of its own layout and wo_vnni_block.
float bf16_row_widen_avx2(const uint16_t* p, int64_t k, float* out);
void wo_fixed_fill_avx2(const float* xf, int64_t halves, float inv_step, int16_t* xw, int32_t* corr);
void wo_fixed_block_avx2(const WoVnniArgs& a, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc);

// Row m of x as x^ = nearbyint(x / step) into its chunks (scalar: the definition the vector paths reproduce).
template <int kBits>
void wo_vnni_fill_row(const float* xf, int64_t k, float inv_step, int8_t* xb, int32_t* corr) {
  using G = VnniGeometry<kBits>;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xf[j] * inv_step));
    const int32_t hi = (v + 128) >> 8, lo = v - hi * 256;
    const int64_t b = j / G::kCols, within = j % G::kCols;
    int8_t* chunk = xb + b * G::kParts * 64;
    chunk[G::slot(within)] = static_cast<int8_t>(hi);
    chunk[G::kParts / 2 * 64 + G::slot(within)] = static_cast<int8_t>(lo);
    corr[b * 16 + within / G::kLaneCols] -= G::kOffset * v;
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

// x^ of 16 columns (fp32 lanes) -> their hi / lo bytes at dst_hi / dst_lo; returns x^.
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512i split16(__m512 f, __m512 inv,
                                                                                         int8_t* dst_hi,
                                                                                         int8_t* dst_lo) {
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(f, inv));  // round to nearest even: nearbyint
  const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(128)), 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst_hi), _mm512_cvtepi32_epi8(hi));
  const __m512i lo = _mm512_sub_epi32(v, _mm512_slli_epi32(hi, 8));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst_lo), _mm512_cvtepi32_epi8(lo));
  return v;
}

// c[q] -= offset * (s[4q] + s[4q + 1] + s[4q + 2] + s[4q + 3]) for q < 4 (exact int32; the lanes' corrections).
__attribute__((target("avx512f,avx512vl"), always_inline)) inline void sub_quad_sums(int32_t* c, __m512i s,
                                                                                 int32_t offset) {
  const __m512i pairs = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
  const __m512i quads = _mm512_add_epi32(pairs, _mm512_shuffle_epi32(pairs, _MM_PERM_BADC));  // per 128-bit lane
  const __m128i firsts = _mm512_castsi512_si128(_mm512_permutexvar_epi32(
      _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), quads));
  const __m128i cur = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c),
                   _mm_sub_epi32(cur, _mm_mullo_epi32(firsts, _mm_set1_epi32(offset))));
}

// wo_vnni_fill_row for a bf16 row, 32 columns per step. int4: the even / odd columns of a 32-column piece are the
// low / high halves of its dwords, which is the chunk's even / odd byte order already; int8: natural order.
template <int kBits>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo_vnni_fill_bf16(const uint16_t* p, int64_t k,
                                                                            float inv_step, int8_t* xb,
                                                                            int32_t* corr) {
  using G = VnniGeometry<kBits>;
  const __m512 inv = _mm512_set1_ps(inv_step);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t j = 0; j < k; j += 32) {
    const __mmask32 mask = k - j >= 32 ? ~0u : (1u << (k - j)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi16(mask, p + j);
    int8_t* chunk = xb + (j / G::kCols) * G::kParts * 64 + G::slot(j % G::kCols);
    int32_t* c = corr + (j / G::kCols) * 16 + (j % G::kCols) / G::kLaneCols;
    if constexpr (kBits == 4) {  // dword i: columns j + 2i, j + 2i + 1 (lanes of 8 columns: 4 dwords each)
      const __m512i even = split16(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), inv, chunk, chunk + 128);
      const __m512i odd = split16(_mm512_castsi512_ps(_mm512_and_si512(v, high)), inv, chunk + 64, chunk + 192);
      sub_quad_sums(c, _mm512_add_epi32(even, odd), G::kOffset);
    } else {  // columns j .. j + 15, then j + 16 .. j + 31 (lanes of 4 columns)
      for (int half = 0; half < 2; ++half) {
        const __m512i wide = _mm512_cvtepu16_epi32(half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
        const __m512i xs = split16(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), inv, chunk + 16 * half,
                                   chunk + 64 + 16 * half);
        sub_quad_sums(c + 4 * half, xs, G::kOffset);
      }
    }
  }
}

// The x buffers of every row and the chunks' group lookup; false when x has a non-finite value (the caller then
// takes the floating-point kernel, which propagates it).
template <int kBits>
bool wo_vnni_prepare(const at::Tensor& x, int64_t k, int64_t groups, WoVnniArgs& a, WoVnniScratch& s) {
  using G = VnniGeometry<kBits>;
  const int64_t m_rows = x.size(0), ld = x.stride(0), nb = a.nblocks, chunk_bytes = G::kParts * 64;
  s.xb.assign(static_cast<size_t>(m_rows * nb * chunk_bytes), 0);
  s.corr.assign(static_cast<size_t>(m_rows * nb * 16), 0);
  s.step.assign(static_cast<size_t>(m_rows), 1.f);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const bool avx2 = !use_vnni();  // int4 only (wo_vnni_applies), x from a zero-padded fp32 row
  thread_local std::vector<float> xf;  // fp32 rows: fp16 x, and every x on AVX2
  if (avx2 || !bf16) xf.assign(static_cast<size_t>(nb * G::kCols), 0.f);
  for (int64_t m = 0; m < m_rows; ++m) {
    const uint16_t* row = bits + m * ld;
    float amax = 0.f;
    if (bf16) {
      amax = avx2 ? bf16_row_widen_avx2(row, k, xf.data()) : bf16_row_amax(row, k);
    } else {
      const c10::Half* h = reinterpret_cast<const c10::Half*>(row);
      for (int64_t j = 0; j < k; ++j) {
        xf[j] = static_cast<float>(h[j]);
        amax = std::max(amax, std::fabs(xf[j]));
      }
    }
    if (!std::isfinite(amax)) return false;
    if (amax == 0.f) continue;  // x^ = 0: the buffers' zeros
    int e = 0;
    std::frexp(amax / static_cast<float>(kX16Max), &e);  // amax / kX16Max <= 2^e < 2 * amax / kX16Max
    e = std::max(e, -126);
    s.step[m] = std::ldexp(1.f, e);
    int8_t* xb = s.xb.data() + m * nb * chunk_bytes;
    int32_t* corr = s.corr.data() + m * nb * 16;
    const float inv_step = std::ldexp(1.f, -e);
    if (avx2) wo_fixed_fill_avx2(xf.data(), 2 * nb, inv_step, reinterpret_cast<int16_t*>(xb), corr);
    else if (bf16) wo_vnni_fill_bf16<kBits>(row, k, inv_step, xb, corr);
    else wo_vnni_fill_row<kBits>(xf.data(), k, inv_step, xb, corr);
  }
  s.lane_group.assign(static_cast<size_t>(nb * 16), 0);
  s.first_group.assign(static_cast<size_t>(nb), 0);
  const int64_t gs = k / groups;
  // (the AVX2 kernel of whole 64-column halves, wo_fixed_whole, counts groups itself: no lookup unless zero points
  // need group sums)
  a.group_halves = groups > 1 && gs % 64 == 0 ? gs / 64 : 0;
  const bool lookup = groups > 1 && !(avx2 && a.group_halves > 0 && a.zero == nullptr);
  for (int64_t b = 0, g = 0; b < nb && lookup; ++b) {  // group of column c: a counter (no divisions per call)
    for (int64_t l = 0; l < 16; ++l) {
      while (g + 1 < groups && (g + 1) * gs <= b * G::kCols + G::kLaneCols * l) ++g;
      if (l == 0) s.first_group[b] = g;
      s.lane_group[b * 16 + l] = static_cast<int32_t>(g - s.first_group[b]);
    }
  }
  if (avx2 && a.zero != nullptr) {  // the zero term's sums of x^ per group, from the lanes' corrections -8 sum(x^)
    s.group_sum.assign(static_cast<size_t>(m_rows * groups), 0.f);
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t l = 0; l < nb * 16; ++l) {
        const int64_t g = groups > 1 ? s.first_group[l / 16] + s.lane_group[l] : 0;
        s.group_sum[m * groups + g] += static_cast<float>(s.corr[m * nb * 16 + l] / -8);
      }
    a.group_sum = s.group_sum.data();
  }
  a.xb = s.xb.data();
  a.corr = s.corr.data();
  a.step = s.step.data();
  a.groups = groups;
  a.lane_group = s.lane_group.data();
  a.first_group = s.first_group.data();
  return true;
}

// acc[m * R + r] = sum_g s[n + r, g] * (x_g . q_g) for weight rows n .. n + R - 1 and x rows m0 .. m0 + MB - 1.
template <int kBits, int R, int MB, bool kGrouped>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void wo_vnni_rows(const WoVnniArgs& a, int64_t n,
                                                                                  int64_t m0, float* acc) {
  using G = VnniGeometry<kBits>;
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* w = a.w + n * a.ldw;
  __m512 y[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nblocks; ++b) {
    __m512i xv[MB][G::kParts], c[MB];
    for (int m = 0; m < MB; ++m) {
      const int8_t* xb = a.xb + ((m0 + m) * a.nblocks + b) * G::kParts * 64;
      for (int i = 0; i < G::kParts; ++i) xv[m][i] = _mm512_loadu_si512(xb + 64 * i);
      c[m] = _mm512_loadu_si512(a.corr + ((m0 + m) * a.nblocks + b) * 16);
    }
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
      __m512 s = _mm512_setzero_ps();
      if constexpr (kGrouped)
        s = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(have, a.scale + (n + r) * a.groups + a.first_group[b]));
      __m512i u0 = v, u1 = v;  // int4: the even / odd columns' nibbles; int8: u = q + 128 (masked tail bytes: 0)
      if constexpr (kBits == 4) {
        u0 = _mm512_and_si512(v, nib);
        u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      } else {
        u0 = _mm512_xor_si512(v, flip);  // (a masked tail's bytes meet x^ = 0 padding)
      }
      for (int m = 0; m < MB; ++m) {
        __m512i hi, lo;
        if constexpr (kBits == 4) {
          hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, xv[m][0]), u1, xv[m][1]);
          lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c[m], u0, xv[m][2]), u1, xv[m][3]);
        } else {
          hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, xv[m][0]);
          lo = _mm512_dpbusd_epi32(c[m], u0, xv[m][1]);
        }
        const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
        y[r][m] = kGrouped ? _mm512_fmadd_ps(t, s, y[r][m]) : _mm512_add_ps(y[r][m], t);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      const float sum = _mm512_reduce_add_ps(y[r][m]) * a.step[m0 + m];
      acc[m * R + r] = kGrouped ? sum : sum * a.scale[n + r];
    }
}

template <int kBits, int R>
WoVnniFn wo_vnni_fn(bool grouped, int64_t mb) {
  if (mb == 1) return grouped ? wo_vnni_rows<kBits, R, 1, true> : wo_vnni_rows<kBits, R, 1, false>;
  return grouped ? wo_vnni_rows<kBits, R, 2, true> : wo_vnni_rows<kBits, R, 2, false>;
}

// acc [mb, rows] for weight rows [n, n + rows) and x rows [m0, m0 + mb) (mb <= kVnniMaxM).
constexpr int64_t kVnniMaxM = 2;
void wo_vnni_block(const WoVnniArgs& a, bool int4, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  if (!use_vnni()) return wo_fixed_block_avx2(a, n, rows, m0, mb, acc);  // int4 only (wo_vnni_applies)
  const bool grouped = a.groups > 1;
  if (rows == kRowBlock) {
    (int4 ? wo_vnni_fn<4, kRowBlock>(grouped, mb) : wo_vnni_fn<8, kRowBlock>(grouped, mb))(a, n, m0, acc);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // tail rows one at a time
    float one[kVnniMaxM];
    (int4 ? wo_vnni_fn<4, 1>(grouped, mb) : wo_vnni_fn<8, 1>(grouped, mb))(a, n + r, m0, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}

#include "quant_wo_fixed_avx2.h"
