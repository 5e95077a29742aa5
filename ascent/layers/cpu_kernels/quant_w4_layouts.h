// W4A16 weight layouts: w4a16_pack's rows (quant_gemv_cpu.cpp's header) and the blocked layout of CPUs with AVX2 but
// no AVX512-VNNI (quant_wo_fixed_avx2.h's kBlocked kernel), with its linear.
//
// w4a16_pack's rows [N, ldw] (ldw = K / 2 bytes, K a multiple of 64) regrouped per block of kRowBlock = 4 rows:
// block b holds, for each 64-column half hf, the four rows' 32 bytes of that half side by side (byte offset
// b * 4 * ldw + 32 * (4 * hf + r) for row 4b + r); the last N % 4 rows stay rows at their usual offsets. The bytes
// per row and the nibble order are unchanged, so the tensor has the row layout's shape and size.
// Why: the row kernel reads a block's 4 rows as 4 interleaved streams 1 row apart, which the hardware prefetchers
// follow poorly; in this layout a thread reads one sequential stream and a non-temporal prefetch 2 KiB ahead keeps
// it in flight. Measured on a Zen 2 (2 threads, the 120 linears of a SmolLM2-135M decode step, group 64,
// DRAM-resident, a harness with the same inner loop): 3.18-3.24 ms (rows) against 2.52-2.59 ms (this layout); the
// row layout with the same prefetch per row: 3.08-3.33 ms; this layout with a T0 prefetch 1-4 KiB ahead 3.0-3.2 ms.
// The kernels themselves (old and new built side by side, timed alternately): 3.06-3.10 -> 2.27-2.35 ms, 0.748x.
// Included into quant_gemv_cpu.cpp after w4a16_linear, inside namespace ascent_quant.
#pragma once

// int4 values int8 [N, K] (each in [-8, 7]) -> uint8 [N, ceil(K/2)] in the w4a16_linear layout (file header).
at::Tensor w4a16_pack(const at::Tensor& q) {
  check_weight(q, at::kChar);
  const int64_t n = q.size(0), k = q.size(1), kb = (k + 1) / 2;
  auto out = at::empty({n, kb}, q.options().dtype(at::kByte));
  const int8_t* src = q.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n * k; ++i)
    TORCH_CHECK(src[i] >= -8 && src[i] <= 7, "int4 value ", static_cast<int>(src[i]), " outside [-8, 7]");
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < kb; ++j) {
      const int lo = src[r * k + 2 * j] + 8, hi = 2 * j + 1 < k ? src[r * k + 2 * j + 1] + 8 : 8;
      dst[r * kb + j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  return out;
}

namespace {

// packed [N, ldw] between the row layout and the blocked one (to_blocks: rows -> blocks; else back).
at::Tensor w4a16_block_layout(const at::Tensor& packed, bool to_blocks) {
  check_weight(packed, at::kByte);
  const int64_t n = packed.size(0), ldw = packed.size(1), halves = ldw / 32;
  TORCH_CHECK(ldw % 32 == 0, "the blocked int4 layout needs K % 64 == 0, got rows of ", ldw, " bytes");
  at::Tensor out = packed.clone();  // the tail rows as they are
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  ascent_par::parallel_for(0, n / kRowBlock, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < kRowBlock; ++r)
        for (int64_t hf = 0; hf < halves; ++hf) {
          const int64_t row_at = (b * kRowBlock + r) * ldw + 32 * hf;
          const int64_t block_at = b * kRowBlock * ldw + 32 * (kRowBlock * hf + r);
          std::memcpy(dst + (to_blocks ? block_at : row_at), src + (to_blocks ? row_at : block_at), 32);
        }
  });
  return out;
}

}  // namespace

// w4a16_pack's layout -> the blocked one (file header).
at::Tensor w4a16_block_pack(const at::Tensor& packed) { return w4a16_block_layout(packed, true); }

// The blocked layout -> w4a16_pack's.
at::Tensor w4a16_block_unpack(const at::Tensor& blocked) { return w4a16_block_layout(blocked, false); }

// w4a16_linear with the weight in the blocked layout (K % 64 == 0; G = 1 or groups of a multiple of 64 columns).
at::Tensor w4a16_linear_blocked(const at::Tensor& x, const at::Tensor& blocked, int64_t k, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias) {
  return run_wo(x, plan_w4a16(blocked, k, scale, zero, bias, true));
}
