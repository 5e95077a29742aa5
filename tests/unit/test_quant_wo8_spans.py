"""The W8A16 fixed-point AVX2 kernel's int32 spans (quant_wo8_fixed_avx2.h, ``kWo8FixedFlush``): per-channel rows sum
up to 2048 columns in int32 before a flush, which must hold at the int32 worst case."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_quant_gemv_kernels import (assert_close, bf16_ops, extreme_operands,  # noqa: F401 (fixtures)
                                                ops, ref_weight_only)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k", [2048, 4160])
def test_w8a16_per_channel_int32_worst_case(bf16_ops, m, k):
    """Per-channel rows of 2048+ columns (the fixed-point kernel's longest int32 span, then a flush) at the int32 worst
    case: every |x| equal (x^ = 32640, the largest step multiple below 2^15) and whole rows of -128 / 127 with the sign
    that adds every product. A span long enough to overflow an int32 lane would flip these rows' sign."""
    x, q, scale, zero, bias = extreme_operands(m, k, 37, 1, 8, m * 7 + k)
    x = torch.full((m, k), 1.9921875, dtype=torch.bfloat16)
    x[1:, ::2] = -1.9921875
    for z, b in ((None, None), (zero, bias)):
        y = bf16_ops.w8a16_linear(x, q, scale, z, b)
        assert_close(y, ref_weight_only(x, q, scale, z, b))
        assert y[0, 0] < 0 < y[0, 1] or z is not None  # -128 and 127 rows against all-positive x
