// W4A16 with 16-bit x on CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 1-3): the fixed-point scheme of
// quant_wo_vnni.h (per x row x^ = nearbyint(x / 2^e) with the same step 2^e, exact integer dot products, corrections
// -8 sum(x^) per 8-column lane, the same scale lookup and scratch buffers), with 16-bit x^ and VPMADDWD instead of
// hi / lo bytes and VPDPBUSD. Included at the end of quant_wo_vnni.h, inside ascent_quant's anonymous namespace.
//
// Weights: the packed rows as they are (byte j = u(2j) | u(2j + 1) << 4, u = q + 8), read 32 bytes = 64 columns (a
// "half" of the VNNI kernels' 64-byte chunk) at a time. Word i of such a vector holds columns 4i .. 4i + 3 in its
// four nibbles, so u_j = (v >> 4j) & 15 (j = 0..3) are 16-bit lanes of column 4i + j, and VPMADDWD(u_j, X_j) sums
// columns 8l + j and 8l + 4 + j into dword lane l: the four products cover columns 8l .. 8l + 7, the VNNI lane.
// x layout per row and half: four vectors of 16 int16, X_j word i = x^ of column 4i + j of the half (the fill is a
// 4 x 4 transpose of fp32 columns per 128-bit lane); 128 bytes per half, as many as the VNNI layout's, so the same
// scratch holds it. |u x^| <= 15 * 32639, so a lane's four pairs stay far inside int32.
// Groups are multiples of 32 columns (w4a16_linear's rule), so lanes 0-3 and lanes 4-7 of a half each lie inside one
// group: one (gs % 64 == 0) or two broadcast scales per half and row.
// Zero points (asymmetric checkpoints): y -= sum_g s z sum(x^_g) once per row and x row, from per-call group sums.
// Per 64 weights: one load, three shifts and three ANDs, four VPMADDWD, four adds, one convert and one FMA. Measured
// on a Zen 2 (2 threads, the 120 linears of a SmolLM2-135M decode step, group 64, bf16 x, DRAM-resident): 9.5 ms
// with the fp32-weight AVX2 kernel (quant_wo_avx2.h) -> 4.3-4.6 ms; single thread, L2-resident, per channel:
// 11.8 GB/s of packed weights. Tried and not kept: an added L1 prefetch 1-2 KiB ahead (the sweep 4.6 -> 6.3 ms);
// rows one at a time instead of blocks of 4 (within noise); int8 weights the same way (VPMOVSXBW + VPMADDWD: twice
// the fp32-weight row kernel's speed from L2, but 7.4-9.9 against its 6.2 ms from DRAM, so W8A16 keeps that one).
// Since then: rows whose halves each lie in one group take wo_fixed_rows64_avx2 (a group counter instead of the
// per-half lane lookup), whole row blocks run 64 rows per call (wo_fixed_span_avx2) and outputs are stored a span row
// at a time: 1 thread, L2-resident, group 64, the cores at their measured 3.36 GHz: 30.9 -> 20.5 ns per 576-column
// row (9.3 -> 13.9 GB/s packed); the 120 linears, 2 threads, DRAM-resident, interleaved in one process: 0.86x the time.
// Later tried and not kept: T0 / NTA prefetches or 2 / 8 KiB distances (1.01-1.03x).
#pragma once

#define ASCENT_WO_FIXED_AVX2 __attribute__((target("avx2,fma")))

// The blocked layout's non-temporal prefetch distance (quant_w4_layouts.h); 1.5-3 KiB were alike, 1 KiB 1.03x and
// 896 B 1.06x the time.
constexpr int64_t kBlockedPrefetch = 2048;

// A bf16 row widened to fp32 into out[0 .. k); returns max |x| (exact: a bf16 value widens exactly; inf / NaN
// compare above every finite value as integers).
ASCENT_WO_FIXED_AVX2 float bf16_row_widen_avx2(const uint16_t* p, int64_t k, float* out) {
  __m256i mx = _mm256_setzero_si256();
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), bits);
    mx = _mm256_max_epu32(mx, _mm256_and_si256(bits, magnitude));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), mx);
  uint32_t amax = *std::max_element(lanes, lanes + 8);
  for (; j < k; ++j) {
    const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
    std::memcpy(out + j, &bits, sizeof(float));
    amax = std::max(amax, bits & 0x7FFFFFFFu);
  }
  float result;
  std::memcpy(&result, &amax, sizeof(result));
  return result;
}

// x^ = nearbyint(x * inv_step) of 32 fp32 columns c0 .. c0 + 31 of a half, by word position: out[j] lane l = x^ of
// column c0 + 4 l + j (a 4 x 4 transpose in each 128-bit lane, then the lanes' rows i0 i2 i4 i6 | i1 i3 i5 i7 put in
// order).
ASCENT_WO_FIXED_AVX2 inline void transposed_x32(const float* x, __m256 inv, __m256i (&out)[4]) {
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8), c = _mm256_loadu_ps(x + 16),
               d = _mm256_loadu_ps(x + 24);
  const __m256 ab_lo = _mm256_unpacklo_ps(a, b), ab_hi = _mm256_unpackhi_ps(a, b);
  const __m256 cd_lo = _mm256_unpacklo_ps(c, d), cd_hi = _mm256_unpackhi_ps(c, d);
  const __m256 cols[4] = {_mm256_shuffle_ps(ab_lo, cd_lo, 0x44), _mm256_shuffle_ps(ab_lo, cd_lo, 0xEE),
                          _mm256_shuffle_ps(ab_hi, cd_hi, 0x44), _mm256_shuffle_ps(ab_hi, cd_hi, 0xEE)};
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int j = 0; j < 4; ++j)
    out[j] = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(cols[j], inv)), order);
}

// A row of x (fp32, zero padded to whole halves of 64 columns) into the word layout (file header) and the lanes'
// corrections corr[l] -= 8 * sum of x^ over lane l's 8 columns.
ASCENT_WO_FIXED_AVX2 void wo_fixed_fill_avx2(const float* xf, int64_t halves, float inv_step, int16_t* xw,
                                             int32_t* corr) {
  const __m256 inv = _mm256_set1_ps(inv_step);
  for (int64_t hf = 0; hf < halves; ++hf) {
    __m256i lo[4], hi[4];  // columns 4i + j of words i = 0..7, then of i = 8..15
    transposed_x32(xf + 64 * hf, inv, lo);
    transposed_x32(xf + 64 * hf + 32, inv, hi);
    __m256i sum_lo = lo[0], sum_hi = hi[0];
    for (int j = 0; j < 4; ++j) {
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo[j], hi[j]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xw + 64 * hf + 16 * j), words);
      if (j > 0) {
        sum_lo = _mm256_add_epi32(sum_lo, lo[j]);
        sum_hi = _mm256_add_epi32(sum_hi, hi[j]);
      }
    }
    const __m256i lanes = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sum_lo, sum_hi), 0xD8);  // words 2l, 2l + 1
    int32_t* c = corr + 8 * hf;
    const __m256i cur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm256_sub_epi32(cur, _mm256_slli_epi32(lanes, 3)));
  }
}

// 32 weight bytes at p, of which `left` belong to the row (a zero-padded copy when fewer than 32).
ASCENT_WO_FIXED_AVX2 inline __m256i row_bytes32(const uint8_t* p, int64_t left) {
  if (left >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint8_t part[32] = {};
  std::memcpy(part, p, static_cast<size_t>(left));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
}

// The per-group values v[group_a] in lanes 0-3 and v[group_b] in lanes 4-7 (one broadcast when they agree).
ASCENT_WO_FIXED_AVX2 inline __m256 lane_values(const float* v, int64_t group_a, int64_t group_b) {
  if (group_a == group_b) return _mm256_broadcast_ss(v + group_a);
  return _mm256_insertf128_ps(_mm256_set1_ps(v[group_a]), _mm_set1_ps(v[group_b]), 1);
}

// x^ (four word vectors) and the lanes' corrections of half hf for the MB x rows from m0 (wo_vnni_prepare's layout).
template <int MB>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void fixed_x_half(const WoVnniArgs& a, int64_t m0,
                                                                            int64_t hf, __m256i (&xv)[MB][4],
                                                                            __m256i (&c)[MB]) {
  const int16_t* xw = reinterpret_cast<const int16_t*>(a.xb);
  for (int m = 0; m < MB; ++m) {
    const int64_t at = (m0 + m) * a.nblocks * 2 + hf;  // halves of the x rows before this one, plus hf
    for (int j = 0; j < 4; ++j) xv[m][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xw + at * 64 + 16 * j));
    c[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr + at * 8));
  }
}

// y[m] += s * t_m (kGrouped; else y[m] += t_m) with t_m = sum_j u_j . X_j + c[m] = sum q x^ over the half (exact)
// for the 32 weight bytes v of one row.
template <int MB, bool kGrouped>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void fixed_accumulate(__m256i v, const __m256i (&xv)[MB][4],
                                                                                const __m256i (&c)[MB], __m256 s,
                                                                                __m256 (&y)[MB]) {
  const __m256i nib = _mm256_set1_epi16(0x000F);
  // word i of v: columns 4i .. 4i + 3, four bits each
  const __m256i u[4] = {_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                        _mm256_and_si256(_mm256_srli_epi16(v, 8), nib), _mm256_srli_epi16(v, 12)};
  for (int m = 0; m < MB; ++m) {
    const __m256i t01 = _mm256_add_epi32(_mm256_madd_epi16(u[0], xv[m][0]), _mm256_madd_epi16(u[1], xv[m][1]));
    const __m256i t23 = _mm256_add_epi32(_mm256_madd_epi16(u[2], xv[m][2]), _mm256_madd_epi16(u[3], xv[m][3]));
    const __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(t01, t23), c[m]));
    y[m] = kGrouped ? _mm256_fmadd_ps(t, s, y[m]) : _mm256_add_ps(y[m], t);
  }
}

// One 64-column half hf (32 bytes per weight row) of R weight rows against MB x rows: y[r][m] += s * t with
// t = sum_j u_j . X_j + the lanes' corrections, s the lanes' scales (grouped) or 1. kTail: the row's last, partial
// half (read through a zero-padded copy).
template <int R, int MB, bool kGrouped, bool kTail>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void fixed_half(const WoVnniArgs& a, const uint8_t* w,
                                                                          const float* const (&row_scale)[R],
                                                                          int64_t m0, int64_t hf,
                                                                          __m256 (&y)[R][MB]) {
  const int64_t off = 32 * hf;
  __m256i xv[MB][4], c[MB];
  fixed_x_half<MB>(a, m0, hf, xv, c);
  int64_t group_a = 0, group_b = 0;  // the groups of lanes 0-3 and 4-7
  if constexpr (kGrouped) {
    const int64_t b = hf / 2, lane = b * 16 + 8 * (hf % 2);
    group_a = a.first_group[b] + a.lane_group[lane];
    group_b = a.first_group[b] + a.lane_group[lane + 4];
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = w + r * a.ldw + off;
    _mm_prefetch(reinterpret_cast<const char*>(p + kWoAvx2PrefetchL2), _MM_HINT_T1);
    const __m256i v = kTail ? row_bytes32(p, a.ldw - off) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m256 s = _mm256_setzero_ps();
    if constexpr (kGrouped) s = lane_values(row_scale[r], group_a, group_b);
    fixed_accumulate<MB, kGrouped>(v, xv, c, s, y[r]);
  }
}

// sum_g s[g] * z[g] * x[g] over g < groups (s null: 1).
ASCENT_WO_FIXED_AVX2 inline float zero_term(const float* s, const float* z, const float* x, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; s && g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(z + g)), _mm256_loadu_ps(x + g), acc);
  float out = hsum_wo_avx2(acc);
  for (; g < groups; ++g) out += (s ? s[g] : 1.f) * z[g] * x[g];
  return out;
}

// The rows' results: acc[m * R + r] = 2^e * (hsum(y[r][m]) - the zero term) (per channel: times the row's scale).
template <int R, int MB, bool kGrouped, bool kZero>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void wo_fixed_finish(const WoVnniArgs& a, int64_t n,
                                                                               int64_t m0, const __m256 (&y)[R][MB],
                                                                               float* acc) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float sum = hsum_wo_avx2(y[r][m]);
      if constexpr (kZero)  // - sum_g s z sum(x^_g) (grouped; per channel z sum(x^), scaled below)
        sum -= zero_term(kGrouped ? a.scale + (n + r) * a.groups : nullptr, a.zero + (n + r) * a.groups,
                         a.group_sum + (m0 + m) * a.groups, a.groups);
      sum *= a.step[m0 + m];
      acc[m * R + r] = kGrouped ? sum : sum * a.scale[n + r];
    }
}

// wo_vnni_rows<4, R, MB, kGrouped> on AVX2: acc[m * R + r] = sum_g s[n + r, g] * (x_g . q_g - z[n + r, g] * sum(x_g))
// (kZero; else without the zero term).
template <int R, int MB, bool kGrouped, bool kZero>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void wo_fixed_rows_avx2(const WoVnniArgs& a, int64_t n,
                                                                                  int64_t m0, float* acc) {
  const uint8_t* w = a.w + n * a.ldw;
  const float* row_scale[R];
  __m256 y[R][MB];
  for (int r = 0; r < R; ++r) {
    row_scale[r] = a.scale + (n + r) * a.groups;
    for (int m = 0; m < MB; ++m) y[r][m] = _mm256_setzero_ps();
  }
  const int64_t full = a.ldw / 32;
  for (int64_t hf = 0; hf < full; ++hf) fixed_half<R, MB, kGrouped, false>(a, w, row_scale, m0, hf, y);
  if (a.ldw % 32) fixed_half<R, MB, kGrouped, true>(a, w, row_scale, m0, full, y);
  wo_fixed_finish<R, MB, kGrouped, kZero>(a, n, m0, y, acc);
}

// wo_fixed_rows_avx2 where every 64-column half lies inside one scale group (per channel, or groups of a multiple
// of 64 columns) and the rows hold whole halves: the half's group is a counter, x and the weights are read at plain
// strides, one broadcast scale serves a row's half. Measured on a Zen 2 (1 thread, L2-resident, 576-column rows,
// group 64): 31 ns per row for the general kernel (its per-half lane lookups and two-group selects) against 20 ns.
// kBlocked (R = kRowBlock): the block's rows in the blocked layout (w4a16_block_pack: per half the 4 rows' 32 bytes
// side by side, so a thread reads one sequential stream) with a non-temporal prefetch kBlockedPrefetch bytes ahead on
// AMD CPUs, the T0 1 KiB + T1 4 KiB pair elsewhere (stream_prefetch.h).
template <int R, int MB, bool kGrouped, bool kZero, bool kBlocked = false>
ASCENT_WO_FIXED_AVX2 __attribute__((always_inline)) inline void wo_fixed_rows64_avx2(const WoVnniArgs& a, int64_t n,
                                                                                    int64_t m0, float* acc) {
  static_assert(!kBlocked || R == kRowBlock, "the blocked layout holds whole row blocks");
  const int64_t halves = a.ldw / 32;
  const int64_t per_group = kGrouped ? a.group_halves : halves;
  const uint8_t* w = a.w + n * a.ldw;
  const float* scale = a.scale + n * a.groups;
  __m256 y[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[r][m] = _mm256_setzero_ps();
  int64_t g = 0, left = per_group;
  const bool nta = kBlocked && ascent_prefetch::nta_streams();
  for (int64_t hf = 0; hf < halves; ++hf) {
    __m256i xv[MB][4], c[MB];
    fixed_x_half<MB>(a, m0, hf, xv, c);
    if constexpr (kBlocked) {  // the two cache lines of this half's 128 bytes, kBlockedPrefetch ahead
      const char* here = reinterpret_cast<const char*>(w + 32 * R * hf);
      ascent_prefetch::stream_line(here, nta, kBlockedPrefetch);
      ascent_prefetch::stream_line(here + 64, nta, kBlockedPrefetch);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = kBlocked ? w + 32 * (R * hf + r) : w + r * a.ldw + 32 * hf;
      if constexpr (!kBlocked) _mm_prefetch(reinterpret_cast<const char*>(p + kWoAvx2PrefetchL2), _MM_HINT_T1);
      const __m256 s = kGrouped ? _mm256_broadcast_ss(scale + r * a.groups + g) : _mm256_setzero_ps();
      fixed_accumulate<MB, kGrouped>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), xv, c, s, y[r]);
    }
    if (kGrouped && --left == 0) {
      ++g;
      left = per_group;
    }
  }
  wo_fixed_finish<R, MB, kGrouped, kZero>(a, n, m0, y, acc);
}

// Whether wo_fixed_rows64_avx2 serves these rows (else wo_fixed_rows_avx2, whose lane lookup wo_vnni_prepare then
// fills).
bool wo_fixed_whole(const WoVnniArgs& a) { return a.ldw % 32 == 0 && (a.groups == 1 || a.group_halves > 0); }

template <bool kZero, bool kWhole>
WoVnniFn wo_fixed_row_fn(bool grouped, int64_t mb) {
  if constexpr (kWhole) {
    if (mb == 1) return grouped ? wo_fixed_rows64_avx2<1, 1, true, kZero> : wo_fixed_rows64_avx2<1, 1, false, kZero>;
    return grouped ? wo_fixed_rows64_avx2<1, 2, true, kZero> : wo_fixed_rows64_avx2<1, 2, false, kZero>;
  }
  if (mb == 1) return grouped ? wo_fixed_rows_avx2<1, 1, true, kZero> : wo_fixed_rows_avx2<1, 1, false, kZero>;
  return grouped ? wo_fixed_rows_avx2<1, 2, true, kZero> : wo_fixed_rows_avx2<1, 2, false, kZero>;
}

// The kernel of one weight row (a row block's tail).
WoVnniFn wo_fixed_row_fn(const WoVnniArgs& a, int64_t mb) {
  const bool grouped = a.groups > 1;
  if (wo_fixed_whole(a))
    return a.zero ? wo_fixed_row_fn<true, true>(grouped, mb) : wo_fixed_row_fn<false, true>(grouped, mb);
  return a.zero ? wo_fixed_row_fn<true, false>(grouped, mb) : wo_fixed_row_fn<false, false>(grouped, mb);
}

// `blocks` whole row blocks from weight row n in one call: acc[m * ld + i] for row n + i. (A call per block of 4
// rows cost ~4 ns per 576-column row on a Zen 2, 1 thread, L2-resident: 26 against 20 ns, in the return's vzeroupper
// and the caller's set-up.)
template <int MB, bool kGrouped, bool kZero, bool kWhole, bool kBlocked>
ASCENT_WO_FIXED_AVX2 void wo_fixed_span_avx2(const WoVnniArgs& a, int64_t n, int64_t blocks, int64_t ld, int64_t m0,
                                             float* acc) {
  for (int64_t b = 0; b < blocks; ++b) {
    float out[MB * kRowBlock];
    if constexpr (kWhole) wo_fixed_rows64_avx2<kRowBlock, MB, kGrouped, kZero, kBlocked>(a, n + b * kRowBlock, m0, out);
    else wo_fixed_rows_avx2<kRowBlock, MB, kGrouped, kZero>(a, n + b * kRowBlock, m0, out);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < kRowBlock; ++r) acc[m * ld + b * kRowBlock + r] = out[m * kRowBlock + r];
  }
}

using WoFixedSpanFn = void (*)(const WoVnniArgs&, int64_t, int64_t, int64_t, int64_t, float*);

template <int MB, bool kZero, bool kWhole, bool kBlocked = false>
WoFixedSpanFn wo_fixed_span_fn(bool grouped) {
  return grouped ? wo_fixed_span_avx2<MB, true, kZero, kWhole, kBlocked>
                 : wo_fixed_span_avx2<MB, false, kZero, kWhole, kBlocked>;
}

template <int MB>
WoFixedSpanFn wo_fixed_span_fn(const WoVnniArgs& a) {
  const bool grouped = a.groups > 1;
  if (a.blocked)  // (w4a16_linear_blocked checks wo_fixed_whole)
    return a.zero ? wo_fixed_span_fn<MB, true, true, true>(grouped) : wo_fixed_span_fn<MB, false, true, true>(grouped);
  if (wo_fixed_whole(a))
    return a.zero ? wo_fixed_span_fn<MB, true, true>(grouped) : wo_fixed_span_fn<MB, false, true>(grouped);
  return a.zero ? wo_fixed_span_fn<MB, true, false>(grouped) : wo_fixed_span_fn<MB, false, false>(grouped);
}

// wo_vnni_block for int4 on AVX2, any number of rows: acc [mb, rows] for weight rows [n, n + rows) and x rows
// [m0, m0 + mb) (whole blocks in one span call, the tail rows one at a time; in the blocked layout the tail rows,
// the matrix's last N % 4, are stored as rows).
void wo_fixed_block_avx2(const WoVnniArgs& a, int64_t n, int64_t rows, int64_t m0, int64_t mb, float* acc) {
  const int64_t blocks = rows / kRowBlock;
  if (blocks > 0) {
    (mb == 1 ? wo_fixed_span_fn<1>(a) : wo_fixed_span_fn<2>(a))(a, n, blocks, rows, m0, acc);
  }
  if (blocks * kRowBlock == rows) return;
  const WoVnniFn one_row = wo_fixed_row_fn(a, mb);
  for (int64_t r = blocks * kRowBlock; r < rows; ++r) {  // tail rows one at a time
    float one[kVnniMaxM];
    one_row(a, n + r, m0, one);
    for (int64_t m = 0; m < mb; ++m) acc[m * rows + r] = one[m];
  }
}

// Tests: 0 = the weight-only AVX2 kernels read one weight stream per thread (W4A16's blocked layout one block after
// the other, W8A16's fixed-point kernel row after row), the bit-identity references of their side-by-side streams.
int g_wo_streams = 1;

int64_t set_wo_streams(int64_t value) {
  const int64_t old = g_wo_streams;
  g_wo_streams = static_cast<int>(value);
  return old;
}

// Two row blocks n0 and n1 of the blocked layout (far apart) against one x row m0: wo_fixed_rows64_avx2<kRowBlock, 1,
// kGrouped, kZero, true> for both, their halves read side by side, so a thread keeps two sequential streams in flight
// (the results are that kernel's, bit for bit).
template <bool kGrouped, bool kZero>
ASCENT_WO_FIXED_AVX2 void wo_fixed_blocks2_avx2(const WoVnniArgs& a, int64_t n0, int64_t n1, int64_t m0, float* acc0,
                                                float* acc1) {
  constexpr int R = kRowBlock;
  const int64_t halves = a.ldw / 32, per_group = kGrouped ? a.group_halves : halves;
  const uint8_t* w[2] = {a.w + n0 * a.ldw, a.w + n1 * a.ldw};
  const float* scale[2] = {a.scale + n0 * a.groups, a.scale + n1 * a.groups};
  __m256 y[2][R][1];
  for (int b = 0; b < 2; ++b)
    for (int r = 0; r < R; ++r) y[b][r][0] = _mm256_setzero_ps();
  int64_t g = 0, left = per_group;
  const bool nta = ascent_prefetch::nta_streams();
  for (int64_t hf = 0; hf < halves; ++hf) {
    __m256i xv[1][4], c[1];
    fixed_x_half<1>(a, m0, hf, xv, c);
    for (int b = 0; b < 2; ++b) {
      const char* here = reinterpret_cast<const char*>(w[b] + 32 * R * hf);
      ascent_prefetch::stream_line(here, nta, kBlockedPrefetch);
      ascent_prefetch::stream_line(here + 64, nta, kBlockedPrefetch);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b) {
        const __m256 s = kGrouped ? _mm256_broadcast_ss(scale[b] + r * a.groups + g) : _mm256_setzero_ps();
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b] + 32 * (R * hf + r)));
        fixed_accumulate<1, kGrouped>(v, xv, c, s, y[b][r]);
      }
    if (kGrouped && --left == 0) {
      ++g;
      left = per_group;
    }
  }
  wo_fixed_finish<R, 1, kGrouped, kZero>(a, n0, m0, y[0], acc0);
  wo_fixed_finish<R, 1, kGrouped, kZero>(a, n1, m0, y[1], acc1);
}

// Rows [begin, end) (begin a multiple of kRowBlock) of a blocked-layout weight against one x row: two equal parts
// of whole blocks read side by side, in spans of up to kSpanRows rows per part; emit(0, n0, rows, y) takes each
// span's outputs (y[r] for row n0 + r; y may be changed in place). Returns the first row left over, for
// wo_fixed_block_avx2. Measured on a Zen 3 (2 threads, the 120 linears + head of a SmolLM2-135M decode step, group
// 64, DRAM-resident, alternating in one process): 0.93-0.95x the time of one stream; three or four streams per thread
// were 0.99-1.04x (their accumulators spill).
template <class Emit>
int64_t wo_fixed_blocked_streams(const WoVnniArgs& a, int64_t begin, int64_t end, const Emit& emit) {
  if (!g_wo_streams) return begin;
  const int64_t part = (end - begin) / (2 * kRowBlock) * kRowBlock;
  const bool grouped = a.groups > 1;
  const auto kernel = a.zero ? (grouped ? wo_fixed_blocks2_avx2<true, true> : wo_fixed_blocks2_avx2<false, true>)
                             : (grouped ? wo_fixed_blocks2_avx2<true, false> : wo_fixed_blocks2_avx2<false, false>);
  float out[2][kSpanRows];
  for (int64_t i0 = 0; i0 < part; i0 += kSpanRows) {
    const int64_t len = std::min(kSpanRows, part - i0);
    for (int64_t b = 0; b < len; b += kRowBlock)
      kernel(a, begin + i0 + b, begin + part + i0 + b, 0, out[0] + b, out[1] + b);
    emit(0, begin + i0, len, out[0]);
    emit(0, begin + part + i0, len, out[1]);
  }
  return begin + 2 * part;
}
