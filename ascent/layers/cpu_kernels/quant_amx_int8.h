// W8A8 (dynamic and static) on Intel AMX-INT8: every M when the CPU has it (quantization/kernels.py measures it
// against _int_mm); included by quant_gemv_cpu.cpp inside namespace ascent_quant's anonymous namespace, after
// quant_int8_blocks.h. The VNNI kernel does one VPDPBUSD per 64 weights per x row, so above ~16 rows it is
// compute-bound (30 SmolLM2 layers at M = 32: 27 ms against a 4 ms weight stream); one TDPBSSD does 16 x 16 x 64
// multiply-adds, and its 1 KiB weight tiles stream well even at M = 1 (5.6 -> 4.9 ms for those layers). x is
// quantized exactly as w8a8_dynamic_linear / w8a8_static_linear do (torch rounding), the int32 sums are exact and the
// epilogue is the same fp32 expression, so the output is bit-identical to theirs.
//
// Packed layout (w8a8_amx_pack): wp[nb][kb][r][c][t] = W[16 nb + c][64 kb + 4 r + t], int8 [N/16, K/64, 16, 64]:
// the B tile of (nb, kb) is 16 rows (K quads) of 64 bytes, contiguous per column block. Needs N % 16 == K % 64 == 0.
#pragma once

// AMX-INT8 (CPUID.7.0:EDX bit 25) on top of AMX-TILE / AMX-BF16 and the tile-state permission.
inline bool amx_int8_usable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    return ((edx >> 25) & 1) && ascent_tiles::amx_usable();
  }();
  return ok;
}

// Rows of x from which the tile kernels prefetch their weight tiles (ascent_tiles::prefetch_weight_tiles). The int8
// weights are half the bytes of bf16 ones and a small model's stay largely in a big L3, where the prefetches only
// add instructions: W8A8 dynamic, SmolLM2's 120 decode linears + lm_head, Xeon with AMX, 2 threads, interleaved, time
// with / without: M = 1 1.06-1.07x, 2 1.08x, 4 1.03x, 8 0.99x, 16 0.98x, 32 0.91x; W8A16 M = 8 0.97x, 32 0.95x.
constexpr int64_t kTilePrefetchMinRows = 8;

struct AmxI8Operands {
  const int8_t* xq;     // [M, ldx] quantized rows (zero padded to K)
  int64_t ldx;
  const int8_t* wp;     // packed [N/16, K/64, 16, 64]
  int64_t kb;           // K / 64
  int64_t n;
  const float* sx;      // dynamic: [M] per-token scales (null: static)
  const float* ws;      // dynamic: [N] weight scales; static: deq [N]
  const int32_t* qb;    // static: quant_bias [N] or null
  const float* bias;    // [N] or null
  at::ScalarType dtype;  // output: float32 / bfloat16 / float16
  void* y;              // [M, N]
};

// out[m, col .. col + 15] = y (+ bias), rounded once to the output dtype (nearest even).
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void store_y16(const AmxI8Operands& o, int64_t m,
                                                                            int64_t col, __m512 y) {
  if (o.bias) y = _mm512_add_ps(y, _mm512_loadu_ps(o.bias + col));
  const int64_t at = m * o.n + col;
  if (o.dtype == at::kFloat) {
    _mm512_storeu_ps(static_cast<float*>(o.y) + at, y);
  } else if (o.dtype == at::kBFloat16) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(o.y) + at), _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::Half*>(o.y) + at),
                        _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// y[m, n] for 16 columns, rounded once to the output dtype (nearest even): dynamic acc * sx[m] * ws[n], static
// (acc + qb[n]) * deq[n] (int32 wrap-around as the VNNI kernel); then + bias[n].
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void amx_i8_store16(const AmxI8Operands& o, int64_t m,
                                                                                 int64_t col, const int32_t* acc) {
  __m512i a = _mm512_loadu_si512(acc);
  __m512 y;
  if (o.sx) {
    y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(o.sx[m])), _mm512_loadu_ps(o.ws + col));
  } else {
    if (o.qb) a = _mm512_add_epi32(a, _mm512_loadu_si512(o.qb + col));
    y = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(o.ws + col));
  }
  store_y16(o, m, col, y);
}

// Rows [m0, m0 + rows0 + rows1) (rows1 = 0 or a second 16-row tile) of column blocks nb (and nb + 1 when blocks
// == 2); tiles configured by the caller for (rows0, rows1).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_i8_blocks(
    const AmxI8Operands& o, int64_t m0, int64_t rows0, int64_t rows1, int64_t nb, int blocks, bool prefetch,
    int32_t* scratch) {
  ascent_tiles::zero_accumulators();
  const int8_t* a0 = o.xq + m0 * o.ldx;
  const int8_t* a1 = o.xq + (m0 + 16) * o.ldx;
  const int8_t* b0 = o.wp + nb * o.kb * 1024;
  const int8_t* b1 = b0 + o.kb * 1024;
  for (int64_t k = 0; k < o.kb; ++k) {
    if (prefetch) ascent_tiles::prefetch_weight_tiles(b0, b1, k, blocks);
    _tile_loadd(0, a0 + k * 64, o.ldx);
    _tile_loadd(2, b0 + k * 1024, 64);
    _tile_dpbssd(4, 0, 2);
    if (blocks == 2) {
      _tile_loadd(3, b1 + k * 1024, 64);
      _tile_dpbssd(5, 0, 3);
    }
    if (rows1 > 0) {
      _tile_loadd(1, a1 + k * 64, o.ldx);
      _tile_dpbssd(6, 1, 2);
      if (blocks == 2) _tile_dpbssd(7, 1, 3);
    }
  }
  _tile_stored(4, scratch, 128);  // scratch [32 rows][32 cols] int32: (A0 | A1) x (B0 | B1)
  _tile_stored(5, scratch + 16, 128);
  _tile_stored(6, scratch + 16 * 32, 128);
  _tile_stored(7, scratch + 16 * 32 + 16, 128);
  for (int64_t r = 0; r < rows0 + rows1; ++r)
    for (int b = 0; b < blocks; ++b) amx_i8_store16(o, m0 + r, 16 * (nb + b), scratch + r * 32 + 16 * b);
}

// 33 to 64 rows (as amx_linear_cpu.cpp's column_block64): one column block at a time, its weight tile applied to all
// 16-row blocks of x per K step, so each weight tile is loaded once. tmm0 / tmm1 hold the full row blocks' A tiles in
// turn, tmm3 the last block's, tmm2 the weight tile, tmm4..6 / tmm7 the accumulators. W8A8 dynamic, SmolLM2's 120
// decode linears, 2 threads, ms against amx_i8_pairs (separate processes, two rounds): M = 33 5.3-5.6 vs 6.1-6.2, 48
// 6.3-6.8 vs 7.4, 64 8.4-9.9 vs 8.7-8.9. Outputs are bit-identical (the same int32 sums).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_i8_block64(
    const AmxI8Operands& o, int64_t m, int64_t nb, bool prefetch, int32_t* scratch) {
  const int64_t full = (m - 1) / 16, last = 16 * full;  // full 16-row blocks before the last one (2 or 3)
  ascent_tiles::zero_accumulators();
  const int8_t* b = o.wp + nb * o.kb * 1024;
  for (int64_t k = 0; k < o.kb; ++k) {
    if (prefetch) ascent_tiles::prefetch_weight_tiles(b, b, k, 1);
    _tile_loadd(2, b + k * 1024, 64);
    _tile_loadd(0, o.xq + k * 64, o.ldx);
    _tile_dpbssd(4, 0, 2);
    _tile_loadd(1, o.xq + 16 * o.ldx + k * 64, o.ldx);
    _tile_dpbssd(5, 1, 2);
    if (full > 2) {
      _tile_loadd(0, o.xq + 32 * o.ldx + k * 64, o.ldx);
      _tile_dpbssd(6, 0, 2);
    }
    _tile_loadd(3, o.xq + last * o.ldx + k * 64, o.ldx);
    _tile_dpbssd(7, 3, 2);
  }
  _tile_stored(4, scratch, 64);  // scratch [64 rows][16 cols] int32
  _tile_stored(5, scratch + 16 * 16, 64);
  if (full > 2) _tile_stored(6, scratch + 32 * 16, 64);
  _tile_stored(7, scratch + last * 16, 64);
  for (int64_t r = 0; r < m; ++r) amx_i8_store16(o, r, 16 * nb, scratch + r * 16);
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_i8_blocks64(
    const AmxI8Operands& o, int64_t m, int64_t nb_begin, int64_t nb_end) {
  alignas(64) int32_t scratch[64 * 16];
  const int64_t last_rows = m - (m - 1) / 16 * 16;
  const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({16, 16, 16, last_rows, 16, 16, 16, last_rows});
  ascent_tiles::load_config(cfg);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) amx_i8_block64(o, m, nb, m >= kTilePrefetchMinRows, scratch);
  _tile_release();
}

// One row of x (M = 1) on the same packed weight, without tiles: a one-row tile leaves the unit waiting on each
// weight tile from memory. Row r of the B tile of (nb, kb) holds the 16 columns' quad (4r .. 4r + 3) of K block kb,
// so VPDPBUSD against x's quad broadcast adds it to the 16 output lanes; the quad is taken as unsigned (x + 128, the
// sign bit flipped) and a second VPDPBUSD of ones against the same row sums the weights, so acc - 128 * sum is the
// int32 sum of x * w modulo 2^32, i.e. exactly the tiles' sum. A thread's column blocks are cut into kI8GemvStreams
// equal parts read side by side with a T0 prefetch kI8GemvPrefetch bytes ahead per line (the bf16 one-row kernel's
// scheme, amx_linear_cpu.cpp gemv_blocks), the blocks left over one at a time, and a thread done with its own takes
// the rest of the others' from the back (parallel_blocks.h).
constexpr int kI8GemvStreams = 4;
constexpr int64_t kI8GemvGrain = 8;  // column blocks per parallel chunk at least
constexpr int64_t kI8GemvPrefetch = 2048;

template <int S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void i8_gemv_blocks(const AmxI8Operands& o,
                                                                                         const int64_t (&nb)[S]) {
  const int8_t* tiles[S];
  __m512i acc[S], wsum[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    tiles[s] = o.wp + nb[s] * o.kb * 1024;
    acc[s] = _mm512_setzero_si512();
    wsum[s] = _mm512_setzero_si512();
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t k = 0; k < o.kb; ++k) {
    const int8_t* x_k = o.xq + 64 * k;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      int32_t quad;
      std::memcpy(&quad, x_k + 4 * r, 4);
      const __m512i xu = _mm512_set1_epi32(quad ^ static_cast<int32_t>(0x80808080u));
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const int8_t* line = tiles[s] + k * 1024 + 64 * r;
        _mm_prefetch(reinterpret_cast<const char*>(line) + kI8GemvPrefetch, _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(line);
        acc[s] = _mm512_dpbusd_epi32(acc[s], xu, w);
        wsum[s] = _mm512_dpbusd_epi32(wsum[s], ones, w);
      }
    }
  }
  alignas(64) int32_t sums[16];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    _mm512_store_si512(sums, _mm512_sub_epi32(acc[s], _mm512_slli_epi32(wsum[s], 7)));
    amx_i8_store16(o, 0, 16 * nb[s], sums);
  }
}

// One unit of parallel_blocks: the column blocks nbs[0..count) (count = kI8GemvStreams side by side, or 1).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void i8_gemv_unit(
    const AmxI8Operands& o, const int64_t (&nbs)[kI8GemvStreams], int count) {
  if (count == kI8GemvStreams) return i8_gemv_blocks<kI8GemvStreams>(o, nbs);
  const int64_t one[1] = {nbs[0]};
  i8_gemv_blocks<1>(o, one);
}

// W8A16 (per channel, no zero point) on the same tiles: x as 16-bit fixed point (quant_wo_vnni.h) in two s8 rows,
// hi and lo (x^ = 256 hi + lo); per 16-row block the accumulators hi x B0, hi x B1, lo x B0, lo x B1 hold exact int32
// sums over all of K, and y = (256 * hi + lo) * step[m] * scale[n] (+ bias) in fp32.
struct AmxFxOperands {
  const int8_t* xhi;    // [M, K]
  const int8_t* xlo;    // [M, K]
  const float* step;    // [M]
  AmxI8Operands o;      // wp, kb, n, ws = per-channel scale, bias, dtype, y (xq, sx, qb unused)
};

// y[m, col .. col + 15] = (256 * hi + lo) * step[m] * scale (+ bias) from the row's int32 sums hi / lo.
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void amx_fx_store16(const AmxFxOperands& f, int64_t m,
                                                                                 int64_t col, const int32_t* hi,
                                                                                 const int32_t* lo) {
  const __m512 h = _mm512_cvtepi32_ps(_mm512_loadu_si512(hi));
  const __m512 l = _mm512_cvtepi32_ps(_mm512_loadu_si512(lo));
  const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(h, _mm512_set1_ps(256.f), l),
                                               _mm512_set1_ps(f.step[m])), _mm512_loadu_ps(f.o.ws + col));
  store_y16(f.o, m, col, y);
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_fx_blocks(
    const AmxFxOperands& f, int64_t m0, int64_t rows, int64_t nb, int blocks, bool prefetch, int32_t* scratch) {
  const AmxI8Operands& o = f.o;
  ascent_tiles::zero_accumulators();
  const int64_t k_bytes = o.kb * 64;
  const int8_t* hi = f.xhi + m0 * k_bytes;
  const int8_t* lo = f.xlo + m0 * k_bytes;
  const int8_t* b0 = o.wp + nb * o.kb * 1024;
  const int8_t* b1 = b0 + o.kb * 1024;
  for (int64_t k = 0; k < o.kb; ++k) {
    if (prefetch) ascent_tiles::prefetch_weight_tiles(b0, b1, k, blocks);
    _tile_loadd(0, hi + k * 64, k_bytes);
    _tile_loadd(1, lo + k * 64, k_bytes);
    _tile_loadd(2, b0 + k * 1024, 64);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(6, 1, 2);
    if (blocks == 2) {
      _tile_loadd(3, b1 + k * 1024, 64);
      _tile_dpbssd(5, 0, 3);
      _tile_dpbssd(7, 1, 3);
    }
  }
  _tile_stored(4, scratch, 128);  // scratch [hi | lo][16 rows][32 cols] int32
  _tile_stored(5, scratch + 16, 128);
  _tile_stored(6, scratch + 16 * 32, 128);
  _tile_stored(7, scratch + 16 * 32 + 16, 128);
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b)
      amx_fx_store16(f, m0 + r, 16 * (nb + b), scratch + r * 32 + 16 * b, scratch + 16 * 32 + r * 32 + 16 * b);
}

// 17 to 32 rows in one pass over the weight: one column block at a time, the hi and lo rows of both 16-row blocks
// against its weight tile per K step (amx_fx_pairs takes a pass per 16 rows). Tiles: tmm0 / tmm3 the first block's hi
// / lo rows, tmm1 the second block's (rows - 16 rows; hi, then lo), tmm2 the weight, accumulators tmm4 / tmm5 (first
// block hi / lo) and tmm6 / tmm7 (second block). Bit-identical to amx_fx_pairs (the same int32 sums); SmolLM2's 120
// decode linears, 2 threads, interleaved, time against it: M = 20 0.86x, 24 0.83x, 32 0.95x.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_fx_block32(
    const AmxFxOperands& f, int64_t m, int64_t nb, bool prefetch, int32_t* scratch) {
  const AmxI8Operands& o = f.o;
  ascent_tiles::zero_accumulators();
  const int64_t k_bytes = o.kb * 64;
  const int8_t* b = o.wp + nb * o.kb * 1024;
  for (int64_t k = 0; k < o.kb; ++k) {
    if (prefetch) ascent_tiles::prefetch_weight_tiles(b, b, k, 1);
    _tile_loadd(2, b + k * 1024, 64);
    _tile_loadd(0, f.xhi + k * 64, k_bytes);
    _tile_dpbssd(4, 0, 2);
    _tile_loadd(3, f.xlo + k * 64, k_bytes);
    _tile_dpbssd(5, 3, 2);
    _tile_loadd(1, f.xhi + 16 * k_bytes + k * 64, k_bytes);
    _tile_dpbssd(6, 1, 2);
    _tile_loadd(1, f.xlo + 16 * k_bytes + k * 64, k_bytes);
    _tile_dpbssd(7, 1, 2);
  }
  _tile_stored(4, scratch, 64);  // scratch [hi | lo][32 rows][16 cols] int32
  _tile_stored(5, scratch + 32 * 16, 64);
  _tile_stored(6, scratch + 16 * 16, 64);
  _tile_stored(7, scratch + 48 * 16, 64);
  for (int64_t r = 0; r < m; ++r) amx_fx_store16(f, r, 16 * nb, scratch + r * 16, scratch + (32 + r) * 16);
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_fx_blocks32(
    const AmxFxOperands& f, int64_t m, int64_t nb_begin, int64_t nb_end) {
  alignas(64) int32_t scratch[64 * 16];
  const int64_t r1 = m - 16;
  const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({16, r1, 16, 16, 16, 16, r1, r1});
  ascent_tiles::load_config(cfg);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) amx_fx_block32(f, m, nb, m >= kTilePrefetchMinRows, scratch);
  _tile_release();
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_fx_pairs(
    const AmxFxOperands& f, int64_t m, int64_t pair_begin, int64_t pair_end) {
  alignas(64) int32_t scratch[32 * 32];
  const int64_t nblocks = f.o.n / 16;
  int64_t configured = -1;
  for (int64_t p = pair_begin; p < pair_end; ++p) {
    for (int64_t m0 = 0; m0 < m; m0 += 16) {
      const int64_t rows = std::min<int64_t>(16, m - m0);
      if (rows != configured) {
        const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({rows, rows, 16, 16, rows, rows, rows, rows});
        ascent_tiles::load_config(cfg);
        configured = rows;
      }
      amx_fx_blocks(f, m0, rows, 2 * p, 2 * p + 1 < nblocks ? 2 : 1, m >= kTilePrefetchMinRows, scratch);
    }
  }
  _tile_release();
}

// All rows for the column-block pairs [pair_begin, pair_end): each pair's weight tiles stream from memory once.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_i8_pairs(
    const AmxI8Operands& o, int64_t m, int64_t pair_begin, int64_t pair_end) {
  alignas(64) int32_t scratch[32 * 32];
  const int64_t nblocks = o.n / 16;
  int64_t configured = -1;
  for (int64_t p = pair_begin; p < pair_end; ++p) {
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
      const int64_t rows = std::min<int64_t>(32, m - m0), rows0 = std::min<int64_t>(rows, 16);
      if (rows != configured) {
        const int64_t r1 = rows - rows0;
        const ascent_tiles::TileConfig cfg = ascent_tiles::tile_config({rows0, r1, 16, 16, rows0, rows0, r1, r1});
        ascent_tiles::load_config(cfg);
        configured = rows;
      }
      amx_i8_blocks(o, m0, rows0, rows - rows0, 2 * p, 2 * p + 1 < nblocks ? 2 : 1, m >= kTilePrefetchMinRows,
                    scratch);
    }
  }
  _tile_release();
}
