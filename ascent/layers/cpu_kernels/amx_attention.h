// AMX decode attention of fused_cpu.cpp (bf16, head dims 32 / 64 / 128). Included by fused_cpu.cpp inside its
// anonymous namespace, after avx512_bf16.h, amx_tiles.h and avx512_attention.h (DecodeAttentionCall,
// weighted_value_rows, prefetch_row).
//
// On this project's Xeon a VDPBF16PS costs as much as four fp32 FMAs (2 cycles each), and the AVX512 kernels
// (avx512_attention.h) spend ~20 cycles per (query row, head, key); one TDPBF16PS (a 16 x 32 by 32 x 16 bf16 tile
// product, ~5 ns here whatever the rows used) does 8192 multiply-adds. A unit takes up to 16 query rows that share
// their keys: the `group` query heads of one KV head, for each of T consecutive token rows of one request (a
// speculative verification step expands a request into rows with lengths len, len + 1, ...; a plain decode row is
// T = 1). Per unit:
//   scores: S^T [keys x cols] = K . Q^T, 16 keys per tile: the A tile is 16 cache rows straight from the paged cache
//           (slots of a 16-key block consecutive: one strided tile load; otherwise gathered), the B tiles Q^T in the
//           VNNI layout (built once per unit);
//   softmax: S^T transposed to rows in registers (16 x 16 blocks), fp32 softmax numerators per row over the row's own
//           keys [start_c, len_c);
//   values: O [cols x d] = P . V on fp32 FMAs (weighted_value_rows), not on tiles: a unit has few columns (3 for
//           SmolLM2's 9 / 3 heads), so a tile product would use 3 of its 16 rows after an interleave of every value
//           row into the VNNI pair layout. Each value row is read once per group of up to kFmaCols columns, split
//           into its even and odd dims by a shift and a mask (bf16 -> fp32 is exact), and each column adds p * v in
//           fp32, keys in ascending order; the sums are divided by the column's softmax total at the end. SmolLM2: 30
//           layers' caches from DRAM, 2 threads, interleaved against the tile P . V it replaced: 32 rows of 8-136
//           keys 0.74x the time, 16 rows of 300-400 keys 0.77x, 64 rows of 150-380 keys 0.90x, 1 row 0.79x; units of
//           15 columns (5 verification rows) the same time.
// Each column's result depends only on its own query, keys and values (masked keys contribute exact zeros), and its
// value sum is the same sequence of fp32 operations in any column group, so without a sliding window a row gets
// bit-identical output in any unit: verification and plain decode agree. Products are exact and sums fp32 as in the
// other kernels; only the order of the sums differs (tests compare with SDPA and with the AVX512 kernel).
#pragma once

#define ASCENT_AMX_ATTENTION __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")))

constexpr int64_t kAmxCols = 16;      // query rows per unit (columns of S^T)
constexpr int64_t kAmxScoreKeys = 16;  // keys per score tile
constexpr int64_t kAmxPairKeys = 32;   // keys per pair of score tiles (a unit's keys are padded to a multiple)
constexpr int64_t kNextUnitKeys = 32;  // key rows of the next unit prefetched (AmxAttnUnit::next_keys)
constexpr int kFmaCols = 6;            // columns per value pass: 4 accumulators per column per 64 dims fit 32 zmm
int g_amx_attention = 1;               // tests: 0 = the AVX512 kernels only

// One unit's operands: column c's query row q[c] (d elements), output row out[c], keys [start[c], len[c]).
struct AmxAttnUnit {
  const bf16* q[kAmxCols];
  bf16* out[kAmxCols];
  int32_t start[kAmxCols];
  int32_t len[kAmxCols];
  int64_t cols;
  const int64_t* slots;  // cache slot of every position below max(len) (the unit's longest row)
  const bf16* kbase;     // the KV head's first element in the K / V halves of the cache
  const bf16* vbase;
  int64_t row_w;         // elements per cache slot
  // The key rows this thread's next unit starts with (next_keys of them at next_slots from next_kbase; none for the
  // last unit): prefetched once this unit's own keys are loaded, so their misses overlap its softmax and P . V.
  // SmolLM2 shapes, 30 layers from DRAM, 2 threads, interleaved: 0.91-0.97x the time at 16-64 rows, 0.97x at 1 row.
  const int64_t* next_slots = nullptr;
  const bf16* next_kbase = nullptr;
  int64_t next_keys = 0;
};

// Cache-line aligned storage: 64-byte vector stores and tile rows then never split across lines.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// Per-thread buffers (uint16 = bf16 bits).
struct AmxAttnScratch {
  AlignedVector<uint32_t> qt;  // Q^T B tiles [d / 32][16 pairs][16 cols] (bf16 pairs)
  AlignedVector<uint16_t> kg;  // gathered K rows of two score tiles [2][16][d]
  AlignedVector<float> st;     // S^T [keys][16]
  AlignedVector<float> e;      // softmax numerators [cols][keys]
  AlignedVector<float> o;      // O [16][d]
};

// ASCENT_CPU_AMX=0 (read once) turns the AMX kernels off, as for the AMX linear (layers/cpu_packing.py).
bool amx_enabled_by_environment() {
  static const bool on = [] {
    const char* v = std::getenv("ASCENT_CPU_AMX");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

bool amx_attention_applies(int64_t d, int64_t group) {
  return g_amx_attention && amx_enabled_by_environment() && ascent_tiles::amx_usable() && has_avx512() &&
         group <= kAmxCols && (d == 32 || d == 64 || d == 128);
}

// Whether the 16 slots from s are s[0], s[0] + 1, ..., s[0] + 15 (one strided tile load).
ASCENT_AVX512 inline bool consecutive16(const int64_t* s) {
  const __m512i base = _mm512_set1_epi64(s[0]);
  const __m512i lo = _mm512_add_epi64(base, _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i hi = _mm512_add_epi64(base, _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8));
  return _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s), lo) == 0xFF &&
         _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s + 8), hi) == 0xFF;
}

// Q^T in the VNNI B layout: pair r of 32-dim chunk ch of column c at qt[ch * 256 + r * 16 + c]; absent columns zero.
template <int D>
void amx_fill_qt(const AmxAttnUnit& u, AmxAttnScratch& s) {
  s.qt.assign(static_cast<size_t>(D / 32 * 256), 0u);
  for (int64_t c = 0; c < u.cols; ++c) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(u.q[c]);
    for (int64_t i = 0; i < D / 2; ++i) s.qt[(i / 16) * 256 + (i % 16) * 16 + c] = pairs[i];
  }
}

// The 16 cache rows of the score tile at position p0 (keys at or past `end` as zero rows): straight from the cache
// when their slots are consecutive, else gathered into `gather`. Returns the rows and sets their byte stride.
template <int D>
ASCENT_AVX512 inline const bf16* amx_key_rows(const AmxAttnUnit& u, int64_t p0, int64_t end, uint16_t* gather,
                                              int64_t& stride) {
  const int64_t valid = std::min<int64_t>(kAmxScoreKeys, end - p0);
  if (valid == kAmxScoreKeys && consecutive16(u.slots + p0)) {
    stride = u.row_w * 2;
    return u.kbase + u.slots[p0] * u.row_w;
  }
  for (int64_t j = 0; j < kAmxScoreKeys; ++j) {
    if (j < valid) std::memcpy(gather + j * D, u.kbase + u.slots[p0 + j] * u.row_w, D * 2);
    else std::memset(gather + j * D, 0, D * 2);
  }
  stride = D * 2;
  return reinterpret_cast<const bf16*>(gather);
}

// st[(j - base) * 16 + c] = q_c . k_j for positions j in [base, base + 16 * blocks) (blocks even); keys at or past
// `end` read as zero rows. Two score tiles in flight (C tiles 0 / 6, A tiles 1 / 7; Q^T in tmm2 ..).
template <int D>
ASCENT_AMX_ATTENTION void amx_scores(const AmxAttnUnit& u, int64_t base, int64_t end, int64_t blocks,
                                     AmxAttnScratch& s) {
  constexpr int kChunks = D / 32;
  const uint32_t* qt = s.qt.data();  // (the tile intrinsics take literal tile numbers)
  _tile_loadd(2, qt, 64);
  if constexpr (kChunks > 1) _tile_loadd(3, qt + 256, 64);
  if constexpr (kChunks > 2) {
    _tile_loadd(4, qt + 512, 64);
    _tile_loadd(5, qt + 768, 64);
  }
  s.st.resize(static_cast<size_t>(blocks * kAmxScoreKeys * 16));
  s.kg.resize(static_cast<size_t>(2 * kAmxScoreKeys * D));
  const int64_t last = std::min<int64_t>(end, base + blocks * kAmxScoreKeys);
  for (int64_t j = base; j < std::min<int64_t>(last, base + 2 * kAmxScoreKeys); ++j)
    prefetch_row(u.kbase + u.slots[j] * u.row_w, D);
  for (int64_t b = 0; b < blocks; b += 2) {
    // the next pair of tiles' key rows: their misses in flight while this pair computes
    for (int64_t j = base + (b + 2) * kAmxScoreKeys; j < std::min<int64_t>(last, base + (b + 4) * kAmxScoreKeys); ++j)
      prefetch_row(u.kbase + u.slots[j] * u.row_w, D);
    // this pair's value rows toward L2, for unit_values after the softmax
    for (int64_t j = base + b * kAmxScoreKeys; j < std::min<int64_t>(last, base + (b + 2) * kAmxScoreKeys); ++j)
      prefetch_row_to_l2(u.vbase + u.slots[j] * u.row_w, D);
    int64_t s0 = 0, s1 = 0;
    const bf16* k0 = amx_key_rows<D>(u, base + b * kAmxScoreKeys, end, s.kg.data(), s0);
    const bf16* k1 = amx_key_rows<D>(u, base + (b + 1) * kAmxScoreKeys, end, s.kg.data() + kAmxScoreKeys * D, s1);
    _tile_zero(0);
    _tile_zero(6);
    _tile_loadd(1, k0, s0);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(7, k1, s1);
    _tile_dpbf16ps(6, 7, 2);
    if constexpr (kChunks > 1) {
      _tile_loadd(1, k0 + 32, s0);
      _tile_dpbf16ps(0, 1, 3);
      _tile_loadd(7, k1 + 32, s1);
      _tile_dpbf16ps(6, 7, 3);
    }
    if constexpr (kChunks > 2) {
      _tile_loadd(1, k0 + 64, s0);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(7, k1 + 64, s1);
      _tile_dpbf16ps(6, 7, 4);
      _tile_loadd(1, k0 + 96, s0);
      _tile_dpbf16ps(0, 1, 5);
      _tile_loadd(7, k1 + 96, s1);
      _tile_dpbf16ps(6, 7, 5);
    }
    _tile_stored(0, s.st.data() + b * kAmxScoreKeys * 16, 64);
    _tile_stored(6, s.st.data() + (b + 1) * kAmxScoreKeys * 16, 64);
  }
}

// Lanes i < n of 16 (none for n <= 0).
inline uint32_t lanes_below(int64_t n) { return n <= 0 ? 0u : n >= 16 ? 0xFFFFu : (1u << n) - 1; }

// dst[c * ld + r] = src[r * 16 + c] for r < 16, c < cols: a 16 x 16 fp32 block transposed in registers (rows
// stored for the first `cols` columns only).
ASCENT_AVX512 void transpose16(const float* src, int64_t cols, float* dst, int64_t ld) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i + 1 of columns 4L .. 4L + 3, interleaved
    const __m512 a = _mm512_loadu_ps(src + 2 * i * 16), b = _mm512_loadu_ps(src + (2 * i + 1) * 16);
    t[2 * i] = _mm512_unpacklo_ps(a, b);
    t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + g] lane L: rows 4i .. 4i + 3 of column 4L + g
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int g = 0; g < 4; ++g) {  // columns g, 4 + g, 8 + g, 12 + g: a 4 x 4 transpose of 128-bit lanes
    const __m512 v0 = _mm512_shuffle_f32x4(u[g], u[4 + g], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 v1 = _mm512_shuffle_f32x4(u[g], u[4 + g], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + g], u[12 + g], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + g], u[12 + g], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 out[4] = {_mm512_shuffle_f32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1)),
                           _mm512_shuffle_f32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1))};
    for (int q = 0; q < 4; ++q)
      if (4 * q + g < cols) _mm512_storeu_ps(dst + (4 * q + g) * ld, out[q]);
  }
}

// Column c of st (keys [0, padded) from `base`) as row c of e, then softmax numerators in place: e = exp(scale * s -
// max) over the column's own keys, 0 elsewhere, as 2^(s * scale * log2(e) - max) with exp2_512's FMA polynomial
// (0.91-0.97x the attention's time of the unfused exp_approx polynomial it replaced). Returns the row sums.
ASCENT_AVX512_FMA void amx_softmax_rows(const AmxAttnUnit& u, int64_t base, int64_t padded, float scale,
                                        const float* st, float* e, float* total) {
  for (int64_t j = 0; j < padded; j += 16) transpose16(st + j * 16, u.cols, e + j, padded);
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t c = 0; c < u.cols; ++c) {
    float* row = e + c * padded;
    const int64_t lo = u.start[c] - base, hi = u.len[c] - base;  // the column's keys [lo, hi) of the row
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo; j < hi; j += 16)
      vmax = _mm512_max_ps(vmax, _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(hi - j),
                                                                    row + j), vscale));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 keys = static_cast<__mmask16>(lanes_below(hi - j) & ~lanes_below(lo - j));
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(keys, row + j), vscale, mx);
      const __m512 v = _mm512_maskz_mov_ps(keys, exp2_512(x));
      _mm512_storeu_ps(row + j, v);
      sum = _mm512_add_ps(sum, v);
    }
    total[c] = _mm512_reduce_add_ps(sum);
  }
}

// o [cols][D] = P . V for all of the unit's columns, kFmaCols at a time: weighted_value_rows (avx512_attention.h)
// over the keys [base, end) with the softmax numerators e (rows padded apart) as weights.
template <int D>
ASCENT_AVX512 void unit_values(const AmxAttnUnit& u, int64_t base, int64_t end, const float* e, int64_t padded,
                               float* o) {
  const int64_t* slots = u.slots + base;
  const int64_t n = end - base;
  for (int64_t c0 = 0; c0 < u.cols; c0 += kFmaCols) {
    const float* ec = e + c0 * padded;
    float* oc = o + c0 * D;
    switch (std::min<int64_t>(kFmaCols, u.cols - c0)) {
      case 1: weighted_value_rows<D, 1>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
      case 2: weighted_value_rows<D, 2>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
      case 3: weighted_value_rows<D, 3>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
      case 4: weighted_value_rows<D, 4>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
      case 5: weighted_value_rows<D, 5>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
      default: weighted_value_rows<D, kFmaCols>(ec, padded, u.vbase, slots, n, u.row_w, oc, D); break;
    }
  }
}

// One unit (tiles configured by the caller: all eight 16 rows x 64 bytes).
template <int D>
ASCENT_AMX_ATTENTION void amx_attend_unit(const AmxAttnUnit& u, float scale, AmxAttnScratch& s) {
  int64_t lo = u.start[0], end = u.len[0];
  for (int64_t c = 1; c < u.cols; ++c) {
    lo = std::min<int64_t>(lo, u.start[c]);
    end = std::max<int64_t>(end, u.len[c]);
  }
  const int64_t base = lo & ~(kAmxScoreKeys - 1);  // page-aligned score tiles
  const int64_t padded = (end - base + kAmxPairKeys - 1) / kAmxPairKeys * kAmxPairKeys;
  amx_fill_qt<D>(u, s);
  amx_scores<D>(u, base, end, padded / kAmxScoreKeys, s);
  float total[kAmxCols];
  for (int64_t j = 0; j < u.next_keys; ++j) prefetch_row(u.next_kbase + u.next_slots[j] * u.row_w, D);
  s.e.resize(static_cast<size_t>(u.cols * padded));
  amx_softmax_rows(u, base, padded, scale, s.st.data(), s.e.data(), total);
  s.o.resize(static_cast<size_t>(u.cols * D));
  unit_values<D>(u, base, end, s.e.data(), padded, s.o.data());
  for (int64_t c = 0; c < u.cols; ++c) {
    const __m512 inv = _mm512_set1_ps(1.f / total[c]);
    for (int64_t i = 0; i < D; i += 16)
      bf16_store(u.out[c] + i, _mm512_mul_ps(_mm512_loadu_ps(s.o.data() + c * D + i), inv), 0xFFFF);
  }
}

using AmxAttendFn = void (*)(const AmxAttnUnit&, float, AmxAttnScratch&);

AmxAttendFn amx_attend_for(int64_t d) {
  switch (d) {
    case 32: return amx_attend_unit<32>;
    case 64: return amx_attend_unit<64>;
    default: return amx_attend_unit<128>;
  }
}

// Runs of consecutive rows [begin, end) that share their keys: each row's slots agree with the next row's over its
// own length and lengths do not decrease (a verification step's rows of one request), at most max_rows rows.
std::vector<std::pair<int64_t, int64_t>> shared_key_runs(const int64_t* slots, const int64_t* lens, int64_t n,
                                                         int64_t L, int64_t max_rows) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t i = 0; i < n; ++i) {
    if (!runs.empty()) {
      auto& last = runs.back();
      if (last.second - last.first < max_rows && lens[i] >= lens[i - 1] &&
          std::memcmp(slots + (i - 1) * L, slots + i * L, static_cast<size_t>(lens[i - 1]) * 8) == 0) {
        last.second = i + 1;
        continue;
      }
    }
    runs.emplace_back(i, i + 1);
  }
  return runs;
}

// Units [begin, stop) of amx_decode_attention on the calling thread (configures and releases the tiles).
ASCENT_AMX_ATTENTION void amx_attention_units(const DecodeAttentionCall& a,
                                              const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t begin,
                                              int64_t stop) {
  const int64_t group = a.num_heads / a.kv_heads;
  const AmxAttendFn attend = amx_attend_for(a.d);
  const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({16, 16, 16, 16, 16, 16, 16, 16});
  ascent_tiles::load_config(cfg);
  thread_local AmxAttnScratch s;  // buffers kept per thread across calls (no allocation per layer)
  for (int64_t w = begin; w < stop; ++w) {
    const auto [r0, r1] = runs[w / a.kv_heads];
    const int64_t h = w % a.kv_heads;
    AmxAttnUnit u{};
    u.cols = (r1 - r0) * group;
    for (int64_t c = 0; c < kAmxCols; ++c) {  // unused lanes: no keys
      u.start[c] = INT32_MAX;
      u.len[c] = 0;
    }
    for (int64_t t = 0; t < r1 - r0; ++t) {
      const int64_t i = r0 + t;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t c = t * group + g, head = h * group + g;
        u.q[c] = a.qp + i * a.qs + head * a.d;
        u.out[c] = a.op + i * a.num_heads * a.d + head * a.d;
        u.len[c] = static_cast<int32_t>(a.lens[i]);
        u.start[c] = static_cast<int32_t>(a.window > 0 ? std::max<int64_t>(0, a.lens[i] - a.window) : 0);
      }
    }
    u.slots = a.sp + (r1 - 1) * a.L;
    u.kbase = a.kbase + h * a.d;
    u.vbase = a.vbase + h * a.d;
    u.row_w = a.kv_heads * a.d;
    if (w + 1 < stop) {
      const int64_t next_row = runs[(w + 1) / a.kv_heads].second - 1, next_len = a.lens[next_row];
      const int64_t first = a.window > 0 ? std::max<int64_t>(0, next_len - a.window) & ~(kAmxScoreKeys - 1) : 0;
      u.next_slots = a.sp + next_row * a.L + first;
      u.next_kbase = a.kbase + (w + 1) % a.kv_heads * a.d;
      u.next_keys = std::min<int64_t>(kNextUnitKeys, next_len - first);
    }
    attend(u, a.scale, s);
  }
  _tile_release();
}

// paged_decode_attention's bf16 work: rows grouped into shared-key runs of up to 16 / group rows, one unit per
// (run, KV head), units split over torch's intra-op threads.
void amx_decode_attention(const DecodeAttentionCall& a, int64_t n) {
  const auto runs = shared_key_runs(a.sp, a.lens, n, a.L, kAmxCols / (a.num_heads / a.kv_heads));
  ascent_par::parallel_for(0, static_cast<int64_t>(runs.size()) * a.kv_heads, 1,
                   [&](int64_t begin, int64_t stop) { amx_attention_units(a, runs, begin, stop); });
}
