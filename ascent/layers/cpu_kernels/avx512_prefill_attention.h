// Causal prefill attention on AVX512-BF16 (flash-style, online softmax) for fused_cpu.cpp's prefill_attention.
// Included by fused_cpu.cpp inside its anonymous namespace, after avx512_attention.h (bf16, ASCENT_AVX512_BF16,
// bf16_store, exp2_512, has_avx512_bf16).
//
// torch's CPU SDPA runs bf16 prefill attention at 40-70 GFLOP/s on 2 Zen 4 cores against 400+ for the projections'
// GEMMs, so at a 512-token prompt attention took a quarter of the prefill and at 2k tokens most of it. Here:
//   packing: each KV head's keys and values are repacked once per call into blocks of kKeyBlock keys, keys as
//            [key group of 16][dim pair][16 keys][2] and values as [dim block of 16][key pair][16 dims][2], the
//            operand layouts of vdpbf16ps (no horizontal reductions anywhere);
//   scores:  4 query vectors x 32 keys per pass, each dim pair of a query broadcast against 16 keys' pairs (fp32 sums
//            of exact bf16 products), times `scale`; the causal / sliding-window mask sets excluded keys to -inf;
//   softmax: online per query vector (running max m, sum l, output rescaled by exp(m_old - m_new)); the exps as
//            2^(s log2(e) - m log2(e)) with exp2_512's FMA polynomial (0.95-0.96x the time of the unfused
//            exp_approx polynomial it replaced);
//   values:  P rounded to bf16 (as torch's flash kernel does for bf16) and accumulated with vdpbf16ps into fp32
//            output rows; out = O / l rounded once to bf16.
// Query i sits at position q_offset + i and sees keys j <= q_offset + i (and j > q_offset + i - window when
// window > 0); tk == q_offset + tq (the cached context followed by this chunk's own keys).
#pragma once

#include <atomic>

#define ASCENT_AVX512_BF16_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

constexpr int64_t kKeyBlock = 64;    // keys per packed block
constexpr int kGroups = kKeyBlock / 16;  // groups of 16 keys per block
constexpr int64_t kQueryRows = 16;   // token rows per task (times the GQA group in query vectors)
constexpr int64_t kMaxHeadDim = 256;

struct PrefillAttnArgs {
  const bf16* q;  // [tq, heads * d], row stride q_stride
  const bf16* k;  // [tk, kv_heads * d], row stride k_stride
  const bf16* v;  // [tk, kv_heads * d], row stride v_stride
  int64_t q_stride, k_stride, v_stride;
  int64_t tq, tk, heads, kv_heads, d, q_offset, window;
  float scale;
  bf16* out;  // [tq, heads * d] contiguous
};

// -1 auto: this kernel on CPUs with AVX512-BF16 and without AMX, the AMX kernel (amx_prefill_attention.h) on AMX
// CPUs (this one is 2-3.5x slower than torch's SDPA there); 1: this kernel wherever AVX512-BF16 exists; 2: the AMX
// kernel wherever AMX exists; 3: the AVX2 kernel (avx2_prefill_attention.h; auto on CPUs without AVX512-BF16);
// 0: none. The environment's ASCENT_CPU_PREFILL_ATTENTION=0 / 1 / 2 / 3 sets it at load
// (anything else: auto); set_prefill_attention changes it (tests).
int initial_prefill_mode() {
  const char* v = std::getenv("ASCENT_CPU_PREFILL_ATTENTION");
  if (v != nullptr && v[0] >= '0' && v[0] <= '3' && v[1] == '\0') return v[0] - '0';
  return -1;
}

int g_prefill_attention = initial_prefill_mode();

inline bool prefill_attention_applies(int64_t d) {
  const bool wanted = g_prefill_attention == 1 || (g_prefill_attention < 0 && !ascent_tiles::amx_usable());
  return wanted && has_avx512_bf16() && d % 32 == 0 && d > 0 && d <= kMaxHeadDim;
}

// Packs keys [j0, j0 + kKeyBlock) of KV head h (zero padded past tk) into kp and vp (kKeyBlock * d bf16 each).
void pack_key_block(const PrefillAttnArgs& a, int64_t h, int64_t j0, uint16_t* kp, uint16_t* vp) {
  const int64_t d = a.d, pairs = d / 2;
  auto key = [&](int64_t j, int64_t c) -> uint16_t {
    return j < a.tk ? reinterpret_cast<const uint16_t*>(a.k + j * a.k_stride + h * d)[c] : uint16_t(0);
  };
  auto value = [&](int64_t j, int64_t c) -> uint16_t {
    return j < a.tk ? reinterpret_cast<const uint16_t*>(a.v + j * a.v_stride + h * d)[c] : uint16_t(0);
  };
  for (int64_t g = 0; g < kKeyBlock / 16; ++g)  // kp[g][c][16 keys][2]
    for (int64_t c = 0; c < pairs; ++c)
      for (int64_t i = 0; i < 16; ++i) {
        uint16_t* dst = kp + ((g * pairs + c) * 16 + i) * 2;
        dst[0] = key(j0 + g * 16 + i, 2 * c);
        dst[1] = key(j0 + g * 16 + i, 2 * c + 1);
      }
  for (int64_t b = 0; b < d / 16; ++b)  // vp[b][key pair][16 dims][2]
    for (int64_t p = 0; p < kKeyBlock / 2; ++p)
      for (int64_t i = 0; i < 16; ++i) {
        uint16_t* dst = vp + ((b * (kKeyBlock / 2) + p) * 16 + i) * 2;
        dst[0] = value(j0 + 2 * p, b * 16 + i);
        dst[1] = value(j0 + 2 * p + 1, b * 16 + i);
      }
}

// Running state of up to 4 query vectors: O [4][d] fp32, max m and sum l per vector.
struct QuadState {
  const uint16_t* q[4];  // query vectors (bf16 bits), nullptr for absent lanes of a partial quad
  int64_t pos[4];        // positions
  float m[4], l[4];
  alignas(64) float o[4][kMaxHeadDim];
};

// The bf16 pair p[0], p[1] broadcast to all 16 lanes.
ASCENT_AVX512_BF16 inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// S[4][kKeyBlock] = scale * q . k for key block kp (kGroups groups of 16 keys); vectors r >= n are left at 0.
ASCENT_AVX512_BF16 void quad_scores(const QuadState& s, int n, const uint16_t* kp, int64_t pairs, float scale,
                                    __m512 (&sc)[4][kGroups]) {
  __m512 acc[4][kGroups];
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh kv[kGroups];
    for (int g = 0; g < kGroups; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(kp + (g * pairs + c) * 32);
    for (int r = 0; r < 4; ++r) {
      if (r >= n) break;
      const __m512bh qb = broadcast_pair(s.q[r] + 2 * c);
      for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qb, kv[g]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < kGroups; ++g) sc[r][g] = _mm512_mul_ps(acc[r][g], sv);
}

// Online-softmax update of vector r with the block's scores (keys j0 .. j0 + kKeyBlock - 1); writes P (bf16 bits, 0
// for excluded keys) to p_out[kKeyBlock] and returns false when the block has no key for it (nothing to accumulate).
ASCENT_AVX512_BF16_FMA bool softmax_update(QuadState& s, int r, int64_t j0, int64_t window, int64_t d,
                                           __m512 (&sc)[kGroups], uint16_t* p_out) {
  const int64_t pos = s.pos[r], lo = window > 0 ? pos - window + 1 : 0;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 valid[kGroups];
  int any = 0;
  for (int g = 0; g < kGroups; ++g) {
    const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j0 + 16 * g)));
    valid[g] = _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(static_cast<int32_t>(pos)), _MM_CMPINT_LE) &
               _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(static_cast<int32_t>(lo)), _MM_CMPINT_NLT);
    any |= valid[g];
  }
  if (any == 0) return false;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < kGroups; ++g) mx = _mm512_mask_max_ps(mx, valid[g], mx, sc[g]);
  const float m_new = std::max(s.m[r], _mm512_reduce_max_ps(mx));
  const float alpha = s.m[r] == -INFINITY ? 0.f : std::exp(s.m[r] - m_new);
  const __m512 mv = _mm512_set1_ps(m_new * 1.44269504088896341f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 sum = _mm512_setzero_ps();
  for (int g = 0; g < kGroups; ++g) {
    const __m512 pg = _mm512_maskz_mov_ps(valid[g], exp2_512(_mm512_fmsub_ps(sc[g], log2e, mv)));
    sum = _mm512_add_ps(sum, pg);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_out + 16 * g), bf16_bits(pg));
  }
  s.l[r] = s.l[r] * alpha + _mm512_reduce_add_ps(sum);
  s.m[r] = m_new;
  if (alpha != 1.f) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 16) _mm512_store_ps(s.o[r] + c, _mm512_mul_ps(_mm512_load_ps(s.o[r] + c), av));
  }
  return true;
}

// O[r] += P[r] (bf16 [kKeyBlock]) . V block for the vectors with active[r].
ASCENT_AVX512_BF16 void quad_values(QuadState& s, const bool (&active)[4], const uint16_t (&p)[4][kKeyBlock],
                                    const uint16_t* vp, int64_t d) {
  constexpr int64_t kPairs = kKeyBlock / 2;
  for (int64_t b = 0; b < d / 16; ++b) {
    const uint16_t* vb = vp + b * kPairs * 32;
    __m512 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_load_ps(s.o[r] + b * 16);
    for (int64_t jp = 0; jp < kPairs; ++jp) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + jp * 32);
      for (int r = 0; r < 4; ++r) {
        if (!active[r]) continue;
        acc[r] = _mm512_dpbf16_ps(acc[r], broadcast_pair(p[r] + 2 * jp), vv);
      }
    }
    for (int r = 0; r < 4; ++r) _mm512_store_ps(s.o[r] + b * 16, acc[r]);
  }
}

// The query vectors [v0, v0 + n) (n <= 4) of KV head h's task: vector i is row t0 + i / group, head
// h * group + i % group.
ASCENT_AVX512_BF16 void attend_quad(const PrefillAttnArgs& a, int64_t h, int64_t t0, int64_t v0, int n,
                                    const uint16_t* kpack, const uint16_t* vpack) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, block_elems = kKeyBlock * d;
  QuadState s;
  int64_t lo_pos = INT64_MAX, hi_pos = 0;
  for (int r = 0; r < 4; ++r) {
    const int64_t vi = v0 + std::min(r, n - 1), row = t0 + vi / group, head = h * group + vi % group;
    s.q[r] = reinterpret_cast<const uint16_t*>(a.q + row * a.q_stride + head * d);
    s.pos[r] = a.q_offset + row;
    s.m[r] = -INFINITY;
    s.l[r] = 0.f;
    std::memset(s.o[r], 0, sizeof(float) * d);
    lo_pos = std::min(lo_pos, s.pos[r]);
    hi_pos = std::max(hi_pos, s.pos[r]);
  }
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, lo_pos - a.window + 1) / kKeyBlock : 0;
  const int64_t last = hi_pos / kKeyBlock;
  alignas(64) uint16_t p[4][kKeyBlock];
  for (int64_t b = first; b <= last; ++b) {
    __m512 sc[4][kGroups];
    quad_scores(s, n, kpack + b * block_elems, d / 2, a.scale, sc);
    bool active[4];
    for (int r = 0; r < 4; ++r) active[r] = r < n && softmax_update(s, r, b * kKeyBlock, a.window, d, sc[r], p[r]);
    if (active[0] || active[1] || active[2] || active[3]) quad_values(s, active, p, vpack + b * block_elems, d);
  }
  for (int r = 0; r < n; ++r) {
    const int64_t vi = v0 + r, row = t0 + vi / group, head = h * group + vi % group;
    const __m512 inv = _mm512_set1_ps(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f);
    for (int64_t c = 0; c < d; c += 16)
      bf16_store(a.out + row * a.heads * d + head * d + c, _mm512_mul_ps(_mm512_load_ps(s.o[r] + c), inv),
                 __mmask16(0xFFFF));
  }
}

// Packs every KV head's blocks, then runs the (KV head, row block) tasks, most expensive (latest rows) first, handed
// out dynamically (causal tasks differ in cost by up to tk / kQueryRows).
void prefill_attention_avx512(const PrefillAttnArgs& a) {
  const int64_t d = a.d, group = a.heads / a.kv_heads;
  const int64_t blocks = (a.tk + kKeyBlock - 1) / kKeyBlock, block_elems = kKeyBlock * d;
  std::vector<uint16_t> kpack(static_cast<size_t>(a.kv_heads * blocks * block_elems));
  std::vector<uint16_t> vpack(kpack.size());
  ascent_par::parallel_for(0, a.kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / blocks, b = u % blocks;
      pack_key_block(a, h, b * kKeyBlock, kpack.data() + u * block_elems, vpack.data() + u * block_elems);
    }
  });
  const int64_t row_blocks = (a.tq + kQueryRows - 1) / kQueryRows, tasks = a.kv_heads * row_blocks;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(std::max(at::get_num_threads(), 1), tasks);
  ascent_par::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t rb = row_blocks - 1 - t / a.kv_heads, h = t % a.kv_heads;
      const int64_t t0 = rb * kQueryRows, rows = std::min(kQueryRows, a.tq - t0), vectors = rows * group;
      const uint16_t* kp = kpack.data() + h * blocks * block_elems;
      const uint16_t* vp = vpack.data() + h * blocks * block_elems;
      for (int64_t v0 = 0; v0 < vectors; v0 += 4)
        attend_quad(a, h, t0, v0, static_cast<int>(std::min<int64_t>(4, vectors - v0)), kp, vp);
    }
  });
}
