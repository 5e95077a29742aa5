// Grouped AVX512-BF16 decode attention of fused_cpu.cpp: all query heads of one KV head in one pass over the keys.
// Included by fused_cpu.cpp inside its anonymous namespace, after avx512_bf16.h (bf16, tail_mask, bf16_load,
// bf16_store, bf16_half, exp_rows, softmax_rows).
//
// attend_kv_head_avx512 (avx512_bf16.h) scores one key per query head with 4 fp32 FMAs plus a horizontal reduction
// and re-reads the key and value rows once per query head. Here, for head dims that are a multiple of 32:
//   scores: q . k with vdpbf16ps straight on the bf16 rows (products exact, fp32 sums), 16 keys at a time, the 16
//           dot-product vectors folded into one vector of 16 scores by a 4-level shuffle tree (45 ops per 16 keys
//           instead of a full horizontal reduction per key), times `scale` afterwards;
//   softmax: softmax_rows (avx512_bf16.h), shared with the per-head kernel;
//   values: each value row widened to fp32 once and accumulated into the registers of every query head of the group.
// The result differs from the per-head kernel only in fp32 summation order (tests compare both with SDPA).
#pragma once

#define ASCENT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return has_avx512() && ok;
}

// paged_decode_attention's bf16 operands (the split driver of split_attention.h and the AMX path take them):
// q [rows, >= num_heads * d] with row stride qs, K / V planes of slot rows kv_heads * d wide, slots int64 [rows, L],
// lens [rows], out [rows, num_heads * d].
struct DecodeAttentionCall {
  const bf16* qp;
  int64_t qs;
  const bf16* kbase;
  const bf16* vbase;
  const int64_t* sp;
  int64_t L;
  const int64_t* lens;
  int64_t num_heads, kv_heads, d, window;
  float scale;
  bf16* op;
};

constexpr int64_t kValuePrefetch = 8;  // value rows prefetched this many keys ahead

// The cache lines of `elems` bf16 values from `row`. Callers prefetch row_w values from their head's slice: the whole
// slot row (every KV head) from the first head, which the other heads' units (the same row, next in order) then find
// cached; from later heads the tail past the row is harmless (prefetches never fault).
inline void prefetch_row(const bf16* row, int64_t elems) {
  for (int64_t b = 0; b < elems * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// The same toward L2 only (PREFETCHT2): for rows needed a phase later, without holding L1 fill buffers meanwhile.
inline void prefetch_row_to_l2(const bf16* row, int64_t elems) {
  for (int64_t b = 0; b < elems * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T2);
}

// r[j] = sum of the 16 lanes of v[j], j < 16 (lane j of the result holds key j's score).
ASCENT_AVX512 inline __m512 fold16(const __m512* v) {
  __m512 s[8], u[4], r[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane L: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane L: the lane-L sums of keys 4i .. 4i+3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit blocks: [u0 L0+L1, u0 L2+L3, u1 L0+L1, u1 L2+L3]
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// sc[g * n + j] = scale * (q_g . k_j) for the keys slots[start + j], j < n; P = d / 32 bf16 pairs-vectors per row.
// Each 16-key block's value rows are sent toward L2 for grouped_values (0.83-0.98x the attention's time).
template <int P, int G>
ASCENT_AVX512_BF16 void grouped_scores(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                       int64_t n, int64_t d, int64_t row_w, float scale, float* sc) {
  __m512bh qv[G][P];
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p) qv[g][p] = (__m512bh)_mm512_loadu_si512(q + g * d + p * 32);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < std::min<int64_t>(n, 16); ++j) prefetch_row(kbase + slots[j] * row_w, row_w);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - j0);
    for (int64_t j = j0 + 16; j < std::min<int64_t>(n, j0 + 32); ++j)  // the next block's rows: misses in flight
      prefetch_row(kbase + slots[j] * row_w, row_w);
    for (int64_t j = j0; j < j0 + keys; ++j) prefetch_row_to_l2(vbase + slots[j] * row_w, d);
    for (int g = 0; g < G; ++g) {
      __m512 dots[16];
      for (int64_t j = 0; j < 16; ++j) {
        dots[j] = _mm512_setzero_ps();
        if (j >= keys) continue;
        const bf16* kr = kbase + slots[j0 + j] * row_w;
        for (int p = 0; p < P; ++p)
          dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512(kr + p * 32), qv[g][p]);
      }
      _mm512_mask_storeu_ps(sc + g * n + j0, tail_mask(keys), _mm512_mul_ps(fold16(dots), vscale));
    }
  }
}

ASCENT_AVX512 inline void store16(bf16* p, __m512 v) { bf16_store(p, v, 0xFFFF); }
ASCENT_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// out[g * out_stride + i] = sum_{j < n} p[g * p_stride + j] * v_j[i] for the G weight rows and dims i < D, v_j the
// value row of slots[j] (from vbase, row_w apart), in fp32, keys in ascending order; out bf16 (rounded once) or fp32.
// Each row is read once per 64 dims for all G weight rows and split into its even and odd dims (a 32-bit lane's low
// bf16 shifted up, its high bf16 masked: both exact fp32), one FMA per weight row and 16 dims; the dims are
// interleaved back at the end. Rows 16 keys ahead are prefetched into L1. Shared by the grouped AVX512 kernels and
// the AMX units (amx_attention.h); against the widening loads it replaced (two ops per 16 values instead of one):
// 0.86-0.94x the grouped kernel's time (SmolLM2 shapes, 30 layers from DRAM, 2 threads).
template <int D, int G, typename Out>
ASCENT_AVX512 void weighted_value_rows(const float* p, int64_t p_stride, const bf16* vbase, const int64_t* slots,
                                       int64_t n, int64_t row_w, Out* out, int64_t out_stride) {
  constexpr int kChunk = D < 64 ? D : 64;  // dims per pass over the keys
  constexpr int kLoads = kChunk / 32;      // 32-value loads per key and pass
  constexpr int64_t kAhead = 16;
  const __m512i even_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i odd_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int dc = 0; dc < D; dc += kChunk) {
    __m512 acc[G][2 * kLoads];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 2 * kLoads; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < std::min(n, kAhead); ++j) prefetch_row(vbase + slots[j] * row_w + dc, kChunk);
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) prefetch_row(vbase + slots[j + kAhead] * row_w + dc, kChunk);
      const bf16* row = vbase + slots[j] * row_w + dc;
      __m512 v[2 * kLoads];
      for (int i = 0; i < kLoads; ++i) {
        const __m512i x = _mm512_loadu_si512(row + 32 * i);
        v[2 * i] = bf16_half(x, 0);
        v[2 * i + 1] = bf16_half(x, 1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * p_stride + j]);
        for (int i = 0; i < 2 * kLoads; ++i) acc[g][i] = _mm512_fmadd_ps(pj, v[i], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < kLoads; ++i) {
        Out* dst = out + g * out_stride + dc + 32 * i;
        store16(dst, _mm512_permutex2var_ps(acc[g][2 * i], even_idx, acc[g][2 * i + 1]));
        store16(dst + 16, _mm512_permutex2var_ps(acc[g][2 * i], odd_idx, acc[g][2 * i + 1]));
      }
  }
}

// out_g = sum_j p[g * n + j] * v_j for the G heads of d = C * 16 dims (weighted_value_rows).
template <int C, int G, typename Out>
ASCENT_AVX512 void grouped_values(const float* p, const bf16* vbase, const int64_t* slots, int64_t n, int64_t d,
                                  int64_t row_w, Out* out) {
  weighted_value_rows<C * 16, G>(p, n, vbase, slots, n, row_w, out, d);
}

// attend_kv_head_avx512's contract (q: the group's G query rows of d; out: their G output rows) for d = 32 * P.
template <int P, int G>
ASCENT_AVX512_BF16 void attend_grouped(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                       int64_t start, int64_t len, int64_t group, int64_t d, int64_t row_w,
                                       float scale, bf16* out, std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.resize(static_cast<size_t>(G * n));
  grouped_scores<P, G>(q, kbase, vbase, slots + start, n, d, row_w, scale, buf.data());
  softmax_rows(buf.data(), G, n);
  grouped_values<2 * P, G>(buf.data(), vbase, slots + start, n, d, row_w, out);
}

// One chunk of a split context (split_attention.h): keys slots[0 .. n); per query head g of the group
// mx[g] = max score, total[g] = sum_j e_gj with e_gj = exp(score - mx[g]), acc[g * d ..] = sum_j e_gj v_j (fp32).
template <int P, int G>
ASCENT_AVX512_BF16 void attend_grouped_chunk(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                             int64_t n, int64_t d, int64_t row_w, float scale, float* acc, float* mx,
                                             float* total, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(G * n));
  grouped_scores<P, G>(q, kbase, vbase, slots, n, d, row_w, scale, buf.data());
  exp_rows(buf.data(), G, n, mx, total);
  grouped_values<2 * P, G>(buf.data(), vbase, slots, n, d, row_w, acc);
}

using AttendChunkFn = void (*)(const bf16*, const bf16*, const bf16*, const int64_t*, int64_t, int64_t, int64_t, float,
                               float*, float*, float*, std::vector<float>&);

// The grouped kernels of one (head dim, group size): a whole context, and one chunk of a split one.
struct GroupedAttention {
  AttendFn whole = nullptr;
  AttendChunkFn chunk = nullptr;
};

template <int P>
GroupedAttention attend_grouped_for_group(int64_t group) {
  switch (group) {
    case 1: return {attend_grouped<P, 1>, attend_grouped_chunk<P, 1>};
    case 2: return {attend_grouped<P, 2>, attend_grouped_chunk<P, 2>};
    case 3: return {attend_grouped<P, 3>, attend_grouped_chunk<P, 3>};
    case 4: return {attend_grouped<P, 4>, attend_grouped_chunk<P, 4>};
    default: return {};
  }
}

// The grouped kernels for head dim d and group size (query heads per KV head) when there are: d in {32, 64, 128},
// at most 16 fp32 value accumulators (group * d / 16); none otherwise (the per-head kernel is used).
GroupedAttention attend_grouped_for(int64_t d, int64_t group) {
  if (!has_avx512_bf16() || group * (d / 16) > 16) return {};
  switch (d) {
    case 32: return attend_grouped_for_group<1>(group);
    case 64: return attend_grouped_for_group<2>(group);
    case 128: return attend_grouped_for_group<4>(group);
    default: return {};
  }
}
