// Causal prefill attention on AVX2 + FMA (flash-style, online softmax) for fused_cpu.cpp's prefill_attention on CPUs
// without AVX512-BF16 or AMX (e.g. AMD Zen 1-3). Included by fused_cpu.cpp inside its anonymous namespace, after
// avx2_bf16.h (ASCENT_AVX2, bf16_load8, bf16_store8, exp256, hmax8, hsum8) and avx512_prefill_attention.h
// (PrefillAttnArgs, kMaxHeadDim, g_prefill_attention).
//
// torch's CPU SDPA runs bf16 attention at 20-45 GFLOP/s on 2 Zen 3 cores for 64-512-token prompts (its bf16 GEMMs are
// emulated there), so attention took ~12% of a prefill of ~130-token prompts and more with longer ones. Here:
//   packing: each KV head's keys and values are widened to fp32 once per call, in blocks of kF32KeyBlock keys: keys
//            as [group of 8 keys][dim][8 keys] (one 8-key vector per dim), values as [key][dim];
//   scores:  4 query vectors x 16 keys per pass (8 accumulators; per dim 2 key loads, 4 query broadcasts, 8 FMAs),
//            times `scale`; keys past the causal limit or before the sliding window are masked to -inf;
//   softmax: online per query vector over a whole block (running max m and sum l; the output rescaled by
//            exp(m_old - m_new) when the max moved), exp256 for the probabilities;
//   values:  fp32 P times the fp32 value rows (16 dims x 4 query vectors per pass) into fp32 output rows;
//            out = O / l rounded once to bf16.
// Everything after the bf16 inputs is fp32 (P is not rounded to bf16 as the AVX512-BF16 kernel rounds it).
#pragma once

#include <atomic>
#include <vector>

constexpr int64_t kF32KeyBlock = 64;  // keys per packed block
constexpr int64_t kF32QueryRows = 16;  // token rows per task (times the GQA group in query vectors)

// Mode 3, or auto on CPUs without AVX512-BF16 (at the current ISA level; there torch's bf16 GEMMs are emulated,
// elsewhere the AVX512-BF16 / AMX kernels or torch's native bf16 serve): AVX2 + FMA, head dims a multiple of 32 up
// to kMaxHeadDim, as the AVX512-BF16 kernel (the loops need multiples of 16; smaller heads stay on torch's SDPA,
// whose rounding the profiles without these kernels reproduce token for token).
inline bool avx2_prefill_applies(int64_t d) {
  const bool wanted = g_prefill_attention == 3 || (g_prefill_attention < 0 && !has_avx512_bf16());
  return wanted && has_avx2_fma() && d % 32 == 0 && d > 0 && d <= kMaxHeadDim;
}

// Widens keys and values [j0, j0 + kF32KeyBlock) of KV head h (zeros past tk) into kp [8-key group][d][8] and
// vp [key][d].
ASCENT_AVX2 void pack_f32_key_block(const PrefillAttnArgs& a, int64_t h, int64_t j0, float* kp, float* vp) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < kF32KeyBlock; ++i) {
    const int64_t j = j0 + i;
    float* vrow = vp + i * d;
    float* kcol = kp + (i / 8) * d * 8 + i % 8;
    if (j >= a.tk) {
      std::memset(vrow, 0, sizeof(float) * d);
      for (int64_t c = 0; c < d; ++c) kcol[c * 8] = 0.f;
      continue;
    }
    const bf16* krow = a.k + j * a.k_stride + h * d;
    const bf16* vsrc = a.v + j * a.v_stride + h * d;
    for (int64_t c = 0; c < d; c += 8) {
      _mm256_storeu_ps(vrow + c, bf16_load8(vsrc + c, 8));
      alignas(32) float kv[8];
      _mm256_store_ps(kv, bf16_load8(krow + c, 8));
      for (int e = 0; e < 8; ++e) kcol[(c + e) * 8] = kv[e];
    }
  }
}

// Up to 4 query vectors of one KV head: scaled fp32 queries, positions, running max / sum and fp32 outputs (absent
// lanes of a partial quad repeat the last vector's query and are never stored).
struct F32Quad {
  int64_t pos[4];
  float m[4], l[4];
  alignas(32) float q[4][kMaxHeadDim];
  alignas(32) float o[4][kMaxHeadDim];
  alignas(32) float p[4][kF32KeyBlock];  // this block's scores, then probabilities
};

// p[r][0 .. kF32KeyBlock) = scale * q[r] . k for the block's keys (kp as packed by pack_f32_key_block).
ASCENT_AVX2 void f32_quad_scores(F32Quad& s, const float* kp, int64_t d) {
  for (int64_t g2 = 0; g2 < kF32KeyBlock / 16; ++g2) {
    const float* k0 = kp + (2 * g2) * d * 8;
    const float* k1 = k0 + d * 8;
    __m256 acc[4][2];
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m256 ka = _mm256_loadu_ps(k0 + c * 8), kb = _mm256_loadu_ps(k1 + c * 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 qv = _mm256_broadcast_ss(s.q[r] + c);
        acc[r][0] = _mm256_fmadd_ps(qv, ka, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, kb, acc[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_store_ps(s.p[r] + 16 * g2, acc[r][0]);
      _mm256_store_ps(s.p[r] + 16 * g2 + 8, acc[r][1]);
    }
  }
}

// Online-softmax update of vector r with the block of keys starting at j0: masked scores become probabilities in
// s.p[r] (0 for masked keys), m / l / o rescaled. False when no key of the block is visible to r.
ASCENT_AVX2 bool f32_softmax_update(F32Quad& s, int r, int64_t j0, int64_t window, int64_t d) {
  const int64_t pos = s.pos[r], lo = window > 0 ? pos - window + 1 : 0;
  const int64_t first = std::max<int64_t>(lo - j0, 0), end = std::min<int64_t>(pos - j0 + 1, kF32KeyBlock);
  if (first >= end) return false;
  float* p = s.p[r];
  for (int64_t j = 0; j < first; ++j) p[j] = -INFINITY;
  for (int64_t j = end; j < kF32KeyBlock; ++j) p[j] = -INFINITY;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < kF32KeyBlock; j += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(p + j));
  const float m_new = std::max(s.m[r], hmax8(mx));
  const float alpha = s.m[r] == -INFINITY ? 0.f : exp_approx(s.m[r] - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < kF32KeyBlock; j += 8) {
    const __m256 sc = _mm256_load_ps(p + j);
    const __m256 visible = _mm256_cmp_ps(sc, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(sc, mv)), visible);
    _mm256_store_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  s.l[r] = s.l[r] * alpha + hsum8(sum);
  s.m[r] = m_new;
  if (alpha != 1.f) {
    const __m256 av = _mm256_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 8) _mm256_store_ps(s.o[r] + c, _mm256_mul_ps(_mm256_load_ps(s.o[r] + c), av));
  }
  return true;
}

// o[r] += P[r] . V over the block for the active vectors (vp [key][d] fp32), 16 dims x 4 vectors per pass.
ASCENT_AVX2 void f32_quad_values(F32Quad& s, const bool (&active)[4], const float* vp, int64_t d) {
  for (int64_t c = 0; c < d; c += 16) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; ++r) {
      acc[r][0] = _mm256_load_ps(s.o[r] + c);
      acc[r][1] = _mm256_load_ps(s.o[r] + c + 8);
    }
    for (int64_t j = 0; j < kF32KeyBlock; ++j) {
      const __m256 va = _mm256_loadu_ps(vp + j * d + c), vb = _mm256_loadu_ps(vp + j * d + c + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 pv = _mm256_broadcast_ss(s.p[r] + j);
        acc[r][0] = _mm256_fmadd_ps(pv, va, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pv, vb, acc[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      if (!active[r]) continue;
      _mm256_store_ps(s.o[r] + c, acc[r][0]);
      _mm256_store_ps(s.o[r] + c + 8, acc[r][1]);
    }
  }
}

// Query vectors v0 .. v0 + n - 1 (vector vi = token row t0 + vi / group, head h * group + vi % group) of KV head h
// over its packed keys and values.
ASCENT_AVX2 void f32_attend_quad(const PrefillAttnArgs& a, int64_t h, int64_t t0, int64_t v0, int n,
                                 const float* kpack, const float* vpack, F32Quad& s) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, block_elems = kF32KeyBlock * d;
  int64_t lo_pos = INT64_MAX, hi_pos = 0;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < 4; ++r) {
    const int64_t vi = v0 + std::min(r, n - 1), row = t0 + vi / group, head = h * group + vi % group;
    const bf16* q = a.q + row * a.q_stride + head * d;
    for (int64_t c = 0; c < d; c += 8) _mm256_store_ps(s.q[r] + c, _mm256_mul_ps(bf16_load8(q + c, 8), scale));
    s.pos[r] = a.q_offset + row;
    s.m[r] = -INFINITY;
    s.l[r] = 0.f;
    std::memset(s.o[r], 0, sizeof(float) * d);
    lo_pos = std::min(lo_pos, s.pos[r]);
    hi_pos = std::max(hi_pos, s.pos[r]);
  }
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, lo_pos - a.window + 1) / kF32KeyBlock : 0;
  for (int64_t b = first; b <= hi_pos / kF32KeyBlock; ++b) {
    f32_quad_scores(s, kpack + b * block_elems, d);
    bool active[4];
    for (int r = 0; r < 4; ++r) active[r] = r < n && f32_softmax_update(s, r, b * kF32KeyBlock, a.window, d);
    for (int r = 0; r < 4; ++r)
      if (!active[r]) std::memset(s.p[r], 0, sizeof(s.p[r]));  // inactive lanes add nothing
    if (active[0] || active[1] || active[2] || active[3]) f32_quad_values(s, active, vpack + b * block_elems, d);
  }
  for (int r = 0; r < n; ++r) {
    const int64_t vi = v0 + r, row = t0 + vi / group, head = h * group + vi % group;
    const __m256 inv = _mm256_set1_ps(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f);
    bf16* out = a.out + row * a.heads * d + head * d;
    for (int64_t c = 0; c < d; c += 8) bf16_store8(out + c, _mm256_mul_ps(_mm256_load_ps(s.o[r] + c), inv), 8);
  }
}

// prefill_attention on AVX2 + FMA (only where avx2_prefill_applies(a.d)).
void prefill_attention_avx2(const PrefillAttnArgs& a) {
  const int64_t d = a.d, group = a.heads / a.kv_heads;
  const int64_t blocks = (a.tk + kF32KeyBlock - 1) / kF32KeyBlock, block_elems = kF32KeyBlock * d;
  std::vector<float> kpack(static_cast<size_t>(a.kv_heads * blocks * block_elems));
  std::vector<float> vpack(kpack.size());
  ascent_par::parallel_for(0, a.kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      pack_f32_key_block(a, u / blocks, (u % blocks) * kF32KeyBlock, kpack.data() + u * block_elems,
                         vpack.data() + u * block_elems);
  });
  const int64_t row_blocks = (a.tq + kF32QueryRows - 1) / kF32QueryRows, tasks = a.kv_heads * row_blocks;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(std::max(at::get_num_threads(), 1), tasks);
  ascent_par::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    F32Quad state;  // on the thread's stack: a heap block here would give an OpenMP thread its own malloc arena
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t rb = row_blocks - 1 - t / a.kv_heads, h = t % a.kv_heads;  // the longest rows first
      const int64_t t0 = rb * kF32QueryRows, rows = std::min(kF32QueryRows, a.tq - t0), vectors = rows * group;
      const float* kp = kpack.data() + h * blocks * block_elems;
      const float* vp = vpack.data() + h * blocks * block_elems;
      for (int64_t v0 = 0; v0 < vectors; v0 += 4)
        f32_attend_quad(a, h, t0, v0, static_cast<int>(std::min<int64_t>(4, vectors - v0)), kp, vp, state);
    }
  });
}
