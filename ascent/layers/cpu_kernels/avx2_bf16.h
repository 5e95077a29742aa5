// AVX2 + FMA bf16 row kernels of fused_cpu.cpp (RMSNorm, SiLU-and-mul, NeoX RoPE, paged decode attention) for CPUs
// without AVX512 (e.g. AMD Zen 1-3), selected at run time by has_avx2_fma() after the AVX512 ones; the scalar loops
// in fused_cpu.cpp stay the fallback. Each kernel does the AVX512 kernel's operations on 8 lanes, so it rounds where
// the scalar path rounds (reductions sum in another order). Row tails (< 8 elements) go through a zero-padded
// 8-element buffer (AVX2 has no masked 16-bit loads); chunks wholly past a row are zeros and are not stored.
// Included by fused_cpu.cpp inside its anonymous namespace, after avx512_bf16.h (bf16, AttendFn, g_fused_isa).
#pragma once

#define ASCENT_AVX2 __attribute__((target("avx2,fma")))

bool has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return g_fused_isa >= 1 && ok;
}

// 8 bf16 (the first `left` of them when left < 8, the rest 0) widened to fp32.
ASCENT_AVX2 inline __m256 bf16_load8(const bf16* p, int64_t left) {
  __m128i raw;
  if (left <= 0) return _mm256_setzero_ps();  // a chunk past the head dim of a padded C
  if (left >= 8) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, p, static_cast<size_t>(left) * sizeof(uint16_t));
    raw = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

#include "bf16_round_avx2.h"  // bf16_bits8, bf16_bits8_to_f32

ASCENT_AVX2 inline void bf16_store8(bf16* p, __m256 v, int64_t left) {
  if (left <= 0) return;
  const __m128i bits = bf16_bits8(v);
  if (left >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
    return;
  }
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), bits);
  std::memcpy(p, tmp, static_cast<size_t>(left) * sizeof(uint16_t));
}

ASCENT_AVX2 inline __m256 round_to_bf16_8(__m256 v) { return bf16_bits8_to_f32(bf16_bits8(v)); }

ASCENT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

ASCENT_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp_approx on 8 lanes: the same operations in the same order (no contraction), hence the same results.
ASCENT_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187045e-06f)));
  __m256 p = _mm256_add_ps(_mm256_set1_ps(8.33333377e-3f), _mm256_mul_ps(r, _mm256_set1_ps(1.38888892e-3f)));
  p = _mm256_add_ps(_mm256_set1_ps(4.16666679e-2f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.66666672e-1f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(r, p));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// y = rms_norm(s) * w over one bf16 row (sum of squares in 8 fp32 lanes, then (s * r) * w as the scalar path).
ASCENT_AVX2 void rms_norm_row_avx2(const bf16* s, const bf16* w, bf16* y, int64_t h, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 v = bf16_load8(s + j, h - j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(hsum8(acc) / static_cast<float>(h) + eps));
  for (int64_t j = 0; j < h; j += 8)
    bf16_store8(y + j, _mm256_mul_ps(_mm256_mul_ps(bf16_load8(s + j, h - j), r), bf16_load8(w + j, h - j)), h - j);
}

// srow = round(x + res); y = rms_norm(srow) * w.
ASCENT_AVX2 void add_rms_norm_row_avx2(const bf16* x, const bf16* res, const bf16* w, bf16* srow, bf16* y, int64_t h,
                                       float eps) {
  for (int64_t j = 0; j < h; j += 8)
    bf16_store8(srow + j, _mm256_add_ps(bf16_load8(x + j, h - j), bf16_load8(res + j, h - j)), h - j);
  rms_norm_row_avx2(srow, w, y, h, eps);
}

// out[j] = round(round(silu(g[j])) * g[d + j]) for one row.
ASCENT_AVX2 void silu_and_mul_row_avx2(const bf16* g, bf16* out, int64_t d) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t j = 0; j < d; j += 8) {
    const __m256 a = bf16_load8(g + j, d - j);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
    const __m256 silu = round_to_bf16_8(_mm256_div_ps(a, _mm256_add_ps(one, e)));
    bf16_store8(out + j, _mm256_mul_ps(silu, bf16_load8(g + d + j, d - j)), d - j);
  }
}

// NeoX rotation of one bf16 head in place: v[p], v[p + half] with every product and sum rounded as the scalar path.
ASCENT_AVX2 void rotary_neox_head_avx2(bf16* v, const bf16* cosr, const bf16* sinr, int64_t half) {
  for (int64_t p = 0; p < half; p += 8) {
    const int64_t left = half - p;
    const __m256 va = bf16_load8(v + p, left), vb = bf16_load8(v + half + p, left);
    const __m256 ca = round_to_bf16_8(_mm256_mul_ps(va, bf16_load8(cosr + p, left)));
    const __m256 cb = round_to_bf16_8(_mm256_mul_ps(vb, bf16_load8(cosr + half + p, left)));
    const __m256 sa = round_to_bf16_8(_mm256_mul_ps(vb, bf16_load8(sinr + p, left)));
    const __m256 sb = round_to_bf16_8(_mm256_mul_ps(va, bf16_load8(sinr + half + p, left)));
    bf16_store8(v + p, _mm256_add_ps(ca, sa), left);
    bf16_store8(v + half + p, _mm256_add_ps(cb, sb), left);
  }
}

// In place: sg[0 .. n) becomes softmax(sg) (max-subtracted exp256 on full 8-lane blocks, exp_approx on the tail).
ASCENT_AVX2 void softmax_row_avx2(float* sg, int64_t n) {
  const int64_t main = n & ~int64_t(7);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < main; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + j));
  float mx = hmax8(vmax);
  for (int64_t j = main; j < n; ++j) mx = std::fmax(mx, sg[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < main; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vmx));
    _mm256_storeu_ps(sg + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum8(total);
  for (int64_t j = main; j < n; ++j) {
    sg[j] = exp_approx(sg[j] - mx);
    sum += sg[j];
  }
  const float inv = 1.f / sum;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < main; j += 8) _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_loadu_ps(sg + j), vinv));
  for (int64_t j = main; j < n; ++j) sg[j] *= inv;
}

// attend_kv_head for bf16 with C = ceil(d / 8) vector chunks (d <= 8 * C): per query head the scaled q row and the
// P.V accumulators are C vectors each (registers for small C, else L1); K/V rows are re-read per head of the group.
template <int C>
ASCENT_AVX2 void attend_kv_head_avx2(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                     int64_t start, int64_t len, int64_t group, int64_t d, int64_t row_w, float scale,
                                     bf16* out, std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.resize(static_cast<size_t>(n));
  float* sg = buf.data();  // scores, then probabilities, of one query head
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m256 qv[C], acc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      qv[c] = _mm256_mul_ps(bf16_load8(q + g * d + c * 8, d - c * 8), vscale);
      acc[c] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
      const bf16* kr = kbase + slots[start + j] * row_w;
      __m256 dot = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) dot = _mm256_fmadd_ps(qv[c], bf16_load8(kr + c * 8, d - c * 8), dot);
      sg[j] = hsum8(dot);
    }
    softmax_row_avx2(sg, n);
    for (int64_t j = 0; j < n; ++j) {
      const bf16* vr = vbase + slots[start + j] * row_w;
      const __m256 pj = _mm256_set1_ps(sg[j]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pj, bf16_load8(vr + c * 8, d - c * 8), acc[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) bf16_store8(out + g * d + c * 8, acc[c], d - c * 8);
  }
}

// The AVX2 variant for head dims up to 128 (nullptr beyond: the scalar path is used).
AttendFn attend_avx2_for(int64_t d) {
  switch ((d + 7) / 8) {
    case 1: return attend_kv_head_avx2<1>;
    case 2: return attend_kv_head_avx2<2>;
    case 3: return attend_kv_head_avx2<3>;
    case 4: return attend_kv_head_avx2<4>;
    case 5: case 6: return attend_kv_head_avx2<6>;
    case 7: case 8: return attend_kv_head_avx2<8>;
    case 9: case 10: case 11: case 12: return attend_kv_head_avx2<12>;
    case 13: case 14: case 15: case 16: return attend_kv_head_avx2<16>;
    default: return nullptr;
  }
}
