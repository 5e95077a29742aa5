// Weight-only int4 / int8 linears (per-group or per-channel scales and zero points) for mid-sized M on AMX-BF16;
// included by amx_linear_cpu.cpp inside namespace ascent_amx, after its tile loop.
//
// The row-interleaved VNNI kernels (quant_wo_nv.h) do one VPDPWSSD per 32 (int4) or 16 (int8) weights per x row, so
// from ~8 rows on they are compute-bound, while on an AMX CPU the bf16 weight runs on tiles: at M = 32 a W4A16 decode
// step took about twice bf16's. Here each column-block pair's integer tiles are dequantized to bf16 VNNI B tiles one
// K step before the step that loads them (into a per-thread panel: a 4-step ring when x has at most 32 rows, else the
// whole [2, K/32, 16, 32] bf16 panel, which the later 32-row blocks of x reuse) and multiplied with TDPBF16PS exactly
// as the bf16 weight is (column_blocks). The dequantized value is the dense bf16 weight of the dequantize-once path,
// (q - zero) * scale in fp32 rounded to nearest even (VCVTNE2PS2BF16, which flushes fp32 denormal values to zero), so
// the output is amx_linear's on that weight, bit for bit.
//
// Measured on a Xeon with AMX (SmolLM2's 120 decode linears, group 64, 2 threads, interleaved medians, ms; int4
// here | amx_linear on the bf16 weight | the row-interleaved W4A16 kernel): M = 4: 6.3 | 7.9 | 4.5; 8: 6.4 | 8.2 |
// 6.4; 16: 6.9 | 8.3 | 10.6; 32: 8.1 | 8.7 | 18.7; 64: 13.0 | 12.6 | 35.1; 128: 19.2 | 20.2 | -; 256: 33.5 | 35.0 |
// -; int8 group 64 here | the row-interleaved W8A16 kernel: M = 16: 6.8 | 11.6; 32: 8.0 | 19.5; 64: 12.6 | 37.0. The
// dequantization, about 8 ALU operations per 32 weights, is most of the time.
//
// Packed layouts. int4 (amx_w4_pack): nib[nb][kb][r][j], uint8 [N/16, K/32, 16, 16]. Row r of the B tile of (nb, kb)
// has the 32 positions p = 2 c + t <-> W[16 nb + c][32 kb + 2 r + t]; byte j holds u(p = j) in its low nibble and
// u(p = 16 + j) in its high one, u = q + 8 in [0, 15]: one zero-extending load of 16 bytes gives both halves' 16
// lanes. int8 (amx_w8_pack): q[nb][kb][r][p], int8 [N/16, K/32, 16, 32], the positions in order. coef[nb][g][2][16]
// fp32: the scales s[16 nb + c, g] of the block's 16 columns, then their offsets (int4: 8 + zero, int8: zero);
// W = (u - offset) * scale. Needs N % 16 == 0, groups of a multiple of 32 columns (K % (32 G) == 0) and, for int4,
// integer zero points.
#pragma once

namespace {

// Prefetch distances ahead of the tile being dequantized: its column block's values are one contiguous stream (T0
// 4 tiles and T1 32 tiles ahead: for int4 1 and 8 KiB), its coefficients another (T0 two groups ahead). With the hardware prefetchers
// alone the nibble and coefficient loads waited on memory: SmolLM2's 120 decode linears, group 64, M = 4, Xeon with
// AMX, 2 threads: 8.5 ms without, 6.3-7.2 with (noisy VM; T0 only at 1-2 KiB 7.7-10.4).
constexpr int64_t kNibblePrefetchNear = 1024;
constexpr int64_t kNibblePrefetchFar = 8192;
constexpr int64_t kCoefPrefetchAhead = 256;
// K steps of dequantized tiles kept when the tiles pass over the weight once (up to 64 rows of x; the panel then only
// has to outlive the tile loads one step later): 8 KiB that stay in L1 instead of a whole panel whose lines are
// written once from L2. A power of two (the tile loop masks the step).
constexpr int64_t kRingSteps = 4;

#define ASCENT_WO_DEQUANT __attribute__((target("avx512f,avx512bw,avx512bf16")))

// A tile's group coefficients (coef: 16 scales, 16 offsets) spread over the tile row's positions: positions 0..15 are
// columns 0..7 (two K rows each), positions 16..31 columns 8..15. Also prefetches the tile source ahead: `lines`
// 64-byte lines per tile (its column block's values are one contiguous stream) and the coefficients.
struct RowCoefficients {
  __m512 scale_lo, scale_hi, offset_lo, offset_hi;
};

ASCENT_WO_DEQUANT inline RowCoefficients row_coefficients(const uint8_t* src, int lines, const float* coef) {
  const char* stream = reinterpret_cast<const char*>(src);
  for (int line = 0; line < lines; ++line) {
    _mm_prefetch(stream + lines / 4 * kNibblePrefetchNear + 64 * line, _MM_HINT_T0);
    _mm_prefetch(stream + lines / 4 * kNibblePrefetchFar + 64 * line, _MM_HINT_T1);
  }
  _mm_prefetch(reinterpret_cast<const char*>(coef) + kCoefPrefetchAhead, _MM_HINT_T0);
  const __m512i low_columns = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high_columns = _mm512_add_epi32(low_columns, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_loadu_ps(coef), offset = _mm512_loadu_ps(coef + 16);
  return {_mm512_permutexvar_ps(low_columns, scale), _mm512_permutexvar_ps(high_columns, scale),
          _mm512_permutexvar_ps(low_columns, offset), _mm512_permutexvar_ps(high_columns, offset)};
}

// One tile row: (lo - offset) * scale and (hi - offset) * scale rounded to bf16, stored as the row's 32 positions.
ASCENT_WO_DEQUANT inline void store_row(const RowCoefficients& c, __m512 lo, __m512 hi, char* dst) {
  const __m512 w_lo = _mm512_mul_ps(_mm512_sub_ps(lo, c.offset_lo), c.scale_lo);
  const __m512 w_hi = _mm512_mul_ps(_mm512_sub_ps(hi, c.offset_hi), c.scale_hi);
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

// The 16 rows of one int4 B tile: 256 nibble bytes at src -> 1 KiB of bf16 at dst.
ASCENT_WO_DEQUANT void dequant_w4_tile(const uint8_t* src, const float* coef, char* dst) {
  RowCoefficients c = row_coefficients(src, 4, coef);
  // biased as the nibbles are below: 2^23 + offset and 2^19 + offset (exact for integer offsets below 2^16)
  c.offset_lo = _mm512_add_ps(c.offset_lo, _mm512_set1_ps(8388608.f));
  c.offset_hi = _mm512_add_ps(c.offset_hi, _mm512_set1_ps(524288.f));
  const __m512i low_mask = _mm512_set1_epi32(0x0F), high_mask = _mm512_set1_epi32(0xF0);
  const __m512i magic_lo = _mm512_set1_epi32(0x4B000000), magic_hi = _mm512_set1_epi32(0x49000000);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * r)));
    // (u & mask) | magic: the floats 2^23 + low nibble (ulp 1) and 2^19 + high nibble (ulp 1/16), no conversion
    store_row(c, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(u, low_mask, magic_lo, 0xEA)),
              _mm512_castsi512_ps(_mm512_ternarylogic_epi32(u, high_mask, magic_hi, 0xEA)), dst + 64 * r);
  }
}

// The 16 rows of one int8 B tile (512 bytes in position order) -> 1 KiB of bf16 at dst: (q - zero) * scale in fp32,
// as the dequantize-once weight is computed (any zero point).
ASCENT_WO_DEQUANT void dequant_w8_tile(const uint8_t* src, const float* coef, char* dst) {
  const RowCoefficients c = row_coefficients(src, 8, coef);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m128i* row = reinterpret_cast<const __m128i*>(src + 32 * r);
    store_row(c, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))),
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), dst + 64 * r);
  }
}

// The tile loop's weight source for an int4 / int8 weight: the pair's tiles are produced into `panel` during the
// first 32-row block of x, one K step ahead of their loads, and reused by the other row blocks.
struct WoTiles {
  static constexpr bool kPrefetchTiles = false;  // the panel is produced in L1; the dequantizers prefetch their input
  const Operands& o;
  const uint8_t* packed;  // [N/16, K/32, 16, 16] nibbles (4 bits) or [N/16, K/32, 16, 32] values (8 bits)
  int64_t tile_bytes;    // 256 (4 bits) or 512
  const float* coef;     // [N/16, G, 2, 16]
  int64_t groups;        // G
  int64_t group_blocks;  // 32-column K blocks per group: K / 32 / G
  char* panel;           // this thread's: [2, steps, 16, 32] bf16
  int64_t steps;         // K steps the panel holds: K / 32 when x has more than 64 rows, else a ring of kRingSteps

  const char* tiles(int64_t /*nb*/) const { return panel; }
  int64_t block_bytes() const { return steps * 1024; }
  int64_t step_mask() const { return steps == o.kb ? -1 : steps - 1; }

  void before_step(int64_t nb, int blocks, bool first, int64_t k) const {
    if (!first) return;
    if (k == 0) dequant_step(nb, blocks, 0);
    if (k + 1 < o.kb) dequant_step(nb, blocks, k + 1);  // one step ahead of its tile loads
  }

  void dequant_step(int64_t nb, int blocks, int64_t k) const {
    const int64_t group = k / group_blocks;
    for (int b = 0; b < blocks; ++b) {
      const int64_t block = nb + b;
      const uint8_t* src = packed + (block * o.kb + k) * tile_bytes;
      const float* c = coef + (block * groups + group) * 32;
      char* dst = panel + b * block_bytes() + (k & step_mask()) * 1024;
      if (tile_bytes == 256) dequant_w4_tile(src, c, dst); else dequant_w8_tile(src, c, dst);
    }
  }
};

}  // namespace

namespace {

// The checks both pack calls make; the offsets [N, G]: `base` + zero (when given).
torch::Tensor checked_offsets(const char* name, const torch::Tensor& q, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& zero, double base) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar, name,
              ": q must be an int8 CPU tensor [N, K]");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) >= 1 && scale.scalar_type() == at::kFloat,
              name, ": scale must be fp32 [N, G], got ", scale.sizes());
  const int64_t groups = scale.size(1);
  TORCH_CHECK(n % 16 == 0 && k % (32 * groups) == 0, name,
              ": needs N % 16 == 0 and groups of a multiple of 32 columns, got N=", n, " K=", k, " G=", groups);
  torch::Tensor offset = torch::full_like(scale, base);
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->sizes() == scale.sizes(), name, ": zero must have scale's shape ", scale.sizes());
    offset = offset + zero->to(at::kFloat);
  }
  return offset;
}

// scale, offset [N, G] -> coef [N/16, G, 2, 16]: per (column block, group) the block's 16 scales, then its 16 offsets.
torch::Tensor block_coefficients(const torch::Tensor& scale, const torch::Tensor& offset) {
  const int64_t n = scale.size(0), groups = scale.size(1);
  const auto by_block = [&](const torch::Tensor& v) {
    return v.contiguous().view({n / 16, 16, groups}).permute({0, 2, 1});
  };
  return torch::stack({by_block(scale), by_block(offset)}, 2).contiguous();
}

}  // namespace

// int4 values q [N, K] (int8 in [-8, 7]), scale fp32 [N, G], zero fp32 [N, G] or empty (integers) -> (nib, coef) in
// the layout above.
std::tuple<torch::Tensor, torch::Tensor> amx_w4_pack(const torch::Tensor& q, const torch::Tensor& scale,
                                                     const c10::optional<torch::Tensor>& zero) {
  const torch::Tensor offset = checked_offsets("amx_w4_pack", q, scale, zero, 8.0);
  TORCH_CHECK(torch::equal(offset, offset.round()) && offset.abs().max().item<float>() < 65536.f,
              "amx_w4_pack: zero points must be integers of magnitude below 65536");
  TORCH_CHECK(q.min().item<int8_t>() >= -8 && q.max().item<int8_t>() <= 7,
              "amx_w4_pack: q holds values outside [-8, 7]");
  const torch::Tensor u = tile_positions((q.to(at::kShort) + 8).to(at::kByte));
  const torch::Tensor nib = u.slice(3, 0, 16).bitwise_or(u.slice(3, 16, 32).bitwise_left_shift(4)).contiguous();
  return {nib, block_coefficients(scale, offset)};
}

// int8 values q [N, K], scale fp32 [N, G], zero fp32 [N, G] or empty -> (q in tile order, int8 [N/16, K/32, 16, 32],
// coef [N/16, G, 2, 16] with the zero points as offsets).
std::tuple<torch::Tensor, torch::Tensor> amx_w8_pack(const torch::Tensor& q, const torch::Tensor& scale,
                                                     const c10::optional<torch::Tensor>& zero) {
  const torch::Tensor offset = checked_offsets("amx_w8_pack", q, scale, zero, 0.0);
  return {tile_positions(q).contiguous(), block_coefficients(scale, offset)};
}

// y [M, N] = x [M, K] @ W^T (+ bias), W the weight of amx_w4_pack / amx_w8_pack(q, scale, zero) (`tiles`, `coef`)
// dequantized to bf16; bf16 in and out, fp32 accumulation.
torch::Tensor amx_wo_linear(const torch::Tensor& x_in, const torch::Tensor& tiles, const torch::Tensor& coef,
                            const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(amx_usable() && __builtin_cpu_supports("avx512bf16"), "amx_wo_linear: AMX-BF16 is not available");
  const bool int4 = tiles.scalar_type() == at::kByte && tiles.dim() == 4 && tiles.size(3) == 16;
  const bool int8 = tiles.scalar_type() == at::kChar && tiles.dim() == 4 && tiles.size(3) == 32;
  TORCH_CHECK((int4 || int8) && tiles.size(2) == 16 && tiles.is_contiguous(),
              "amx_wo_linear: tiles must come from amx_w4_pack or amx_w8_pack");
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.dim() == 4 && coef.size(0) == tiles.size(0) &&
                  coef.size(2) == 2 && coef.size(3) == 16 && coef.is_contiguous() && tiles.size(1) % coef.size(1) == 0,
              "amx_wo_linear: coef must come from the pack call that made tiles");
  const int64_t n = tiles.size(0) * 16, k = tiles.size(1) * 32, groups = coef.size(1);
  const LinearIo io = linear_io("amx_wo_linear", x_in, k, n, bias_in);
  const int64_t m = io.x.size(0);
  auto y = torch::empty({m, n}, io.x.options());
  const Operands o{io.x.data_ptr<c10::BFloat16>(), k, nullptr, k / 32,
                   io.bias.defined() ? io.bias.data_ptr<float>() : nullptr, y.data_ptr(), n, false};
  if (m == 0) return y.view(io.out_sizes);
  // one pass over the weight per column block (up to 64 rows): a ring; else the later 32-row blocks reuse the panel
  const bool one_pass = m <= kRows64;
  const int64_t steps = one_pass ? std::min(o.kb, kRingSteps) : o.kb;
  const auto source_with = [&](std::vector<char>& panel) {
    panel.resize(static_cast<size_t>(2 * steps * 1024));
    return WoTiles{o, static_cast<const uint8_t*>(tiles.data_ptr()), tiles.size(3) * 16, coef.data_ptr<float>(),
                   groups, o.kb / groups, panel.data(), steps};
  };
  if (m > 32 && one_pass) {
    ascent_par::parallel_for(0, n / 16, 8, [&](int64_t begin, int64_t end) {
      std::vector<char> panel;
      block_range64(o, source_with(panel), m, begin, end);
    });
  } else {
    ascent_par::parallel_for(0, (n / 16 + 1) / 2, 4, [&](int64_t begin, int64_t end) {
      std::vector<char> panel;
      pair_range(o, source_with(panel), m, begin, end);
    });
  }
  return y.view(io.out_sizes);
}
