// The output tensor of a kernel that can write into one its caller gives: the decode stack's step buffers
// (decode_stack_cpu.cpp) take the place of a new tensor per call. Included by fused_cpu.cpp, gemv_cpu.cpp and
// quant_gemv_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace ascent_out {

// `out` when defined (checked: a contiguous [rows, cols] tensor of like's dtype, which the caller keeps from
// overlapping the kernel's inputs), else a new [rows, cols] tensor with like's options.
inline at::Tensor out_or_new(const at::Tensor& out, int64_t rows, int64_t cols, const at::Tensor& like) {
  if (!out.defined()) return at::empty({rows, cols}, like.options());
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols &&
                  out.scalar_type() == like.scalar_type(),
              "out must be a contiguous [", rows, ", ", cols, "] ", like.scalar_type(), " tensor, got ", out.sizes(),
              " ", out.scalar_type());
  return out;
}

}  // namespace ascent_out
