// Weight-only (W4A16 / W8A16) decode kernels on a row-interleaved weight layout for AVX512-VNNI ("NV" layout);
// included by quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after quant_wo_vnni.h (it
// reuses bf16_row_amax and split16, and x's 16-bit fixed point: x^ = nearbyint(x / 2^e) = 256 hi + lo).
//
// Layout: rows in super-blocks of 64 (N padded with zero rows), K in steps of kStepCols columns (K padded with
// zeros); one step of a super-block is 256 bytes = four 64-byte vectors, vector b's dword lane l holding row
// 64 sb + 16 b + l: int8: byte j = u(row, 4 s + j), u = q + 128; int4: byte j = u(row, 8 s + j) | u(row, 8 s + 4 + j)
// << 4, u = q + 8. Memory order [N/64][K steps][4][64]: each super-block is one contiguous stream.
// A step is then (int4: after one AND and one shift-AND) one VPDPBUSD per vector and x part, with x's four (int8)
// or 2 x 4 (int4) bytes broadcast: 16 output rows per instruction, no horizontal reductions, against the row
// layout's (quant_wo_vnni.h) per-chunk epilogue and per-row reduction. Measured: see quantization/wo_nv.py.
// Rows that are no 16-bit fixed-point material (fp32 x, NaN / inf, a CPU without VNNI) take an exact scalar path.
// Per span of columns (one scale group, or kNvFlushCols of a per-channel weight) the int32 sums hi / lo become
// t = 256 hi + lo - O sum(x^ over the span) = sum q x^ (modular int32 arithmetic; |t| < 2^31 by the span bounds),
// then y += s t in fp32 (per-channel: y += t, scaled once at the end), y = 2^e y - sum_g z s sum(x_g) (+ bias).
#pragma once

constexpr int64_t kNvRows = 64;
constexpr int64_t kNvStepBytes = 256;
// Software prefetch distance (into L2) in the super-block stream. Measured on the Zen 4 (2 threads, the 120 linears
// of a SmolLM2 decode step, interleaved minima): none / 16 KiB / 8 KiB + an L1 hint 512 B ahead / 32 KiB + 2 KiB:
// W4A16 4.13 / 3.53 / 4.37 / 4.67 ms; W8A16 the same within noise (5.4-5.8 ms). Prefetching each chunk's first
// 8-16 KiB up front gained nothing either.
constexpr int64_t kNvPrefetchBytes = 16384;

template <int kBits>
struct NvGeometry {
  static constexpr int64_t kStepCols = kBits == 4 ? 8 : 4;
  static constexpr int32_t kOffset = kBits == 4 ? 8 : 128;
  // per-channel flush span: |t| <= 128 * 32767 * 256 < 2^31 (int8), 8 * 32767 * 2048 < 2^31 (int4)
  static constexpr int64_t kFlushCols = kBits == 4 ? 2048 : 256;
};

int64_t nv_padded(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// q int8 [N, K] -> uint8 [Npad / 64, K steps, 4, 64] (file header); offset -1: the weight-only offset of `bits`
// (unsigned bytes), 0: signed weight bytes (the W8A8 kernels, bits 8).
at::Tensor wo_nv_pack(const at::Tensor& q, int64_t bits, int64_t offset) {
  TORCH_CHECK(bits == 4 || bits == 8, "wo_nv_pack: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(offset == -1 || (offset == 0 && bits == 8), "wo_nv_pack: offset must be -1, or 0 with bits 8");
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.dim() == 2 && q.scalar_type() == at::kChar,
              "wo_nv_pack: q must be a contiguous int8 [N, K] CPU tensor");
  const int64_t n = q.size(0), k = q.size(1), step_cols = bits == 4 ? 8 : 4;
  const int64_t npad = nv_padded(n, kNvRows), steps = nv_padded(k, step_cols) / step_cols;
  auto out = at::zeros({npad / kNvRows, steps, 4, 64}, q.options().dtype(at::kByte));
  const int8_t* src = q.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int32_t add = offset == 0 ? 0 : (bits == 4 ? 8 : 128);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t sb = r / kNvRows, lane = r % kNvRows;  // vector lane / 16, dword lane % 16
    for (int64_t c = 0; c < k; ++c) {
      const int32_t v = src[r * k + c];
      TORCH_CHECK(bits == 8 || (v >= -8 && v <= 7), "wo_nv_pack: int4 value ", v, " outside [-8, 7]");
      const int64_t s = c / step_cols, within = c % step_cols;
      uint8_t& byte = dst[((sb * steps + s) * 4 + lane / 16) * 64 + (lane % 16) * 4 + within % 4];
      byte |= static_cast<uint8_t>((v + add) << (bits == 4 && within >= 4 ? 4 : 0));
    }
  }
  return out;
}

// Per-call operands of the NV kernels.
struct WoNvArgs {
  const uint8_t* w;       // packed weight (file header)
  int64_t steps;          // K steps per super-block
  const int8_t* xhi;      // [M][ldx] x^'s hi bytes (zero padded)
  const int8_t* xlo;      // [M][ldx] x^'s lo bytes
  int64_t ldx;
  int64_t nspans;
  const int64_t* span_step;  // [nspans + 1] first step of each span
  const int32_t* corr;       // [M][nspans] -O * sum of x^ over the span
  const float* zterm;        // [M][nspans] sum of x over the span / 2^e (zero points only)
  const float* step;         // [M] 2^e
  const void* scale;         // [Npad / 64][G][64] (G = nspans grouped, else 1), fp32 or bf16 (scale_bf16)
  bool scale_bf16;
  const float* zs;           // [Npad / 64][G][64] zero point * scale, or nullptr
  bool grouped;
};

struct WoNvScratch {
  std::vector<int8_t> xhi, xlo;
  std::vector<int32_t> xq, corr;
  std::vector<float> zterm, step, xf;
  std::vector<int64_t> span_step;
};

// 16 scales at s (fp32, or bf16 widened exactly).
template <bool kBf16>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 nv_scales(const void* s,
                                                                                          int64_t off) {
  if constexpr (!kBf16) return _mm512_loadu_ps(static_cast<const float*>(s) + off);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s) + off));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rows 16 v0 .. 16 (v0 + NV) - 1 (vectors v0 .. v0 + NV - 1; NV = 4: all 64, NV = 2: a half) of super-block sb for x
// rows m0 .. m0 + MB - 1 -> out[m][16 v0 ..] (out[m][64], fp32, before bias).
// (kBf16: the scales are bf16; compile-time, as a runtime choice there cost the two-row kernels half their speed)
template <int kBits, int MB, bool kBf16, int NV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void wo_nv_vectors(const WoNvArgs& a, int64_t sb,
                                                                                   int64_t v0, int64_t m0, float* out) {
  using G = NvGeometry<kBits>;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const uint8_t* w = a.w + sb * a.steps * kNvStepBytes + 64 * v0;
  const int64_t gs = a.grouped ? a.nspans : 1;
  const int64_t scale0 = sb * gs * kNvRows + 16 * v0;
  const float* zs = a.zs ? a.zs + sb * gs * kNvRows + 16 * v0 : nullptr;
  out += 16 * v0;
  __m512 y[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NV; ++b) y[m][b] = _mm512_setzero_ps();
  for (int64_t sp = 0; sp < a.nspans; ++sp) {
    __m512i hi[MB][NV], lo[MB][NV];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NV; ++b) hi[m][b] = lo[m][b] = _mm512_setzero_si512();
    for (int64_t s = a.span_step[sp]; s < a.span_step[sp + 1]; ++s) {
      const uint8_t* p = w + s * kNvStepBytes;
      for (int b = 0; b < NV; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(p + kNvPrefetchBytes + 64 * b), _MM_HINT_T2);
      __m512i v[NV];
      for (int b = 0; b < NV; ++b) v[b] = _mm512_loadu_si512(p + 64 * b);
      for (int m = 0; m < MB; ++m) {
        const int64_t xo = (m0 + m) * a.ldx + s * G::kStepCols;
        int32_t h0, l0;
        std::memcpy(&h0, a.xhi + xo, 4);
        std::memcpy(&l0, a.xlo + xo, 4);
        const __m512i xh0 = _mm512_set1_epi32(h0), xl0 = _mm512_set1_epi32(l0);
        if constexpr (kBits == 4) {
          int32_t h1, l1;
          std::memcpy(&h1, a.xhi + xo + 4, 4);
          std::memcpy(&l1, a.xlo + xo + 4, 4);
          const __m512i xh1 = _mm512_set1_epi32(h1), xl1 = _mm512_set1_epi32(l1);
          for (int b = 0; b < NV; ++b) {
            const __m512i u0 = _mm512_and_si512(v[b], nib);
            const __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(v[b], 4), nib);
            hi[m][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi[m][b], u0, xh0), u1, xh1);
            lo[m][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[m][b], u0, xl0), u1, xl1);
          }
        } else {
          for (int b = 0; b < NV; ++b) {
            hi[m][b] = _mm512_dpbusd_epi32(hi[m][b], v[b], xh0);
            lo[m][b] = _mm512_dpbusd_epi32(lo[m][b], v[b], xl0);
          }
        }
      }
    }
    const int64_t g = a.grouped ? sp : 0;
    __m512 sv[NV];  // the span's scales, shared by the x rows
    for (int b = 0; b < NV; ++b)
      sv[b] = a.grouped ? nv_scales<kBf16>(a.scale, scale0 + g * kNvRows + 16 * b) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m512i corr = _mm512_set1_epi32(a.corr[(m0 + m) * a.nspans + sp]);
      const __m512 zt = _mm512_set1_ps(zs ? a.zterm[(m0 + m) * a.nspans + sp] : 0.f);
      for (int b = 0; b < NV; ++b) {
        const __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[m][b], 8), lo[m][b]), corr);
        const __m512 f = _mm512_cvtepi32_ps(t);
        y[m][b] = a.grouped ? _mm512_fmadd_ps(f, sv[b], y[m][b]) : _mm512_add_ps(y[m][b], f);
        if (zs && a.grouped) y[m][b] = _mm512_fnmadd_ps(_mm512_loadu_ps(zs + g * kNvRows + 16 * b), zt, y[m][b]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    const __m512 st = _mm512_set1_ps(a.step[m0 + m]);
    float zsum = 0.f;  // per-channel zero point: sum of x / 2^e over all spans
    if (zs && !a.grouped)
      for (int64_t sp = 0; sp < a.nspans; ++sp) zsum += a.zterm[(m0 + m) * a.nspans + sp];
    for (int b = 0; b < NV; ++b) {
      __m512 r = y[m][b];
      if (!a.grouped) {
        r = _mm512_mul_ps(r, nv_scales<kBf16>(a.scale, scale0 + 16 * b));
        if (zs) r = _mm512_fnmadd_ps(_mm512_loadu_ps(zs + 16 * b), _mm512_set1_ps(zsum), r);
      }
      _mm512_storeu_ps(out + m * kNvRows + 16 * b, _mm512_mul_ps(r, st));
    }
  }
}

// 16 * vectors fp32 values (64 by default) -> bf16, rounded to nearest even as c10::BFloat16 (a vector holding a NaN
// goes element-wise).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void store_bf16_rows(const float* y, uint16_t* dst,
                                                                          int vectors = 4) {
  for (int b = 0; b < vectors; ++b) {
    const __m512 v = _mm512_loadu_ps(y + 16 * b);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
      for (int i = 0; i < 16; ++i) dst[16 * b + i] = c10::BFloat16(y[16 * b + i]).x;
      continue;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * b),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
}

// body(sb, v0, vectors) over the halves of super-blocks [0, n) (vectors 0-1 and 2-3, 32 rows each; a whole
// super-block is one call with v0 = 0, vectors = 4) in contiguous runs: 2 per thread, handed out dynamically, when
// they split the halves evenly, else one per thread. Each thread streams its rows in order, and an odd count splits
// its middle super-block (9 super-blocks over 2 threads: 4.5 each, where whole super-blocks gave 5 and 4; handing out
// single super-blocks interleaved the two threads' streams: SmolLM2's 120 W4A16 decode linears took 1.21x the time).
template <typename Body>
void parallel_halves(int64_t n, const Body& body) {
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1), halves = 2 * n;
  const int64_t chunks = std::min(halves, halves % (2 * threads) == 0 ? 2 * threads : threads);
  std::atomic<int64_t> next{0};
  ascent_par::parallel_for(0, std::max<int64_t>(std::min(threads, chunks), 1), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      int64_t h = c * halves / chunks;
      const int64_t end = (c + 1) * halves / chunks;
      if (h % 2 == 1 && h < end) body(h++ / 2, 2, 2);
      for (; h + 2 <= end; h += 2) body(h / 2, 0, 4);
      if (h < end) body(h / 2, 0, 2);
    }
  });
}

// x^ of a row's fp32 values (16 columns per step; buffers padded by 16): hi / lo bytes and x^ itself.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void wo_nv_split_row(const float* xf, int64_t k, float inv_step,
                                                                          int8_t* hi, int8_t* lo, int32_t* xq) {
  const __m512 inv = _mm512_set1_ps(inv_step);
  for (int64_t j = 0; j < k; j += 16) {
    const __mmask16 mask = k - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - j)) - 1);
    _mm512_storeu_si512(xq + j, split16(_mm512_maskz_loadu_ps(mask, xf + j), inv, hi + j, lo + j));
  }
}

// One x row as fp32 (exact widening of bf16 / fp16; fp32 copied) and its max |x| (NaN / inf: non-finite).
float wo_nv_row_to_float(const at::Tensor& x, int64_t m, int64_t k, float* xf) {
  const int64_t ld = x.stride(0);
  if (x.scalar_type() == at::kBFloat16 && use_avx512()) {  // the decode hot path: vectorised
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * ld;
    bf16_row_to_float(row, k, xf);
    return bf16_row_amax(row, k);
  }
  float amax = 0.f;
  bool nan = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "wo_nv_row", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>() + m * ld;
    for (int64_t j = 0; j < k; ++j) {
      xf[j] = static_cast<float>(p[j]);
      nan = nan || std::isnan(xf[j]);
      amax = std::max(amax, std::fabs(xf[j]));
    }
  });
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// x rows -> the kernels' x operands. Rows that are not 16-bit fixed-point material (fp32 x, a NaN / inf) are listed
// in `exact_rows` for the scalar path, as is every row without AVX512-VNNI.
template <int kBits>
void wo_nv_prepare(const at::Tensor& x, int64_t k, int64_t groups, bool zero, WoNvArgs& a, WoNvScratch& s,
                   std::vector<int64_t>& exact_rows) {
  using G = NvGeometry<kBits>;
  const int64_t m_rows = x.size(0), kpad = nv_padded(k, G::kStepCols);
  const int64_t span_cols = groups > 1 ? k / groups : G::kFlushCols;
  s.span_step.clear();
  for (int64_t c = 0; c < kpad; c += span_cols) s.span_step.push_back(c / G::kStepCols);
  s.span_step.push_back(kpad / G::kStepCols);
  const int64_t nspans = static_cast<int64_t>(s.span_step.size()) - 1, ldx = kpad + 16;
  s.xhi.assign(static_cast<size_t>(m_rows * ldx), 0);
  s.xlo.assign(static_cast<size_t>(m_rows * ldx), 0);
  s.xq.assign(static_cast<size_t>(ldx), 0);
  s.corr.assign(static_cast<size_t>(m_rows * nspans), 0);
  s.zterm.assign(static_cast<size_t>(m_rows * nspans), 0.f);
  s.step.assign(static_cast<size_t>(m_rows), 1.f);
  s.xf.assign(static_cast<size_t>(ldx), 0.f);
  const bool fixed_point = use_vnni() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
  for (int64_t m = 0; m < m_rows; ++m) {
    const float amax = wo_nv_row_to_float(x, m, k, s.xf.data());
    if (!fixed_point || !std::isfinite(amax)) {
      exact_rows.push_back(m);
      continue;
    }
    if (amax == 0.f) continue;  // x^ = 0: zero buffers
    int e = 0;
    std::frexp(amax / static_cast<float>(kX16Max), &e);  // amax / kX16Max <= 2^e < 2 amax / kX16Max
    e = std::max(e, -126);
    s.step[m] = std::ldexp(1.f, e);
    wo_nv_split_row(s.xf.data(), k, std::ldexp(1.f, -e), s.xhi.data() + m * ldx, s.xlo.data() + m * ldx,
                    s.xq.data());
    for (int64_t sp = 0; sp < nspans; ++sp) {
      const int64_t c0 = s.span_step[sp] * G::kStepCols, c1 = std::min(k, s.span_step[sp + 1] * G::kStepCols);
      int32_t sum = 0;
      float fsum = 0.f;
      for (int64_t c = c0; c < c1; ++c) {
        sum += s.xq[c];
        if (zero) fsum += s.xf[c];
      }
      s.corr[m * nspans + sp] = -G::kOffset * sum;
      s.zterm[m * nspans + sp] = fsum / s.step[m];
    }
  }
  a.xhi = s.xhi.data();
  a.xlo = s.xlo.data();
  a.ldx = ldx;
  a.nspans = nspans;
  a.span_step = s.span_step.data();
  a.corr = s.corr.data();
  a.zterm = s.zterm.data();
  a.step = s.step.data();
  a.grouped = groups > 1;
}

// q of (row, column) from the packed layout.
int32_t wo_nv_q(const uint8_t* w, int64_t steps, int64_t bits, int64_t row, int64_t col) {
  const int64_t step_cols = bits == 4 ? 8 : 4, lane = row % kNvRows, within = col % step_cols;
  const uint8_t byte = w[(((row / kNvRows) * steps + col / step_cols) * 4 + lane / 16) * 64 + (lane % 16) * 4 +
                         within % 4];
  return bits == 4 ? ((within >= 4 ? byte >> 4 : byte) & 15) - 8 : static_cast<int32_t>(byte) - 128;
}

// Row m of y in fp32 from x's own values (IEEE propagation of NaN / inf; fp32 x): sum_k x (q - z) s.
void wo_nv_exact_row(const at::Tensor& x, int64_t m, int64_t k, const uint8_t* w, int64_t steps, int64_t bits,
                     int64_t n, const float* scale_nk, const float* zero_nk, int64_t groups, float* y) {
  std::vector<float> xf(static_cast<size_t>(k));
  wo_nv_row_to_float(x, m, k, xf.data());
  const int64_t gs = k / groups;
  for (int64_t r = 0; r < n; ++r) {
    float acc = 0.f;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t g = r * groups + c / gs;
      const float z = zero_nk ? zero_nk[g] : 0.f;
      acc += xf[c] * ((static_cast<float>(wo_nv_q(w, steps, bits, r, c)) - z) * scale_nk[g]);
    }
    y[r] = acc;
  }
}

// A weight-only projection on the packed layout with its operands checked once and held as raw pointers into tensors
// the caller keeps alive (the decode stack runs it every step, when those tensors' metadata is cold).
struct WoNvPlan {
  const uint8_t* packed = nullptr;
  int64_t bits = 8, n = 0, k = 0, steps = 0, groups = 1;
  const float* scale_nk = nullptr;  // [N, G]
  const float* zero_nk = nullptr;   // [N, G], nullptr without zero points
  const void* scale_nv = nullptr;   // [Npad / 64, G, 64], bf16 or fp32
  bool scale_bf16 = false;
  const float* zs_nv = nullptr;     // zero * scale on the layout, nullptr without zero points
  c10::optional<at::Tensor> bias;
};

// scale_nv / zs_nv fp32 [Npad / 64, G, 64] (zs = zero * scale), scale_nk / zero_nk fp32 [N, G] (the exact rows'
// operands).
WoNvPlan plan_wo_nv(const at::Tensor& packed, int64_t bits, int64_t n, int64_t k, const at::Tensor& scale_nk,
                    const c10::optional<at::Tensor>& zero_nk, const at::Tensor& scale_nv,
                    const c10::optional<at::Tensor>& zs_nv, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "wo_nv_linear: bits must be 4 or 8, got ", bits);
  const int64_t step_cols = bits == 4 ? 8 : 4, npad = nv_padded(n, kNvRows);
  const int64_t steps = nv_padded(k, step_cols) / step_cols;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == npad / kNvRows * steps * kNvStepBytes,
              "wo_nv_linear: packed must be a contiguous uint8 [", npad / kNvRows, ", ", steps, ", 4, 64]");
  const int64_t groups = check_scales(scale_nk, n, k);
  TORCH_CHECK(groups == 1 || (k / groups) % step_cols == 0, "wo_nv_linear: group size ", k / groups,
              " is not a multiple of ", step_cols, " columns");
  const bool has_zero = zero_nk.has_value() && zero_nk->defined();
  TORCH_CHECK(has_zero == (zs_nv.has_value() && zs_nv->defined()), "wo_nv_linear: zero_nk and zs_nv go together");
  if (has_zero) {
    check_vec(*zero_nk, "zero", n * groups, at::kFloat);
    check_vec(*zs_nv, "zs_nv", npad * groups, at::kFloat);
  }
  const bool scale_bf16 = scale_nv.scalar_type() == at::kBFloat16;
  check_vec(scale_nv, "scale_nv", npad * groups, scale_bf16 ? at::kBFloat16 : at::kFloat);
  float_bias(bias, n);  // checks it
  return {packed.data_ptr<uint8_t>(), bits, n, k, steps, groups, scale_nk.data_ptr<float>(),
          has_zero ? zero_nk->data_ptr<float>() : nullptr, scale_nv.data_ptr(), scale_bf16,
          has_zero ? zs_nv->data_ptr<float>() : nullptr, bias};
}

// y [M, N] = x @ ((q - zero) * scale)^T (+ bias) on the packed layout; x [M, plan.k].
at::Tensor run_wo_nv(const at::Tensor& x, const WoNvPlan& plan) {
  const int64_t bits = plan.bits, n = plan.n, k = plan.k, steps = plan.steps, groups = plan.groups;
  const int64_t npad = nv_padded(n, kNvRows);
  const bool has_zero = plan.zero_nk != nullptr;
  thread_local WoNvScratch scratch;  // the workers read it during this call only
  std::vector<int64_t> exact_rows;
  WoNvArgs a{plan.packed, steps, nullptr, nullptr, 0, 0, nullptr, nullptr, nullptr, nullptr,
             plan.scale_nv, plan.scale_bf16, plan.zs_nv, false};
  if (bits == 4) wo_nv_prepare<4>(x, k, groups, has_zero, a, scratch, exact_rows);
  else wo_nv_prepare<8>(x, k, groups, has_zero, a, scratch, exact_rows);
  const int64_t m_rows = x.size(0);
  std::vector<uint8_t> exact(static_cast<size_t>(m_rows), 0);
  for (int64_t m : exact_rows) exact[m] = 1;
  const std::vector<float> bv = float_bias(plan.bias, n);
  auto out = at::empty({m_rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const Store store{out.data_ptr(), out.scalar_type(), n};
  const int64_t nsb = npad / kNvRows;
  using Fn = void (*)(const WoNvArgs&, int64_t, int64_t, int64_t, float*);
  static const Fn kernels[16] = {  // [bits 8 / 4][fp32 / bf16 scales][1 / 2 x rows][half / whole super-block]
      wo_nv_vectors<8, 1, false, 2>, wo_nv_vectors<8, 1, false, 4>, wo_nv_vectors<8, 2, false, 2>,
      wo_nv_vectors<8, 2, false, 4>, wo_nv_vectors<8, 1, true, 2>,  wo_nv_vectors<8, 1, true, 4>,
      wo_nv_vectors<8, 2, true, 2>,  wo_nv_vectors<8, 2, true, 4>,  wo_nv_vectors<4, 1, false, 2>,
      wo_nv_vectors<4, 1, false, 4>, wo_nv_vectors<4, 2, false, 2>, wo_nv_vectors<4, 2, false, 4>,
      wo_nv_vectors<4, 1, true, 2>,  wo_nv_vectors<4, 1, true, 4>,  wo_nv_vectors<4, 2, true, 2>,
      wo_nv_vectors<4, 2, true, 4>};
  if (static_cast<int64_t>(exact_rows.size()) < m_rows) {
    parallel_halves(nsb, [&](int64_t sb, int64_t v0, int64_t vectors) {
      float acc[2 * kNvRows];
      const int64_t row0 = sb * kNvRows + 16 * v0, rows = std::min(16 * vectors, n - row0);
      if (rows <= 0) return;  // a half of padding rows
      for (int64_t m0 = 0; m0 < m_rows; m0 += 2) {
        const int64_t mb = std::min<int64_t>(2, m_rows - m0);
        kernels[(bits == 4 ? 8 : 0) + (a.scale_bf16 ? 4 : 0) + 2 * (mb - 1) + (vectors == 4 ? 1 : 0)](a, sb, v0, m0,
                                                                                                        acc);
        for (int64_t m = 0; m < mb; ++m) {
          if (exact[m0 + m]) continue;
          float* y = acc + m * kNvRows + 16 * v0;
          if (!bv.empty())
            for (int64_t r = 0; r < rows; ++r) y[r] += bv[row0 + r];
          if (out.scalar_type() == at::kBFloat16 && rows == 16 * vectors) {
            store_bf16_rows(y, static_cast<uint16_t*>(out.data_ptr()) + (m0 + m) * n + row0,
                            static_cast<int>(vectors));
          } else {
            for (int64_t r = 0; r < rows; ++r) store(m0 + m, row0 + r, y[r]);
          }
        }
      }
    });
  }
  std::vector<float> y(exact_rows.empty() ? 0 : static_cast<size_t>(n));
  for (int64_t m : exact_rows) {
    wo_nv_exact_row(x, m, k, a.w, steps, bits, n, plan.scale_nk, plan.zero_nk, groups, y.data());
    for (int64_t r = 0; r < n; ++r) store(m, r, y[r] + (bv.empty() ? 0.f : bv[r]));
  }
  return out;
}

// y [M, N] = x @ ((q - zero) * scale)^T (+ bias) on the packed layout (plan_wo_nv's operands); x [M, K].
at::Tensor wo_nv_linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t n, int64_t k,
                             const at::Tensor& scale_nk, const c10::optional<at::Tensor>& zero_nk,
                             const at::Tensor& scale_nv, const c10::optional<at::Tensor>& zs_nv,
                             const c10::optional<at::Tensor>& bias) {
  return run_wo_nv(x, plan_wo_nv(packed, bits, n, k, scale_nk, zero_nk, scale_nv, zs_nv, bias));
}
