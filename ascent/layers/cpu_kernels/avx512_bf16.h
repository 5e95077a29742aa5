// AVX512 bf16 row kernels of fused_cpu.cpp (RMSNorm, SiLU-and-mul, NeoX RoPE, paged decode attention), selected
// at run time by has_avx512(); the scalar loops in fused_cpu.cpp stay the fallback. Included by fused_cpu.cpp inside
// its anonymous namespace, after <immintrin.h>, <vector> and the torch headers.
#pragma once

// ---- AVX512 paths for bf16 (selected at run time; the scalar loops stay the fallback for other CPUs/dtypes) ----
#define ASCENT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
using bf16 = c10::BFloat16;

// The dispatch lambdas are not templates, so their bf16 branches are compiled for every dtype (and only run for
// bf16): these casts keep those branches well-typed.
template <typename T> inline const bf16* as_bf16(const T* p) { return reinterpret_cast<const bf16*>(p); }
template <typename T> inline bf16* as_bf16(T* p) { return reinterpret_cast<bf16*>(p); }

// The best instruction set the fused kernels may use (tests: set_isa_limit): 0 scalar, 1 AVX2+FMA, 2 AVX512 (and
// AMX attention); a level the CPU lacks falls through to the next one below.
int g_fused_isa = 2;

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return g_fused_isa >= 2 && ok;
}

ASCENT_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

ASCENT_AVX512 inline __m512 bf16_load(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// fp32 -> bf16 bits with c10::BFloat16's rounding: nearest-even, NaN -> 0x7FC0.
ASCENT_AVX512 inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

ASCENT_AVX512 inline void bf16_store(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, bf16_bits(v)); }

// fp32 bits rounded as bf16_bits, kept in the high half (low half zero): the fp32 value of the bf16 result.
ASCENT_AVX512 inline __m512i bf16_round_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

// Half h of 32 bf16 values x as fp32: h = 0 the even positions (a 32-bit lane's low bf16), 1 the odd ones.
ASCENT_AVX512 inline __m512 bf16_half(__m512i x, int h) {
  return _mm512_castsi512_ps(h == 0 ? _mm512_slli_epi32(x, 16)
                                    : _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Stores 32 bf16 values given as their even / odd halves in fp32 (each rounded as bf16_bits).
ASCENT_AVX512 inline void bf16_store32(bf16* p, __m512 even, __m512 odd) {
  _mm512_storeu_si512(p, _mm512_or_si512(_mm512_srli_epi32(bf16_round_bits(even), 16), bf16_round_bits(odd)));
}

// v rounded to bf16, as fp32 (the bits of widening bf16_bits(v), in fewer ops).
ASCENT_AVX512 inline __m512 round_to_bf16(__m512 v) { return _mm512_castsi512_ps(bf16_round_bits(v)); }

// y = rms_norm(s) * w over one bf16 row (sum of squares in 16 fp32 lanes, then (s * r) * w as the scalar path).
ASCENT_AVX512 void rms_norm_row_avx512(const bf16* s, const bf16* w, bf16* y, int64_t h, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < h; j += 16) {
    const __m512 v = bf16_load(s + j, tail_mask(h - j));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps));
  int64_t j = 0;
  for (; j + 32 <= h; j += 32) {  // as even / odd halves (bit-identical; fewer ops to widen and narrow)
    const __m512i sv = _mm512_loadu_si512(s + j), wv = _mm512_loadu_si512(w + j);
    bf16_store32(y + j, _mm512_mul_ps(_mm512_mul_ps(bf16_half(sv, 0), r), bf16_half(wv, 0)),
                 _mm512_mul_ps(_mm512_mul_ps(bf16_half(sv, 1), r), bf16_half(wv, 1)));
  }
  for (; j < h; j += 16) {
    const __mmask16 m = tail_mask(h - j);
    bf16_store(y + j, _mm512_mul_ps(_mm512_mul_ps(bf16_load(s + j, m), r), bf16_load(w + j, m)), m);
  }
}

// srow = round(x + res); y = rms_norm(srow) * w.
ASCENT_AVX512 void add_rms_norm_row_avx512(const bf16* x, const bf16* res, const bf16* w, bf16* srow, bf16* y,
                                           int64_t h, float eps) {
  int64_t j = 0;
  for (; j + 32 <= h; j += 32) {
    const __m512i xv = _mm512_loadu_si512(x + j), rv = _mm512_loadu_si512(res + j);
    bf16_store32(srow + j, _mm512_add_ps(bf16_half(xv, 0), bf16_half(rv, 0)),
                 _mm512_add_ps(bf16_half(xv, 1), bf16_half(rv, 1)));
  }
  for (; j < h; j += 16) {
    const __mmask16 m = tail_mask(h - j);
    bf16_store(srow + j, _mm512_add_ps(bf16_load(x + j, m), bf16_load(res + j, m)), m);
  }
  rms_norm_row_avx512(srow, w, y, h, eps);
}

#define ASCENT_AVX512_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// 2^x on 16 lanes, x clamped to [-126, 127] (a NaN x reads as -126): x = n + f (n = round(x), |f| <= 1/2), 2^f by
// its degree-6 Taylor polynomial in FMAs (relative error < 2e-7), scaled by 2^n with VSCALEFPS. Shared by the SiLU
// below and the AMX prefill attention's softmax (amx_prefill_attention.h).
ASCENT_AVX512_FMA inline __m512 exp2_512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// exp(-a) = 2^(-a log2(e)) (a NaN a gives 2^-126; silu_bf16 multiplies by a, which keeps the NaN).
ASCENT_AVX512_FMA inline __m512 exp_neg512(__m512 a) {
  return exp2_512(_mm512_mul_ps(a, _mm512_set1_ps(-1.44269504088896341f)));
}

// silu(a) = a / (1 + exp(-a)) rounded to bf16, as fp32. The quotient is a times 1 / (1 + e) from VRCP14PS and one
// Newton step (relative error ~1e-7, as the exp): VDIVPS costs 16 cycles per vector here, more than the rest.
ASCENT_AVX512_FMA inline __m512 silu_bf16(__m512 a) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 den = _mm512_add_ps(one, exp_neg512(a));
  const __m512 r0 = _mm512_rcp14_ps(den);
  const __m512 r = _mm512_fmadd_ps(r0, _mm512_fnmadd_ps(den, r0, one), r0);
  return round_to_bf16(_mm512_mul_ps(a, r));
}

// out[j] = round(round(silu(g[j])) * g[d + j]) for one row (F.silu(a) * b in bf16). 32 values at a time as their even
// and odd halves (one op per 16 values to widen, bf16_round_bits and one merge to narrow, instead of three and eight):
// 0.74-0.83x the time at 1-2048 rows, bit-identical; the last d % 32 values 16 at a time.
ASCENT_AVX512_FMA void silu_and_mul_row_avx512(const bf16* g, bf16* out, int64_t d) {
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    const __m512i gate = _mm512_loadu_si512(g + j), up = _mm512_loadu_si512(g + d + j);
    bf16_store32(out + j, _mm512_mul_ps(silu_bf16(bf16_half(gate, 0)), bf16_half(up, 0)),
                 _mm512_mul_ps(silu_bf16(bf16_half(gate, 1)), bf16_half(up, 1)));
  }
  for (; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    bf16_store(out + j, _mm512_mul_ps(silu_bf16(bf16_load(g + j, m)), bf16_load(g + d + j, m)), m);
  }
}

// NeoX rotation of one bf16 head in place: v[p], v[p + half] with every product and sum rounded as the scalar path;
// 32 positions at a time as even / odd halves (bit-identical), the last half % 32 16 at a time.
ASCENT_AVX512 void rotary_neox_head_avx512(bf16* v, const bf16* cosr, const bf16* sinr, int64_t half) {
  int64_t p = 0;
  for (; p + 32 <= half; p += 32) {
    const __m512i a = _mm512_loadu_si512(v + p), b = _mm512_loadu_si512(v + half + p);
    const __m512i cos_a = _mm512_loadu_si512(cosr + p), cos_b = _mm512_loadu_si512(cosr + half + p);
    const __m512i sin_a = _mm512_loadu_si512(sinr + p), sin_b = _mm512_loadu_si512(sinr + half + p);
    __m512 out_a[2], out_b[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 va = bf16_half(a, h), vb = bf16_half(b, h);
      out_a[h] = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(va, bf16_half(cos_a, h))),
                               round_to_bf16(_mm512_mul_ps(vb, bf16_half(sin_a, h))));
      out_b[h] = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(vb, bf16_half(cos_b, h))),
                               round_to_bf16(_mm512_mul_ps(va, bf16_half(sin_b, h))));
    }
    bf16_store32(v + p, out_a[0], out_a[1]);
    bf16_store32(v + half + p, out_b[0], out_b[1]);
  }
  for (; p < half; p += 16) {
    const __mmask16 m = tail_mask(half - p);
    const __m512 va = bf16_load(v + p, m), vb = bf16_load(v + half + p, m);
    const __m512 ca = round_to_bf16(_mm512_mul_ps(va, bf16_load(cosr + p, m)));
    const __m512 cb = round_to_bf16(_mm512_mul_ps(vb, bf16_load(cosr + half + p, m)));
    const __m512 sa = round_to_bf16(_mm512_mul_ps(vb, bf16_load(sinr + p, m)));
    const __m512 sb = round_to_bf16(_mm512_mul_ps(va, bf16_load(sinr + half + p, m)));
    bf16_store(v + p, _mm512_add_ps(ca, sa), m);
    bf16_store(v + half + p, _mm512_add_ps(cb, sb), m);
  }
}

// In place: each row sc[g * n .. + n) becomes exp(row - max) = 2^(row * log2(e) - max * log2(e)) (exp2_512's FMA
// polynomial: 0.97-0.98x the grouped decode attention's time of the unfused exp_approx polynomial it replaced);
// mx[g] / total[g] take the row's max and the fp32 sum of its exps (softmax_rows before the normalisation; a chunk of
// a split context keeps them).
ASCENT_AVX512_FMA void exp_rows(float* sc, int64_t rows, int64_t n, float* mx, float* total) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = sc + g * n;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16)
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - j), sg + j));
    mx[g] = _mm512_reduce_max_ps(vmax);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 vmx = _mm512_set1_ps(mx[g] * 1.44269504088896341f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail_mask(n - j);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, sg + j), log2e, vmx);
      const __m512 e = _mm512_maskz_mov_ps(m, exp2_512(x));
      _mm512_mask_storeu_ps(sg + j, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
}

// In place: each row sc[g * n .. + n) becomes softmax(row) (exp_rows, fp32 sum).
ASCENT_AVX512_FMA void softmax_rows(float* sc, int64_t rows, int64_t n) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = sc + g * n;
    float mx, total;
    exp_rows(sg, 1, n, &mx, &total);
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail_mask(n - j);
      _mm512_mask_storeu_ps(sg + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sg + j), inv));
    }
  }
}

// attend_kv_head for bf16 with C = ceil(d / 16) vector chunks (d <= 16 * C): per query head the q row and the P.V
// accumulators live in registers; K/V rows are re-read per head of the group from L1. Softmax as the scalar path.
template <int C>
ASCENT_AVX512 void attend_kv_head_avx512(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                         int64_t start, int64_t len, int64_t group, int64_t d, int64_t row_w,
                                         float scale, bf16* out, std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.resize(static_cast<size_t>(n));
  float* sg = buf.data();  // scores, then probabilities, of one query head
  __mmask16 mask[C];
  for (int c = 0; c < C; ++c) mask[c] = tail_mask(d - c * 16);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[C], acc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      qv[c] = _mm512_mul_ps(bf16_load(q + g * d + c * 16, mask[c]), vscale);
      acc[c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
      const bf16* kr = kbase + slots[start + j] * row_w;
      __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) dot = _mm512_fmadd_ps(qv[c], bf16_load(kr + c * 16, mask[c]), dot);
      sg[j] = _mm512_reduce_add_ps(dot);
    }
    softmax_rows(sg, 1, n);
    for (int64_t j = 0; j < n; ++j) {
      const bf16* vr = vbase + slots[start + j] * row_w;
      const __m512 pj = _mm512_set1_ps(sg[j]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(pj, bf16_load(vr + c * 16, mask[c]), acc[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) bf16_store(out + g * d + c * 16, acc[c], mask[c]);
  }
}

using AttendFn = void (*)(const bf16*, const bf16*, const bf16*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float, bf16*, std::vector<float>&);

// The register-resident variant for head dims up to 256 (nullptr beyond: the scalar path is used).
AttendFn attend_avx512_for(int64_t d) {
  switch ((d + 15) / 16) {
    case 1: return attend_kv_head_avx512<1>;
    case 2: return attend_kv_head_avx512<2>;
    case 3: return attend_kv_head_avx512<3>;
    case 4: return attend_kv_head_avx512<4>;
    case 5: case 6: return attend_kv_head_avx512<6>;
    case 7: case 8: return attend_kv_head_avx512<8>;
    case 9: case 10: case 11: case 12: return attend_kv_head_avx512<12>;
    case 13: case 14: case 15: case 16: return attend_kv_head_avx512<16>;
    default: return nullptr;
  }
}

