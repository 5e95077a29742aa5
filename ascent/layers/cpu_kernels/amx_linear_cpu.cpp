// bf16 linear for mid-sized M (a decode batch or a speculative verification step) on Intel AMX.
//
// oneDNN's packed bf16 path costs 30-60 % more than the weight stream between M = 16 and 64 on this project's CPU,
// and the AVX512-BF16 small-M kernel (gemv_cpu.cpp) is compute-bound above M = 4. Here the weight is repacked once
// into AMX B tiles and streamed exactly once per call: for each pair of 16-column blocks of the output, every 32-deep
// K step loads the activation tiles (rows of x straight from memory, up to 16 rows per tile) and two 1 KiB weight
// tiles and issues up to four TDPBF16PS (bf16 products, fp32 accumulation).
//
// Packed layout (amx_pack): wp[nb][kb][r][c][t] = W[16 nb + c][32 kb + 2 r + t], bf16 [N/16, K/32, 16, 16, 2]: the
// VNNI B-tile of (nb, kb) is 16 rows (K pairs) of 64 bytes, contiguous per nb so one column block streams linearly.
// Requires N % 16 == 0 and K % 32 == 0 (the caller falls back otherwise).
//
// A single row of x (batch-1 decode) skips the tiles: gemv_blocks reads the same packed weight with AVX512-BF16 dot
// products, four sequential streams per thread. Every path's column blocks (or pairs) are balanced between the
// threads by stealing (parallel_blocks.h): each block's outputs do not depend on the thread that computes them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "amx_tiles.h"
#include "parallel_blocks.h"
#include "parallel_team.h"
#include "stream_prefetch.h"

namespace ascent_amx {
namespace {

constexpr int64_t kRowsPerTile = 16;
using ascent_tiles::amx_usable;
using ascent_tiles::TileConfig;

// tmm0/1 = activation rows of two 16-row blocks, tmm2/3 = weight tiles of two column blocks, tmm4..7 = accumulators
// (A0,B0) (A0,B1) (A1,B0) (A1,B1).
TileConfig make_config(int64_t rows0, int64_t rows1) {
  return ascent_tiles::tile_config({rows0, rows1, 16, 16, rows0, rows0, rows1, rows1});
}

struct Operands {
  const c10::BFloat16* x;  // [M, K] row-major (row stride ldx elements)
  int64_t ldx;
  const c10::BFloat16* wp;  // packed [N/16, K/32, 16, 32]
  int64_t kb;               // K / 32
  const float* bias;        // [N] fp32 or null
  void* y;                  // [M, N] bf16, or fp32 holding the bf16-rounded values (float_out)
  int64_t n;
  bool float_out;
};

// fp32 -> bf16 bits, nearest-even with NaN -> 0x7FC0: c10::BFloat16's conversion, 16 lanes at a time.
__attribute__((target("avx512f,avx512bw"))) inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// y[m0 + r, col0 + c] = bf16(scratch[r][c] + bias[col0 + c]) for r < rows, c < 16 * blocks (scratch rows of 32);
// with float_out the bf16 value is stored widened to fp32 (exactly what converting the bf16 output would give).
__attribute__((target("avx512f,avx512bw"))) void store_rows(const Operands& o, const float* scratch, int64_t m0,
                                                             int64_t rows, int64_t col0, int blocks) {
  for (int b = 0; b < blocks; ++b) {
    const __m512 bias = o.bias ? _mm512_loadu_ps(o.bias + col0 + 16 * b) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i bits = bf16_bits(_mm512_add_ps(_mm512_load_ps(scratch + r * 32 + 16 * b), bias));
      const int64_t at = (m0 + r) * o.n + col0 + 16 * b;
      if (o.float_out) {
        _mm512_storeu_si512(static_cast<float*>(o.y) + at, _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(o.y) + at), bits);
      }
    }
  }
}

// The weight side of the tile loop: packed bf16 tiles read in place (amx_pack). A source places the 1 KiB B tile of
// K step k of column block nb + b at tiles(nb) + b * block_bytes() + (k & step_mask()) * 1024 (a step mask of all ones
// for a whole panel, size - 1 for a ring of a power-of-two size); the loop prefetches them from memory
// (kPrefetchTiles) or calls the source before each K step of every row block (`before_step`, `first` on the pair's
// first row block) to produce them.
struct PackedTiles {
  static constexpr bool kPrefetchTiles = true;
  const Operands& o;
  const char* tiles(int64_t nb) const { return reinterpret_cast<const char*>(o.wp) + nb * o.kb * 1024; }
  int64_t block_bytes() const { return o.kb * 1024; }
  int64_t step_mask() const { return -1; }
  void before_step(int64_t /*nb*/, int /*blocks*/, bool /*first*/, int64_t /*k*/) const {}
};

// y[m0 : m0 + rows0 + rows1, 16 nb : 16 (nb + blocks)] for blocks in {1, 2} column blocks; tiles configured by the
// caller for (rows0, rows1).
template <typename Source>
__attribute__((target("amx-tile,amx-bf16"))) void column_blocks(const Operands& o, const Source& source, int64_t m0,
                                                                 int64_t rows0, int64_t rows1, int64_t nb,
                                                                 int blocks, bool first, float* scratch) {
  ascent_tiles::zero_accumulators();
  const int64_t xstride = o.ldx * 2;
  const char* a0 = reinterpret_cast<const char*>(o.x + m0 * o.ldx);
  const char* a1 = reinterpret_cast<const char*>(o.x + (m0 + kRowsPerTile) * o.ldx);
  const char* b0 = source.tiles(nb);
  const char* b1 = b0 + source.block_bytes();
  const int64_t mask = source.step_mask();
  for (int64_t k = 0; k < o.kb; ++k) {
    if (Source::kPrefetchTiles) ascent_tiles::prefetch_weight_tiles(b0, b1, k, blocks);
    source.before_step(nb, blocks, first, k);
    _tile_loadd(0, a0 + k * 64, xstride);
    _tile_loadd(2, b0 + (k & mask) * 1024, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (blocks == 2) {
      _tile_loadd(3, b1 + (k & mask) * 1024, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if (rows1 > 0) {
      _tile_loadd(1, a1 + k * 64, xstride);
      _tile_dpbf16ps(6, 1, 2);
      if (blocks == 2) _tile_dpbf16ps(7, 1, 3);
    }
  }
  // scratch [32 rows][32 cols] fp32: (A0 | A1) x (B0 | B1)
  _tile_stored(4, scratch, 128);
  _tile_stored(5, scratch + 16, 128);
  _tile_stored(6, scratch + 16 * 32, 128);
  _tile_stored(7, scratch + 16 * 32 + 16, 128);
  store_rows(o, scratch, m0, rows0 + rows1, 16 * nb, blocks);
}

// A thread's tile state over the column-block pairs it takes: the epilogue's scratch and the rows of the loaded
// configuration; the tiles are released when it goes.
struct PairTiles {
  alignas(64) float scratch[32 * 32];
  int64_t configured = -1;  // rows of the loaded configuration, -1 = none
  PairTiles() = default;
  PairTiles(const PairTiles&) = delete;
  PairTiles& operator=(const PairTiles&) = delete;
  ~PairTiles() {
    if (configured >= 0) ascent_tiles::release_tiles();
  }
};

// All rows of x for the column-block pair p: every 32-row block in turn, so the pair's weight tiles come from memory
// (or are produced) once and later row blocks find them in L1/L2. The tile configuration changes only for a partial
// last row block.
template <typename Source>
__attribute__((target("amx-tile,amx-bf16"))) void pair_rows(const Operands& o, const Source& source, int64_t m,
                                                             int64_t p, PairTiles& tiles) {
  const int64_t nblocks = o.n / 16, nb = 2 * p;
  for (int64_t m0 = 0; m0 < m; m0 += 2 * kRowsPerTile) {
    const int64_t rows = std::min<int64_t>(2 * kRowsPerTile, m - m0);
    if (rows != tiles.configured) {
      ascent_tiles::load_config(make_config(std::min(rows, kRowsPerTile), rows - std::min(rows, kRowsPerTile)));
      tiles.configured = rows;
    }
    const int64_t rows0 = std::min(rows, kRowsPerTile);
    column_blocks(o, source, m0, rows0, rows - rows0, nb, nb + 1 < nblocks ? 2 : 1, m0 == 0, tiles.scratch);
  }
}

// The column-block pairs [pair_begin, pair_end), in order.
template <typename Source>
void pair_range(const Operands& o, const Source& source, int64_t m, int64_t pair_begin, int64_t pair_end) {
  PairTiles tiles;
  for (int64_t p = pair_begin; p < pair_end; ++p) pair_rows(o, source, m, p, tiles);
}

// 33 to 64 rows of x: one column block at a time, its weight tile applied to all (three or four) 16-row blocks of x
// per K step, so each weight tile is loaded once (pair_range loads it once per 32 rows and runs a second epilogue).
// tmm0 / tmm1 hold the full row blocks' A tiles in turn, tmm3 the last (possibly partial) block's, tmm2 the weight
// tile, tmm4..6 the full blocks' accumulators and tmm7 the last one's. Measured on a Xeon with AMX (SmolLM2's 120
// decode linears from DRAM, 2 threads, interleaved, time against pair_range): M = 33 0.76x, 40 0.81, 48 0.82-0.85,
// 56 0.84, 64 0.90-0.97.
constexpr int64_t kRows64 = 64;

TileConfig make_config64(int64_t m) {
  const int64_t last_rows = m - (m - 1) / 16 * 16;
  return ascent_tiles::tile_config({16, 16, 16, last_rows, 16, 16, 16, last_rows});
}

template <typename Source>
__attribute__((target("amx-tile,amx-bf16"))) void column_block64(const Operands& o, const Source& source, int64_t m,
                                                                  int64_t nb, float* scratch) {
  const int64_t last = (m - 1) / 16 * 16;  // first row of the last block: 32 or 48
  ascent_tiles::zero_accumulators();
  const int64_t xstride = o.ldx * 2;
  const char* x = reinterpret_cast<const char*>(o.x);
  const char* b = source.tiles(nb);
  const int64_t mask = source.step_mask();
  for (int64_t k = 0; k < o.kb; ++k) {
    if (Source::kPrefetchTiles) ascent_tiles::prefetch_weight_tiles(b, b, k, 1);
    source.before_step(nb, 1, true, k);
    _tile_loadd(2, b + (k & mask) * 1024, 64);
    _tile_loadd(0, x + k * 64, xstride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(1, x + 16 * xstride + k * 64, xstride);
    _tile_dpbf16ps(5, 1, 2);
    if (last == 48) {
      _tile_loadd(0, x + 32 * xstride + k * 64, xstride);
      _tile_dpbf16ps(6, 0, 2);
    }
    _tile_loadd(3, x + last * xstride + k * 64, xstride);
    _tile_dpbf16ps(7, 3, 2);
  }
  // scratch [64 rows][32 cols] fp32, the first 16 columns used
  _tile_stored(4, scratch, 128);
  _tile_stored(5, scratch + 16 * 32, 128);
  if (last == 48) _tile_stored(6, scratch + 32 * 32, 128);
  _tile_stored(7, scratch + last * 32, 128);
  store_rows(o, scratch, 0, m, 16 * nb, 1);
}

// A thread's tiles configured for 33 to 64 rows of x and the epilogue's scratch; released when it goes.
struct Block64Tiles {
  alignas(64) float scratch[kRows64 * 32];
  explicit Block64Tiles(int64_t m) { ascent_tiles::load_config(make_config64(m)); }
  Block64Tiles(const Block64Tiles&) = delete;
  Block64Tiles& operator=(const Block64Tiles&) = delete;
  ~Block64Tiles() { ascent_tiles::release_tiles(); }
};

// Column blocks [nb_begin, nb_end) of 33 to 64 rows of x.
template <typename Source>
void block_range64(const Operands& o, const Source& source, int64_t m, int64_t nb_begin, int64_t nb_end) {
  Block64Tiles tiles(m);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) column_block64(o, source, m, nb, tiles.scratch);
}

// One row of x (M = 1) on the same packed weight, without tiles: a tile of one row wastes the unit. Row r of the VNNI
// B tile of (nb, kb) holds the 16 columns' pair (2r, 2r + 1) of K block kb, so one VDPBF16PS against x's pair
// broadcast adds it to the 16 output lanes; four accumulators per column block over the tile rows. A thread's column
// blocks are one contiguous stretch of wp, cut into kGemvStreams equal parts read side by side (block i of every
// part in one pass, each part a sequential stream with a T0 prefetch kGemvPrefetch bytes ahead per 64-byte line);
// the blocks left over go one at a time (a thread done with its own then takes the rest of another's from the
// back, parallel_blocks.h). One stream per thread leaves the memory system idle between its
// prefetches, as on Zen 3 (gemv_avx2.h). Measured on a Xeon with AMX (SmolLM2's 120 decode linears + lm_head from
// DRAM, 2 threads, alternated in one process, GB/s against the one-stream sweep with T0 2 KiB + T2 8 KiB
// prefetches): 2 streams 1.065x, 3 1.12x, 4 1.10-1.15x, 6 1.09x, 8 0.91x; with 4 streams a T0 prefetch alone at
// 1-2 KiB beat T0 + T2 (1.15 against 1.10x), no prefetch 1.04x, T0 at 4 KiB 1.11x. Each block's sums run in the
// one-stream order, so the output does not depend on the streams.
constexpr int kGemvStreams = 4;
constexpr int64_t kGemvPrefetch = 2048;

// x [1, K] against the S column blocks nb[0..S), out[s] = their 16 fp32 sums (before bias and rounding).
template <int S>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void gemv_column_blocks(const Operands& o,
                                                                                const int64_t (&nb)[S],
                                                                                float (*out)[16]) {
  const char* x_pairs = reinterpret_cast<const char*>(o.x);
  const char* tiles[S];
  __m512 acc[S][4];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    tiles[s] = reinterpret_cast<const char*>(o.wp + nb[s] * o.kb * 512);
    for (int a = 0; a < 4; ++a) acc[s][a] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < o.kb; ++k) {
    const char* x_k = x_pairs + 64 * k;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      int32_t x_pair;
      std::memcpy(&x_pair, x_k + 4 * r, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x_pair);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const char* line = tiles[s] + k * 1024 + 64 * r;
        _mm_prefetch(line + kGemvPrefetch, _MM_HINT_T0);
        acc[s][r & 3] = _mm512_dpbf16_ps(acc[s][r & 3], (__m512bh)_mm512_loadu_si512(line), xb);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
    _mm512_store_ps(out[s], _mm512_add_ps(_mm512_add_ps(acc[s][0], acc[s][1]), _mm512_add_ps(acc[s][2], acc[s][3])));
}

// One unit of parallel_blocks: the column blocks nbs[0..count) (count = kGemvStreams side by side, or 1).
struct GemvSums {
  alignas(64) float v[kGemvStreams][16];
};

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void gemv_blocks(const Operands& o,
                                                                         const int64_t (&nbs)[kGemvStreams],
                                                                         int count, GemvSums& sums) {
  if (count == kGemvStreams) {
    gemv_column_blocks<kGemvStreams>(o, nbs, sums.v);
  } else {
    const int64_t one[1] = {nbs[0]};
    gemv_column_blocks<1>(o, one, sums.v);
  }
  for (int s = 0; s < count; ++s) store_rows(o, sums.v[s], 0, 1, 16 * nbs[s], 1);
}

}  // namespace

bool amx_available() { return amx_usable(); }

namespace {

// The B tiles' position order: W [N, K] -> [N/16, K/32, 16 (K pairs r), 32 (p = 2 c + t)], element W[16 nb + c][32 kb +
// 2 r + t] (N % 16 == K % 32 == 0).
torch::Tensor tile_positions(const torch::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1);
  return w.contiguous().view({n / 16, 16, k / 32, 16, 2}).permute({0, 2, 3, 1, 4}).reshape({n / 16, k / 32, 16, 32});
}

// A linear's bf16 input as rows [M, K], its fp32 bias [N] (undefined when absent) and the output's sizes (x's with
// the last dim N), after the checks the AMX linears share.
struct LinearIo {
  torch::Tensor x, bias;
  std::vector<int64_t> out_sizes;
};

LinearIo linear_io(const char* name, const torch::Tensor& x_in, int64_t k, int64_t n,
                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1, name,
              ": x must be a bf16 CPU tensor");
  TORCH_CHECK(x_in.size(-1) == k, name, ": x last dim ", x_in.size(-1), " != K = ", k);
  LinearIo io{x_in.reshape({-1, k}).contiguous(), torch::Tensor(), x_in.sizes().vec()};
  io.out_sizes.back() = n;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, name, ": bias must have N = ", n, " elements");
    io.bias = bias->to(at::kFloat).contiguous();
  }
  return io;
}

}  // namespace

// W bf16 [N, K] -> the packed layout above.
torch::Tensor amx_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "amx_pack: weight must be a bf16 CPU tensor [N, K]");
  TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 32 == 0, "amx_pack: needs N % 16 == 0 and K % 32 == 0, got ",
              w.sizes());
  return tile_positions(w).contiguous();
}

// Whether one row of x takes gemv_blocks (AVX512-BF16 dot products; every AMX-BF16 CPU so far, checked anyway).
bool one_row_dots() {
  static const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
  return bf16_dot;
}

// The weight stream amx_linear(x of m rows, wp) reads, as its parallel loop splits it (warm_ahead.h): column blocks
// of K / 32 KiB, four side-by-side parts per thread for one row, else front to back; column-block pairs up to 32 rows.
ascent_par::StreamHint amx_stream(const torch::Tensor& wp, int64_t m) {
  const int64_t blocks = wp.size(0), block_bytes = wp.size(1) * 1024;
  const char* base = static_cast<const char*>(wp.data_ptr());
  if (m == 1 && one_row_dots()) return {base, blocks, 8, block_bytes, kGemvStreams};
  if (m > 32 && m <= kRows64) return {base, blocks, 8, block_bytes, 1};
  return {base, (blocks + 1) / 2, 4, 2 * block_bytes, 1};
}

// y [M, N] = x [M, K] @ W^T (+ bias) with wp = amx_pack(W); bf16 in and out, fp32 accumulation. float_out: y is
// fp32 holding the bf16-rounded values (the same numbers as amx_linear(...).float(), without the second pass).
torch::Tensor amx_linear(const torch::Tensor& x_in, const torch::Tensor& wp,
                         const c10::optional<torch::Tensor>& bias_in, bool float_out = false) {
  TORCH_CHECK(amx_usable(), "amx_linear: AMX-BF16 is not available");
  TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 32 &&
                  wp.is_contiguous(), "amx_linear: wp must come from amx_pack");
  const int64_t n = wp.size(0) * 16, k = wp.size(1) * 32;
  const LinearIo io = linear_io("amx_linear", x_in, k, n, bias_in);
  const int64_t m = io.x.size(0);
  auto y = torch::empty({m, n}, io.x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const Operands o{io.x.data_ptr<c10::BFloat16>(), k, wp.data_ptr<c10::BFloat16>(), k / 32,
                   io.bias.defined() ? io.bias.data_ptr<float>() : nullptr, y.data_ptr(), n, float_out};
  const ascent_par::StreamHint loop = amx_stream(wp, m);  // the loop's indices and grain, as warm-ahead sees them
  const PackedTiles source{o};
  if (m == 1 && one_row_dots()) {
    ascent_par::parallel_blocks<kGemvStreams>(
        0, loop.n, loop.grain, [] { return GemvSums{}; },
        [&](GemvSums& sums, const int64_t (&nbs)[kGemvStreams], int count) { gemv_blocks(o, nbs, count, sums); });
  } else if (m > 32 && m <= kRows64) {
    ascent_par::parallel_blocks<1>(
        0, loop.n, loop.grain, [m] { return Block64Tiles(m); },
        [&](Block64Tiles& tiles, const int64_t (&nb)[1], int) { column_block64(o, source, m, nb[0], tiles.scratch); });
  } else {
    ascent_par::parallel_blocks<1>(0, loop.n, loop.grain, [] { return PairTiles(); },
                                   [&](PairTiles& tiles, const int64_t (&p)[1], int) { pair_rows(o, source, m, p[0], tiles); });
  }
  return y.view(io.out_sizes);
}

// What each thread of a team of `threads` warms ahead of amx_linear(x of m rows, wp) (warm_ahead.h), per thread
// (byte offset of its first part in wp, part bytes, parts, bytes warmed per part): for tests of the hint's layout.
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> amx_warm_plans(const torch::Tensor& wp, int64_t m,
                                                                           int64_t threads) {
  const ascent_par::StreamHint hint = amx_stream(wp, m);
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> plans;
  for (int64_t tid = 0; tid < threads; ++tid) {
    const ascent_par::WarmPlan plan = ascent_par::warm_plan(hint, tid, threads);
    plans.emplace_back(plan.limit > 0 ? plan.first - hint.base : -1, plan.part_bytes, plan.parts, plan.limit);
  }
  return plans;
}

// What parallel_blocks<S> (S = 1 or kGemvStreams) does with the blocks [0, n), for tests of its balancing: per
// block (times taken, torch thread number that took it, size of its unit). The thread of chunk 0 sleeps pause_us
// before each of its units, so the others must take the rest of its chunk.
std::vector<std::tuple<int64_t, int64_t, int64_t>> parallel_blocks_trace(int64_t n, int64_t grain, int64_t streams,
                                                                          int64_t pause_us) {
  TORCH_CHECK(n >= 0 && (streams == 1 || streams == kGemvStreams), "parallel_blocks_trace: bad n or streams");
  std::vector<std::atomic<int64_t>> taken(n);
  std::vector<int64_t> thread(n, -1), unit(n, 0);
  const auto visit = [&](const int64_t* idx, int count) {
    if (at::get_thread_num() == 0 && pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    for (int s = 0; s < count; ++s) {
      taken[idx[s]].fetch_add(1);
      thread[idx[s]] = at::get_thread_num();
      unit[idx[s]] = count;
    }
  };
  const auto no_state = [] { return 0; };
  if (streams == 1) {
    ascent_par::parallel_blocks<1>(0, n, grain, no_state, [&](int, const int64_t (&i)[1], int c) { visit(i, c); });
  } else {
    ascent_par::parallel_blocks<kGemvStreams>(0, n, grain, no_state,
                                              [&](int, const int64_t (&i)[kGemvStreams], int c) { visit(i, c); });
  }
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (int64_t b = 0; b < n; ++b) out.emplace_back(taken[b].load(), thread[b], unit[b]);
  return out;
}

#include "amx_wo_linear.h"

}  // namespace ascent_amx

#ifndef ASCENT_EMBEDDED_KERNELS  // decode_stack_cpu.cpp includes this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace ascent_amx;
  m.def("amx_available", &amx_available, "amx_available() -> whether AMX-BF16 can be used");
  m.def("amx_pack", &amx_pack, "amx_pack(W bf16 [N, K]) -> packed B tiles [N/16, K/32, 16, 32]");
  m.def("amx_linear", &amx_linear, "amx_linear(x bf16 [..., K], wp, bias, float_out=False) -> bf16 (or fp32) [..., N]",
        py::arg("x"), py::arg("wp"), py::arg("bias"), py::arg("float_out") = false);
  m.def("amx_warm_plans", &amx_warm_plans, "amx_warm_plans(wp, m, threads) -> per thread (first byte offset or -1, "
        "part bytes, parts, bytes warmed per part) of the decode stack's warm-ahead");
  m.def("parallel_blocks_trace", &parallel_blocks_trace, "parallel_blocks_trace(n, grain, streams, pause_us) -> per "
        "block (times taken, thread, unit size) of parallel_blocks, chunk 0's thread pausing before each unit");
  m.def("amx_w4_pack", &amx_w4_pack, "amx_w4_pack(q int8 [N, K], scale fp32 [N, G], zero fp32 [N, G] | None) -> "
        "(nib uint8 [N/16, K/32, 16, 16], coef fp32 [N/16, G, 2, 16])");
  m.def("amx_w8_pack", &amx_w8_pack, "amx_w8_pack(q int8 [N, K], scale fp32 [N, G], zero fp32 [N, G] | None) -> "
        "(q tiles int8 [N/16, K/32, 16, 32], coef fp32 [N/16, G, 2, 16])");
  m.def("amx_wo_linear", &amx_wo_linear, "amx_wo_linear(x bf16 [..., K], tiles, coef, bias) -> bf16 [..., N]");
}
#endif  // ASCENT_EMBEDDED_KERNELS
