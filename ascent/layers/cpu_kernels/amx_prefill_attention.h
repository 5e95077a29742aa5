// AMX causal prefill attention (bf16, head dims 32 / 64 / 128) for fused_cpu.cpp's prefill_attention. Included by
// fused_cpu.cpp inside its anonymous namespace, after amx_attention.h (ASCENT_AMX_ATTENTION, AlignedVector,
// transpose16, amx_enabled_by_environment) and avx512_prefill_attention.h (PrefillAttnArgs,
// g_prefill_attention).
//
// On an AMX Xeon torch's SDPA ran SmolLM2's prefill attention (9 heads, 3 KV heads, d 64) at 70-360 GFLOP/s: 290 us for
// a 136-token prompt, a third of the whole prefill of the throughput benchmark's prompts. Here:
//   packing: each KV head's keys once per call as K^T B tiles [16-key block][32-dim chunk][16 dim pairs][16 keys]
//            (a 16 x 16 transpose of 32-bit dim pairs) and its values as V B tiles [32-key block][16-dim block][16 key
//            pairs][16 dims][2];
//   tasks:   (KV head, block of 16 query tokens), most expensive (latest tokens) first, handed out dynamically; per
//            query head of the group, the 16 token rows are the A tiles straight from q;
//   scores:  S [16 rows][keys] = Q . K^T, two 16-key tiles in flight, stored as rows (no transposes);
//   softmax: per chunk of kChunkKeys keys, online over chunks (running max m, sum l, output rescaled by
//            exp(m_old - m_new)), in base 2 with exp2_512 (avx512_bf16.h); P rounded to bf16 (as torch's flash
//            kernel and the AVX512 kernel do for bf16), the sum taken over the unrounded values;
//   values:  O [16 rows][d] = P . V, up to four 16-dim output tiles per pass; out = O / l rounded once to bf16.
// Query i sits at position q_offset + i and sees keys j <= q_offset + i (and j > q_offset + i - window when
// window > 0); tk == q_offset + tq. Scores are exact bf16 products summed in fp32, as in the other kernels; only the
// order of the sums differs.
#pragma once

constexpr int64_t kTileRows = 16;     // query tokens per task
constexpr int64_t kChunkKeys = 256;   // keys per online-softmax chunk (scores of a chunk: 16 KiB)

// -1 (auto) or 2 (tests) on an AMX CPU, for head dims 32 / 64 / 128.
bool amx_prefill_applies(int64_t d) {
  const bool wanted = g_prefill_attention == 2 || g_prefill_attention < 0;
  return wanted && amx_enabled_by_environment() && ascent_tiles::amx_usable() && has_avx512_bf16() &&
         (d == 32 || d == 64 || d == 128);
}

// Per-thread buffers of a task (uint16 = bf16 bits).
struct AmxPrefillScratch {
  AlignedVector<float> s;       // scores [16 rows][kChunkKeys]
  AlignedVector<uint16_t> p;    // P A tiles [kChunkKeys / 32][16 rows][32 keys]
  AlignedVector<float> o;       // this chunk's P . V [16][d]
  AlignedVector<float> acc;     // running output [16][d]
  AlignedVector<uint16_t> q;    // a partial token block's query rows, zero padded [16][d]
};

// K^T and V B tiles of every KV head: kt[h][16-key block][d / 32][256 pairs], vt[h][32-key block][d / 16][512].
struct PackedKV {
  AlignedVector<uint32_t> kt;
  AlignedVector<uint16_t> vt;
  int64_t key_blocks32;  // 32-key blocks per head (keys past tk are zero rows)
};

// Row r of a 32-key block's V B tiles (D / 16 tiles of [16 key pairs][16 dims][2], tile db at tiles + db * 512) from
// the value rows of keys 2r (v0) and 2r + 1 (v1); nullptr reads as a zero row.
template <int D>
ASCENT_AVX512 inline void interleave_value_pair(const bf16* v0, const bf16* v1, uint16_t* tiles, int64_t r) {
  const __m512i even = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                        5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(16));
  for (int64_t db = 0; db < D / 16; db += 2) {  // one 32-dim chunk: output blocks db, db + 1
    const __m512i a = v0 ? _mm512_loadu_si512(v0 + db * 16) : _mm512_setzero_si512();
    const __m512i b = v1 ? _mm512_loadu_si512(v1 + db * 16) : _mm512_setzero_si512();
    _mm512_storeu_si512(tiles + db * 512 + r * 32, _mm512_permutex2var_epi16(a, even, b));
    _mm512_storeu_si512(tiles + (db + 1) * 512 + r * 32, _mm512_permutex2var_epi16(a, odd, b));
  }
}

// Packs keys and values [32 kb, 32 kb + 32) of KV head h.
template <int D>
ASCENT_AVX512 void pack_kv_block(const PrefillAttnArgs& a, int64_t h, int64_t kb, PackedKV& pk, float* block) {
  constexpr int64_t kChunks = D / 32;
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t k0 = kb * 32 + half * 16;
    uint32_t* dst = pk.kt.data() + ((h * pk.key_blocks32 * 2 + kb * 2 + half) * kChunks) * 256;
    for (int64_t c = 0; c < kChunks; ++c) {
      for (int64_t r = 0; r < 16; ++r) {
        const __m512i row = k0 + r < a.tk ? _mm512_loadu_si512(a.k + (k0 + r) * a.k_stride + h * D + c * 32)
                                          : _mm512_setzero_si512();
        _mm512_store_si512(block + r * 16, row);
      }
      transpose16(block, 16, reinterpret_cast<float*>(dst + c * 256), 16);  // bit moves only
    }
  }
  uint16_t* tiles = pk.vt.data() + (h * pk.key_blocks32 + kb) * (D / 16) * 512;
  for (int64_t r = 0; r < 16; ++r) {
    const int64_t k0 = kb * 32 + 2 * r, k1 = k0 + 1;
    const bf16* v0 = k0 < a.tk ? a.v + k0 * a.v_stride + h * D : nullptr;
    const bf16* v1 = k1 < a.tk ? a.v + k1 * a.v_stride + h * D : nullptr;
    interleave_value_pair<D>(v0, v1, tiles, r);
  }
}

// Scores of one chunk: s[r][j] = q_r . k_{c0 + j} for the chunk's 32-key blocks [kb0, kb0 + blocks); the query A
// tiles are loaded into tmm2.. from q_rows (row stride q_stride_bytes).
template <int D>
ASCENT_AMX_ATTENTION void chunk_scores(const uint16_t* q_rows, int64_t q_stride_bytes, const uint32_t* kt,
                                       int64_t kb0, int64_t blocks, float* s) {
  constexpr int64_t kChunks = D / 32;
  _tile_loadd(2, q_rows, q_stride_bytes);
  if constexpr (kChunks > 1) _tile_loadd(3, q_rows + 32, q_stride_bytes);
  if constexpr (kChunks > 2) {
    _tile_loadd(4, q_rows + 64, q_stride_bytes);
    _tile_loadd(5, q_rows + 96, q_stride_bytes);
  }
  const int64_t ld = blocks * 32 * 4;  // bytes per score row
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* k0 = kt + (kb0 + b) * 2 * kChunks * 256;
    const uint32_t* k1 = k0 + kChunks * 256;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, k0, 64);
    _tile_dpbf16ps(0, 2, 6);
    _tile_loadd(7, k1, 64);
    _tile_dpbf16ps(1, 2, 7);
    if constexpr (kChunks > 1) {
      _tile_loadd(6, k0 + 256, 64);
      _tile_dpbf16ps(0, 3, 6);
      _tile_loadd(7, k1 + 256, 64);
      _tile_dpbf16ps(1, 3, 7);
    }
    if constexpr (kChunks > 2) {
      _tile_loadd(6, k0 + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, k1 + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, k0 + 768, 64);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, k1 + 768, 64);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, s + b * 32, ld);
    _tile_stored(1, s + b * 32 + 16, ld);
  }
}

#define ASCENT_AVX512_BF16_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// Online-softmax step of one row over the chunk's keys [c0, c0 + n) (n = 32 * blocks), of which [lo, hi) are the
// row's own: P (bf16, 0 elsewhere) into the P tiles' row; returns alpha, the factor of the earlier output. Works in
// base 2: m is the running max of scale * log2(e) * s, P = 2^(scale * log2(e) * s - m) = exp(scale * s - m ln 2).
ASCENT_AVX512_BF16_FMA float chunk_softmax_row(const float* s, int64_t c0, int64_t n, int64_t lo, int64_t hi,
                                               float scale, float& m, float& l, uint16_t* p_row) {
  const int64_t a = std::max(lo, c0) - c0, b = std::min(hi, c0 + n) - c0;
  if (a >= b) {
    for (int64_t j = 0; j < n; j += 32) std::memset(p_row + j * 16, 0, 64);
    return 1.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = a & ~int64_t(15); j < b; j += 16) {
    const __mmask16 keys = static_cast<__mmask16>(lanes_below(b - j) & ~lanes_below(a - j));
    vmax = _mm512_mask_max_ps(vmax, keys, vmax, _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float alpha = m == -INFINITY ? 0.f : std::exp2(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 keys = static_cast<__mmask16>(lanes_below(b - j) & ~lanes_below(a - j));
    const __m512 e = _mm512_maskz_mov_ps(keys, exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, mv)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_row + (j / 32) * 512 + j % 32), (__m256i)_mm512_cvtneps_pbh(e));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

// o[16][D] = P . V over the chunk's 32-key blocks [kb0, kb0 + blocks): output dim blocks [db0, db0 + NB) in tmm0..
// (NB <= 4), P in tmm4, V tiles alternating in tmm5 / tmm6.
template <int D, int NB>
ASCENT_AMX_ATTENTION void chunk_values_pass(const uint16_t* p, const uint16_t* vt, int64_t kb0, int64_t blocks,
                                            int64_t db0, float* o) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* vb = vt + ((kb0 + b) * (D / 16) + db0) * 512;
    _tile_loadd(4, p + b * 512, 64);
    _tile_loadd(5, vb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, vb + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(5, vb + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, vb + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, o + db0 * 16, D * 4);
  if constexpr (NB > 1) _tile_stored(1, o + db0 * 16 + 16, D * 4);
  if constexpr (NB > 2) {
    _tile_stored(2, o + db0 * 16 + 32, D * 4);
    _tile_stored(3, o + db0 * 16 + 48, D * 4);
  }
}

// Query head `head` (of KV head h) for the token rows [t0, t0 + rows): scores, softmax and values chunk by chunk.
template <int D>
ASCENT_AMX_ATTENTION void attend_token_block(const PrefillAttnArgs& a, const PackedKV& pk, int64_t h, int64_t head,
                                             int64_t t0, int64_t rows, AmxPrefillScratch& s) {
  const int64_t first = a.q_offset + t0, hi_key = first + rows;  // positions first .. hi_key - 1
  const int64_t lo_key = a.window > 0 ? std::max<int64_t>(0, first - a.window + 1) : 0;
  const uint16_t* q_rows = reinterpret_cast<const uint16_t*>(a.q + t0 * a.q_stride + head * D);
  int64_t q_stride_bytes = a.q_stride * 2;
  if (rows < kTileRows) {  // a partial block: its rows copied, zero rows after them (no read past q)
    s.q.assign(static_cast<size_t>(kTileRows * D), 0);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(s.q.data() + r * D, q_rows + r * a.q_stride, D * 2);
    q_rows = s.q.data();
    q_stride_bytes = D * 2;
  }
  float m[kTileRows], l[kTileRows];
  std::fill(m, m + kTileRows, -INFINITY);
  std::fill(l, l + kTileRows, 0.f);
  s.acc.assign(static_cast<size_t>(kTileRows * D), 0.f);
  s.o.resize(static_cast<size_t>(kTileRows * D));
  const uint32_t* kt = pk.kt.data() + h * pk.key_blocks32 * 2 * (D / 32) * 256;
  const uint16_t* vt = pk.vt.data() + h * pk.key_blocks32 * (D / 16) * 512;
  for (int64_t c0 = lo_key & ~int64_t(31); c0 < hi_key; c0 += kChunkKeys) {
    const int64_t blocks = (std::min(hi_key, c0 + kChunkKeys) - c0 + 31) / 32, n = blocks * 32;
    chunk_scores<D>(q_rows, q_stride_bytes, kt, c0 / 32, blocks, s.s.data());
    float alpha[kTileRows];
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t pos = first + r, lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
      alpha[r] = chunk_softmax_row(s.s.data() + r * n, c0, n, lo, r < rows ? pos + 1 : lo, a.scale, m[r], l[r],
                                   s.p.data() + r * 32);
    }
    if constexpr (D == 32) chunk_values_pass<D, 2>(s.p.data(), vt, c0 / 32, blocks, 0, s.o.data());
    else chunk_values_pass<D, 4>(s.p.data(), vt, c0 / 32, blocks, 0, s.o.data());
    if constexpr (D == 128) chunk_values_pass<D, 4>(s.p.data(), vt, c0 / 32, blocks, 4, s.o.data());
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 av = _mm512_set1_ps(alpha[r]);
      for (int64_t i = 0; i < D; i += 16) {
        float* dst = s.acc.data() + r * D + i;
        _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_load_ps(dst), av, _mm512_load_ps(s.o.data() + r * D + i)));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);  // l > 0: a row always sees its own key
    bf16* out_row = a.out + (t0 + r) * a.heads * D + head * D;
    for (int64_t i = 0; i < D; i += 16)
      bf16_store(out_row + i, _mm512_mul_ps(_mm512_load_ps(s.acc.data() + r * D + i), inv), __mmask16(0xFFFF));
  }
}

// The (KV head, token block) tasks of one thread, from the shared counter (tiles configured here).
template <int D>
ASCENT_AMX_ATTENTION void run_prefill_tasks(const PrefillAttnArgs& a, const PackedKV& pk, std::atomic<int64_t>& next,
                                            int64_t row_blocks) {
  const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({16, 16, 16, 16, 16, 16, 16, 16});
  ascent_tiles::load_config(cfg);
  thread_local AmxPrefillScratch s;
  s.s.resize(static_cast<size_t>(kTileRows * kChunkKeys));
  s.p.resize(static_cast<size_t>(kChunkKeys / 32 * 512));
  const int64_t group = a.heads / a.kv_heads, tasks = a.kv_heads * row_blocks;
  for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
    const int64_t rb = row_blocks - 1 - t / a.kv_heads, h = t % a.kv_heads;
    const int64_t t0 = rb * kTileRows, rows = std::min(kTileRows, a.tq - t0);
    for (int64_t g = 0; g < group; ++g) attend_token_block<D>(a, pk, h, h * group + g, t0, rows, s);
  }
  _tile_release();
}

template <int D>
void prefill_attention_amx_d(const PrefillAttnArgs& a) {
  PackedKV pk;
  pk.key_blocks32 = (a.tk + 31) / 32;
  pk.kt.resize(static_cast<size_t>(a.kv_heads * pk.key_blocks32 * 2 * (D / 32) * 256));
  pk.vt.resize(static_cast<size_t>(a.kv_heads * pk.key_blocks32 * (D / 16) * 512));
  ascent_par::parallel_for(0, a.kv_heads * pk.key_blocks32, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float block[256];
    for (int64_t u = begin; u < end; ++u) pack_kv_block<D>(a, u / pk.key_blocks32, u % pk.key_blocks32, pk, block);
  });
  const int64_t row_blocks = (a.tq + kTileRows - 1) / kTileRows, tasks = a.kv_heads * row_blocks;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(std::max(at::get_num_threads(), 1), tasks);
  ascent_par::parallel_for(0, workers, 1, [&](int64_t, int64_t) { run_prefill_tasks<D>(a, pk, next, row_blocks); });
}

// prefill_attention on the AMX tiles (only where amx_prefill_applies(a.d)).
void prefill_attention_amx(const PrefillAttnArgs& a) {
  switch (a.d) {
    case 32: return prefill_attention_amx_d<32>(a);
    case 64: return prefill_attention_amx_d<64>(a);
    default: return prefill_attention_amx_d<128>(a);
  }
}
