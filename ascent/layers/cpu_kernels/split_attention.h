// Paged decode attention with long contexts split over key chunks (flash-decoding), for the grouped AVX512-BF16
// kernels of avx512_attention.h. Included by fused_cpu.cpp inside its anonymous namespace, after avx512_attention.h.
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

// The operands of paged_decode_attention's bf16 path: q [rows, >= kv_heads * group * d] (row stride q_stride),
// K / V planes (slot rows of row_w = kv_heads * d), slots int64 [rows, L], lens [rows], out [rows, kv_heads * group *
// d].
struct DecodeAttentionRows {
  const bf16* q;
  int64_t q_stride;
  const bf16* kbase;
  const bf16* vbase;
  const int64_t* slots;
  int64_t L;
  const int64_t* lens;
  int64_t rows, kv_heads, group, d, row_w, window;
  float scale;
  bf16* out;

  int64_t start(int64_t i) const { return window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0; }
  bool any_split() const {
    for (int64_t i = 0; i < rows; ++i)
      if (key_chunks(lens[i] - start(i)) > 1) return true;
    return false;
  }
};

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

// Every (row, KV head) unit, rows with more than kSplitKeys keys in chunks; units spread over the intra-op threads.
void split_decode_attention(const DecodeAttentionRows& a, const GroupedAttention& kernels) {
  std::vector<KeyRange> units;
  int64_t parts = 0;
  for (int64_t i = 0; i < a.rows; ++i) {
    const int64_t start = a.start(i), keys = a.lens[i] - start, chunks = key_chunks(keys);
    for (int64_t h = 0; h < a.kv_heads; ++h)
      for (int64_t c = 0; c < chunks; ++c)
        units.push_back({i, h, start + c * keys / chunks, start + (c + 1) * keys / chunks,
                         chunks > 1 ? parts++ : -1, chunks});
  }
  const int64_t gd = a.group * a.d, stride = gd + 2 * a.group;
  std::vector<float> results(static_cast<size_t>(parts * stride));
  const auto q_of = [&](const KeyRange& u) { return a.q + u.row * a.q_stride + u.head * gd; };
  const auto out_of = [&](const KeyRange& u) { return a.out + (u.row * a.kv_heads + u.head) * gd; };
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t k = begin; k < end; ++k) {
      const KeyRange& u = units[k];
      const bf16* kb = a.kbase + u.head * a.d;
      const bf16* vb = a.vbase + u.head * a.d;
      if (u.part < 0) {
        kernels.whole(q_of(u), kb, vb, a.slots + u.row * a.L, u.begin, u.end, a.group, a.d, a.row_w, a.scale,
                      out_of(u), buf);
        continue;
      }
      float* r = results.data() + u.part * stride;
      kernels.chunk(q_of(u), kb, vb, a.slots + u.row * a.L + u.begin, u.end - u.begin, a.d, a.row_w, a.scale, r,
                    r + gd, r + gd + a.group, buf);
    }
  });
  for (const KeyRange& u : units)
    if (u.part >= 0 && u.begin == a.start(u.row))  // the first chunk of its (row, head)
      merge_chunks(results.data() + u.part * stride, u.chunks, a.group, a.d, out_of(u));
}
