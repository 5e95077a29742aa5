// Paged decode attention with long contexts split over key chunks (flash-decoding), for the grouped kernels of
// avx512_attention.h (AVX512-BF16) and avx2_attention.h (AVX2). Included by fused_cpu.cpp inside its anonymous
// namespace, after both.
//
// A (row, KV head) unit is one pass over the row's keys, so a batch of one row has only kv_heads units: SmolLM2's 3
// KV heads left the second thread idle during attention, whose key/value stream grows with the context (at 2k tokens
// it is ~1.5 MB per layer). A row with more than kSplitKeys keys is cut into ceil(keys / kSplitKeys) chunks of equal
// size (+-1 key); every chunk is a unit of its own that keeps, per query head, its max score m_c, the sum l_c of its
// exps and its unnormalised value sum a_c (fp32); the merge computes
//   out = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c,  M = max_c m_c,
// and rounds once to bf16. Whether and how a row is split depends on its own key count only, so a row's result does
// not depend on the batch it runs in. Rows up to kSplitKeys keys run the whole-context kernel as before.
#pragma once

constexpr int64_t kSplitKeys = 256;
int g_split_attention = 1;  // 0: every context in one pass (set_split_attention: tests compare both paths)

inline int64_t key_chunks(int64_t keys) {
  return g_split_attention && keys > kSplitKeys ? (keys + kSplitKeys - 1) / kSplitKeys : 1;
}

// The first key row i attends (a sliding window's start) and whether any of the n rows is split.
inline int64_t window_start(const DecodeAttentionCall& a, int64_t i) {
  return a.window > 0 ? std::max<int64_t>(0, a.lens[i] - a.window) : 0;
}

inline bool any_split(const DecodeAttentionCall& a, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (key_chunks(a.lens[i] - window_start(a, i)) > 1) return true;
  return false;
}

// One unit of work: keys [begin, end) of a row for one KV head; part >= 0 indexes its chunk result (chunks of one
// (row, head) are consecutive), -1 marks a whole context written straight to out.
struct KeyRange {
  int64_t row, head, begin, end, part, chunks;
};

// out_g = sum_c w_c a_c[g] / sum_c w_c l_c[g], w_c = exp(m_c[g] - max_c m_c[g]), for the `chunks` results at `parts`
// (each [group * d accumulators, group maxima, group sums]).
inline void merge_chunks(const float* parts, int64_t chunks, int64_t group, int64_t d, bf16* out) {
  const int64_t stride = group * d + 2 * group;
  std::vector<float> acc(static_cast<size_t>(d));
  for (int64_t g = 0; g < group; ++g) {
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, parts[c * stride + group * d + g]);
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = parts + c * stride;
      const float w = std::exp(p[group * d + g] - top);
      total += w * p[group * d + group + g];
      for (int64_t x = 0; x < d; ++x) acc[x] += w * p[g * d + x];
    }
    for (int64_t x = 0; x < d; ++x) out[g * d + x] = bf16(acc[x] / total);
  }
}

// Every (row, KV head) unit of n rows, rows with more than kSplitKeys keys in chunks; units spread over the intra-op
// threads.
void split_decode_attention(const DecodeAttentionCall& a, int64_t n, const GroupedAttention& kernels) {
  const int64_t group = a.num_heads / a.kv_heads, gd = group * a.d, row_w = a.kv_heads * a.d;
  std::vector<KeyRange> units;
  int64_t parts = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = window_start(a, i), keys = a.lens[i] - start, chunks = key_chunks(keys);
    for (int64_t h = 0; h < a.kv_heads; ++h)
      for (int64_t c = 0; c < chunks; ++c)
        units.push_back({i, h, start + c * keys / chunks, start + (c + 1) * keys / chunks,
                         chunks > 1 ? parts++ : -1, chunks});
  }
  const int64_t stride = gd + 2 * group;
  std::vector<float> results(static_cast<size_t>(parts * stride));
  const auto q_of = [&](const KeyRange& u) { return a.qp + u.row * a.qs + u.head * gd; };
  const auto out_of = [&](const KeyRange& u) { return a.op + (u.row * a.kv_heads + u.head) * gd; };
  ascent_par::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t k = begin; k < end; ++k) {
      const KeyRange& u = units[k];
      const bf16* kb = a.kbase + u.head * a.d;
      const bf16* vb = a.vbase + u.head * a.d;
      if (u.part < 0) {
        kernels.whole(q_of(u), kb, vb, a.sp + u.row * a.L, u.begin, u.end, group, a.d, row_w, a.scale, out_of(u),
                      buf);
        continue;
      }
      float* r = results.data() + u.part * stride;
      kernels.chunk(q_of(u), kb, vb, a.sp + u.row * a.L + u.begin, u.end - u.begin, a.d, row_w, a.scale, r, r + gd,
                    r + gd + group, buf);
    }
  });
  for (const KeyRange& u : units)
    if (u.part >= 0 && u.begin == window_start(a, u.row))  // the first chunk of its (row, head)
      merge_chunks(results.data() + u.part * stride, u.chunks, group, a.d, out_of(u));
}
