// Grouped AVX2 decode attention of fused_cpu.cpp for CPUs without AVX512 (e.g. AMD Zen 2): all query heads of one
// KV head in one pass over the keys, as avx512_attention.h does with AVX512-BF16, in a whole-context form and in the
// chunk form that split_attention.h's flash-decoding driver merges. Included by fused_cpu.cpp inside its anonymous
// namespace, after avx2_bf16.h and avx512_attention.h (GroupedAttention, prefetch_row, kValuePrefetch).
//
// attend_kv_head_avx2 (avx2_bf16.h) re-reads every key and value row once per query head, widens it per head and
// reduces every score horizontally; and with no chunk kernel a batch-1 step ran its kv_heads units on one thread
// (SmolLM2: 3 KV heads, 14 % of a 1k-token decode on the main thread while the second spun). Here, for head dims that
// are a multiple of 16 and groups of up to 8 query heads:
//   rows:    16 bf16 per 32-byte load, widened as even / odd element vectors (word w of the load holds elements 2w and
//            2w + 1: a shift and a mask), the scaled q rows likewise once per unit;
//   scores:  per key one fp32 accumulator per query head, two keys at a time for groups of up to 4; the accumulators
//            folded by a hadd tree into one 4-lane vector per 4 heads, stored key-major: sc[j * S + g], S = 4 or 8;
//   softmax: per column of that layout (an 8-lane vector holds 2 keys x 4 heads or 1 key x 8 heads), unnormalised:
//            the whole-context kernel divides the value sums once at the end;
//   values:  each value row widened once per pass and accumulated into the registers of every head of the group, in
//            passes of 16 * B dims that keep G * 2B <= 12 accumulators.
// fp32 throughout; the result differs from the per-head kernel only in summation order (tests compare both with SDPA).
#pragma once

// Score row stride: 4 lanes per key for up to 4 heads, else 8.
constexpr int score_stride(int group) { return group <= 4 ? 4 : 8; }

// The even (2w) and odd (2w + 1) elements of the 16 bf16 at p, widened to fp32 in lane w.
ASCENT_AVX2 inline void bf16_load16_eo(const bf16* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)].
ASCENT_AVX2 inline __m128 fold4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// qf [G][d]: per 16-dim block the 8 even then the 8 odd elements of q_g, times scale.
template <int G>
ASCENT_AVX2 void prepare_q_eo(const bf16* q, int64_t d, float scale, float* qf) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int64_t b = 0; b < d; b += 16) {
      __m256 even, odd;
      bf16_load16_eo(q + g * d + b, even, odd);
      _mm256_storeu_ps(qf + g * d + b, _mm256_mul_ps(even, vscale));
      _mm256_storeu_ps(qf + g * d + b + 8, _mm256_mul_ps(odd, vscale));
    }
}

// sc[j * S + g] = qf_g . k_j for the K keys rows[0 .. K) (lanes of heads >= G hold 0).
template <int G, int K>
ASCENT_AVX2 inline void score_keys(const float* qf, const bf16* const* rows, int64_t d, float* sc) {
  constexpr int S = score_stride(G);
  __m256 acc[K][S];
  for (int k = 0; k < K; ++k)
    for (int g = 0; g < S; ++g) acc[k][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < d; b += 16) {
    __m256 even[K], odd[K];
    for (int k = 0; k < K; ++k) bf16_load16_eo(rows[k] + b, even[k], odd[k]);
    for (int g = 0; g < G; ++g) {
      const __m256 qe = _mm256_loadu_ps(qf + g * d + b), qo = _mm256_loadu_ps(qf + g * d + b + 8);
      for (int k = 0; k < K; ++k) acc[k][g] = _mm256_fmadd_ps(odd[k], qo, _mm256_fmadd_ps(even[k], qe, acc[k][g]));
    }
  }
  for (int k = 0; k < K; ++k) {
    _mm_storeu_ps(sc + k * S, fold4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]));
    if constexpr (S == 8) _mm_storeu_ps(sc + k * S + 4, fold4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]));
  }
}

// Scores of the n keys slots[0 .. n) into sc [n][S].
template <int G>
ASCENT_AVX2 void grouped_scores_avx2(const float* qf, const bf16* kbase, const int64_t* slots, int64_t n, int64_t d,
                                     int64_t row_w, float* sc) {
  constexpr int S = score_stride(G), K = G <= 4 ? 2 : 1;
  int64_t j = 0;
  for (; j + K <= n; j += K) {
    const bf16* rows[K];
    for (int k = 0; k < K; ++k) {
      rows[k] = kbase + slots[j + k] * row_w;
      if (j + k + 8 < n) prefetch_row(kbase + slots[j + k + 8] * row_w, d);
    }
    score_keys<G, K>(qf, rows, d, sc + j * S);
  }
  for (; j < n; ++j) {
    const bf16* row = kbase + slots[j] * row_w;
    score_keys<G, 1>(qf, &row, d, sc + j * S);
  }
}

// Per column g of sc [n][S]: mx[g] = max_j sc, total[g] = sum_j e, sc replaced by e = exp(sc - mx[g]). For S = 4 an
// odd n pads the last vector with one key, which reads -inf and adds nothing (sc must hold (n + 1) * S floats).
template <int S>
ASCENT_AVX2 void exp_columns(float* sc, int64_t n, float* mx, float* total) {
  const int64_t vecs = (n * S + 7) / 8;
  const bool padded = S == 4 && (n & 1);
  if (padded) std::fill(sc + n * S, sc + n * S + S, -INFINITY);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t v = 0; v < vecs; ++v) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + v * 8));
  if constexpr (S == 4) vmax = _mm256_max_ps(vmax, _mm256_permute2f128_ps(vmax, vmax, 1));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t v = 0; v < vecs; ++v) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + v * 8), vmax));
    if (padded && v == vecs - 1) e = _mm256_blend_ps(e, _mm256_setzero_ps(), 0xF0);
    _mm256_storeu_ps(sc + v * 8, e);
    sum = _mm256_add_ps(sum, e);
  }
  if constexpr (S == 4) sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 1));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  std::copy(lanes, lanes + S, mx);
  _mm256_store_ps(lanes, sum);
  std::copy(lanes, lanes + S, total);
}

// out [G][d] (fp32, natural order) = sum_j p[j * S + g] v_j over the n value rows slots[0 .. n), in passes of B
// 16-dim blocks ((d / 16) % B == 0).
template <int G, int B>
ASCENT_AVX2 void grouped_values_avx2(const float* p, const bf16* vbase, const int64_t* slots, int64_t n, int64_t d,
                                     int64_t row_w, float* out) {
  constexpr int S = score_stride(G);
  for (int64_t b0 = 0; b0 < d; b0 += 16 * B) {
    __m256 acc[G][2 * B];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 2 * B; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      if (b0 == 0 && j + kValuePrefetch < n) prefetch_row(vbase + slots[j + kValuePrefetch] * row_w, d);
      const bf16* vr = vbase + slots[j] * row_w + b0;
      __m256 v[2 * B];
      for (int b = 0; b < B; ++b) bf16_load16_eo(vr + b * 16, v[2 * b], v[2 * b + 1]);
      for (int g = 0; g < G; ++g) {
        const __m256 pj = _mm256_broadcast_ss(p + j * S + g);
        for (int c = 0; c < 2 * B; ++c) acc[g][c] = _mm256_fmadd_ps(pj, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < B; ++b) {  // even / odd lanes back to element order
        const __m256 lo = _mm256_unpacklo_ps(acc[g][2 * b], acc[g][2 * b + 1]);
        const __m256 hi = _mm256_unpackhi_ps(acc[g][2 * b], acc[g][2 * b + 1]);
        float* o = out + g * d + b0 + b * 16;
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
  }
}

// Floats of grouped_pass_avx2's work area for n keys.
template <int G>
constexpr int64_t pass_work(int64_t n, int64_t d) { return G * d + (n + 1) * score_stride(G); }

// One pass over keys slots[0 .. n): acc [G][d] unnormalised value sums, mx / total per head (G entries written);
// work holds pass_work<G>(n, d) floats.
template <int G>
ASCENT_AVX2 void grouped_pass_avx2(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                   int64_t n, int64_t d, int64_t row_w, float scale, float* acc, float* mx,
                                   float* total, float* work) {
  constexpr int S = score_stride(G);
  float* qf = work;
  float* sc = qf + G * d;
  prepare_q_eo<G>(q, d, scale, qf);
  grouped_scores_avx2<G>(qf, kbase, slots, n, d, row_w, sc);
  float col_max[S], col_total[S];
  exp_columns<S>(sc, n, col_max, col_total);
  std::copy(col_max, col_max + G, mx);
  std::copy(col_total, col_total + G, total);
  const int64_t blocks = d / 16;
  if constexpr (G == 1) {
    if (blocks % 4 == 0) return grouped_values_avx2<G, 4>(sc, vbase, slots, n, d, row_w, acc);
  }
  if constexpr (G <= 3) {
    if (blocks % 2 == 0) return grouped_values_avx2<G, 2>(sc, vbase, slots, n, d, row_w, acc);
  }
  grouped_values_avx2<G, 1>(sc, vbase, slots, n, d, row_w, acc);
}

// AttendFn (attend_kv_head's contract): keys [start, len) of one row, out = the G heads' rows rounded once to bf16.
template <int G>
ASCENT_AVX2 void attend_grouped_avx2(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                     int64_t start, int64_t len, int64_t, int64_t d, int64_t row_w, float scale,
                                     bf16* out, std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.resize(static_cast<size_t>(G * d + pass_work<G>(n, d)));
  float* acc = buf.data();
  float mx[G], total[G];
  grouped_pass_avx2<G>(q, kbase, vbase, slots + start, n, d, row_w, scale, acc, mx, total, acc + G * d);
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / total[g]);
    for (int64_t c = 0; c < d; c += 8)
      bf16_store8(out + g * d + c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + c), inv), 8);
  }
}

// AttendChunkFn (split_attention.h): keys slots[0 .. n); acc [G][d], mx [G], total [G] as attend_grouped_chunk.
template <int G>
ASCENT_AVX2 void attend_grouped_avx2_chunk(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* slots,
                                           int64_t n, int64_t d, int64_t row_w, float scale, float* acc, float* mx,
                                           float* total, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(pass_work<G>(n, d)));
  grouped_pass_avx2<G>(q, kbase, vbase, slots, n, d, row_w, scale, acc, mx, total, buf.data());
}

template <int G>
GroupedAttention grouped_avx2_kernels() {
  return {attend_grouped_avx2<G>, attend_grouped_avx2_chunk<G>};
}

// The grouped AVX2 kernels for head dim d and group size (query heads per KV head): d a multiple of 16, groups of
// 1 .. 8; none otherwise (the per-head kernel is used).
GroupedAttention attend_grouped_avx2_for(int64_t d, int64_t group) {
  if (!has_avx2_fma() || d % 16 != 0 || d <= 0) return {};
  switch (group) {
    case 1: return grouped_avx2_kernels<1>();
    case 2: return grouped_avx2_kernels<2>();
    case 3: return grouped_avx2_kernels<3>();
    case 4: return grouped_avx2_kernels<4>();
    case 5: return grouped_avx2_kernels<5>();
    case 6: return grouped_avx2_kernels<6>();
    case 7: return grouped_avx2_kernels<7>();
    case 8: return grouped_avx2_kernels<8>();
    default: return {};
  }
}
