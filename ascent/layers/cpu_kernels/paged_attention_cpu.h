// Paged decode attention and its cache writes and slot tables (the decode step's attention). Included into
// fused_cpu.cpp after its kernels' headers.
#pragma once

// kv_cache [2, S, W] (K plane, V plane; S = num_blocks * block_size, W = kv_heads * head_size): rows k[t] and v[t]
// (each [T, W], row-strided views are fine) are copied to slot slots[t] of the K and V planes.
void paged_kv_write(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 3 && kv_cache.size(0) == 2, "kv_cache must be [2, S, W]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == kv_cache.size(2), "k/v must be [T, W] with the cache's W");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k/v must have the cache dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots must be int64 [T]");
  const int64_t rows = k.size(0), w = k.size(1), plane = kv_cache.size(1) * w, num_slots = kv_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  const size_t row_bytes = static_cast<size_t>(w) * kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = kv_cache.element_size();
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(base + sp[t] * w * es, kp + t * k.stride(0) * es, row_bytes);
    std::memcpy(base + (plane + sp[t] * w) * es, vp + t * v.stride(0) * es, row_bytes);
  }
}

namespace {

// One decode query row's heads of one KV head over keys [start, len): out = softmax(scale * q.K^T) V.
template <typename T>
void attend_kv_head(const T* q, const T* kbase, const T* vbase, const int64_t* slots, int64_t start, int64_t len,
                    int64_t group, int64_t d, int64_t row_w, float scale, T* out, std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.assign(static_cast<size_t>(group * (d + n + d)), 0.f);
  float* qf = buf.data();             // [group, d] scaled queries
  float* sc = qf + group * d;         // [group, n] scores, then probabilities
  float* acc = sc + group * n;        // [group, d] output accumulators
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < d; ++c) qf[g * d + c] = static_cast<float>(q[g * d + c]) * scale;
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kbase + slots[start + j] * row_w;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += qf[g * d + c] * static_cast<float>(kr[c]);
      sc[g * n + j] = dot;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = sc + g * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::fmax(mx, sg[j]);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = exp_approx(sg[j] - mx);
      total += sg[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vbase + slots[start + j] * row_w;
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc[g * n + j];
      float* a = acc + g * d;
      for (int64_t c = 0; c < d; ++c) a[c] += p * static_cast<float>(vr[c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < d; ++c) out[g * d + c] = static_cast<T>(acc[g * d + c]);
}

}  // namespace

// Decode attention over a paged cache: q [n, heads * d] (row-strided views are fine); kv_cache [2, S, kv_heads, d];
// slots int64 [n, L] (cache slot of each context position, L >= seq_lens[i]); seq_lens int64 [n] (>= 1); keys
// [max(0, len - window), len) when window > 0, else [0, len). GQA: query head h uses KV head h / (heads / kv_heads).
// Returns [n, heads * d] in q's dtype (fp32 softmax and accumulation): out_into when defined (see out_or_new), else a
// new tensor.
at::Tensor paged_decode_attention_into(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                                       const at::Tensor& seq_lens, int64_t num_heads, double scale, int64_t window,
                                       const at::Tensor& out_into) {
  check_rows(q, "q");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 4 && kv_cache.size(0) == 2,
              "kv_cache must be contiguous [2, S, kv_heads, d]");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(), "kv_cache must have q's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2 &&
                  slots.size(0) == q.size(0), "slots must be int64 [n, L]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0),
              "seq_lens must be int64 [n]");
  const int64_t n = q.size(0), kv_heads = kv_cache.size(2), d = kv_cache.size(3), num_slots = kv_cache.size(1);
  TORCH_CHECK(q.size(1) == num_heads * d && num_heads % kv_heads == 0, "q must be [n, heads * d]");
  const int64_t group = num_heads / kv_heads, L = slots.size(1), row_w = kv_heads * d;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= L, "seq_lens[", i, "] = ", lens[i], " outside [1, ", L, "]");
    for (int64_t j = 0; j < lens[i]; ++j)
      TORCH_CHECK(sp[i * L + j] >= 0 && sp[i * L + j] < num_slots, "slot out of range");
  }
  const at::Tensor out = out_or_new(out_into, n, num_heads * d, q);
  if (q.scalar_type() == at::kBFloat16 && amx_attention_applies(d, group)) {
    const bf16* kb = kv_cache.data_ptr<bf16>();
    amx_decode_attention({q.data_ptr<bf16>(), q.stride(0), kb, kb + num_slots * row_w, sp, L, lens, num_heads,
                          kv_heads, d, window, static_cast<float>(scale), out.data_ptr<bf16>()}, n);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kbase = kv_cache.data_ptr<scalar_t>();
    const scalar_t* vbase = kbase + num_slots * row_w;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0);
    const GroupedAttention grouped = has_avx512() ? attend_grouped_for(d, group) : attend_grouped_avx2_for(d, group);
    if constexpr (std::is_same_v<scalar_t, bf16>) {
      const DecodeAttentionCall call{as_bf16(qp), qs, as_bf16(kbase), as_bf16(vbase), sp, L, lens, num_heads,
                                     kv_heads, d, window, static_cast<float>(scale), as_bf16(op)};
      if (grouped.chunk != nullptr && any_split(call, n)) return split_decode_attention(call, n, grouped);
    }
    AttendFn attend_vec = grouped.whole;
    if (attend_vec == nullptr && has_avx512()) attend_vec = attend_avx512_for(d);
    if (attend_vec == nullptr && has_avx2_fma()) attend_vec = attend_avx2_for(d);
    // One (row, KV head) unit per chunk: a batch of one row still spreads its KV heads over the threads (SmolLM2's
    // 3 as 2 + 1; with a grain of 4 they ran on one thread while the others waited in the decode stack's team).
    // Measured on a Zen 3, the C++ decode stack alone at ~80 keys, alternated: bf16 0.953x, W4A16 0.960-0.981x.
    ascent_par::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> buf;  // kept: no allocation per call once a thread has seen its longest row
      for (int64_t u = begin; u < end; ++u) {
        const int64_t i = u / kv_heads, h = u % kv_heads;
        const int64_t start = window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0;
        if constexpr (std::is_same_v<scalar_t, bf16>) {
          if (attend_vec != nullptr) {
            attend_vec(as_bf16(qp + i * qs + h * group * d), as_bf16(kbase + h * d),
                                  as_bf16(vbase + h * d), sp + i * L, start, lens[i], group, d, row_w,
                                  static_cast<float>(scale), as_bf16(op + i * num_heads * d + h * group * d), buf);
            continue;
          }
        }
        attend_kv_head(qp + i * qs + h * group * d, kbase + h * d, vbase + h * d, sp + i * L, start, lens[i], group,
                       d, row_w, static_cast<float>(scale), op + i * num_heads * d + h * group * d, buf);
      }
    });
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                                  const at::Tensor& seq_lens, int64_t num_heads, double scale, int64_t window) {
  return paged_decode_attention_into(q, kv_cache, slots, seq_lens, num_heads, scale, window, at::Tensor());
}

// Cache slots of context positions 0..length-1: block_rows int32 [R, B] (rows of a block table, unit column stride)
// -> int64 [R, length], slot = block_rows[r, j / block_size] * block_size + j % block_size. With lens (int64 [R],
// each in [1, length]) positions j >= lens[r] take row r's slot of position 0 (padding the attention kernels never
// read); an empty lens pads nothing. One call instead of the torch ops of sdpa._context_slots (a decode step's
// metadata).
at::Tensor context_slots(const at::Tensor& block_rows, int64_t block_size, int64_t length, const at::Tensor& lens) {
  TORCH_CHECK(block_rows.scalar_type() == at::kInt && block_rows.dim() == 2 && block_rows.stride(1) == 1,
              "context_slots: block_rows must be int32 [R, B] with unit column stride");
  TORCH_CHECK(block_size >= 1 && length >= 0 && (length + block_size - 1) / block_size <= block_rows.size(1),
              "context_slots: ", length, " positions need more than the table's ", block_rows.size(1), " blocks");
  const int64_t rows = block_rows.size(0);
  const bool pad = lens.numel() > 0;
  TORCH_CHECK(!pad || (lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == rows),
              "context_slots: lens must be int64 [R] or empty");
  auto out = at::empty({rows, length}, block_rows.options().dtype(at::kLong));
  const int32_t* table = block_rows.data_ptr<int32_t>();
  const int64_t* lp = pad ? lens.data_ptr<int64_t>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* row = table + r * block_rows.stride(0);
    int64_t* o = op + r * length;
    const int64_t valid = pad ? lp[r] : length;
    TORCH_CHECK(valid >= 1 || length == 0, "context_slots: lens[", r, "] = ", valid, " is below 1");
    for (int64_t j = 0; j < std::min(valid, length); ++j)
      o[j] = static_cast<int64_t>(row[j / block_size]) * block_size + j % block_size;
    for (int64_t j = valid; j < length; ++j) o[j] = o[0];
  }
  return out;
}
