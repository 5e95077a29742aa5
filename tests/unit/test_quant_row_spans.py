"""Row spans of the AVX2 W4A16, W8A8 and W8A16 kernels (quant_gemv_cpu.cpp's ``kSpanRows``): one kernel call covers up
to 64 weight rows (W4A16 in whole blocks of 4, the tail rows one at a time) inside the row chunks the threads take, and
the outputs are stored a span row at a time. Row counts that are no multiple of the span, the block or the chunk must
land every output row where it belongs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from ascent.quantization import kernels
from tests.unit.test_quant_gemv_kernels import (assert_close, isa_ops, operands,  # noqa: F401 (fixtures)
                                                ops, ref_weight_only)


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [3, 64, 131, 300, 1030])
@pytest.mark.parametrize("k,groups", [(576, 9), (576, 1), (512, 16), (1536, 12), (200, 1)])
def test_w4a16_rows_across_spans_and_chunks(isa_ops, threads, n, k, groups):
    with num_threads(threads):
        for m in (1, 3):
            x, q, scale, zero, bias = operands(m, k, n, groups, 4, n * 13 + k + m, torch.bfloat16)
            packed = isa_ops.w4a16_pack(q)
            for z, b in ((None, None), (zero, bias)):
                assert_close(isa_ops.w4a16_linear(x, packed, k, scale, z, b), ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [3, 64, 131, 300, 1030])
@pytest.mark.parametrize("k", [576, 100])
def test_w8a8_dynamic_rows_across_spans_and_chunks(isa_ops, threads, n, k):
    with num_threads(threads):
        for m in (1, 5):
            x, q, _, _, bias = operands(m, k, n, 1, 8, n * 7 + k + m, torch.bfloat16)
            w_scale = torch.rand(n) * 0.01
            row_sum = q.sum(1, dtype=torch.int32)
            for b in (None, bias):
                y = isa_ops.w8a8_dynamic_linear(x, q, row_sum, w_scale, b)
                assert torch.equal(y, kernels.int8_linear_dynamic(x, q.t(), w_scale, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [3, 64, 131, 300, 1030])
@pytest.mark.parametrize("k,groups", [(576, 1), (1536, 12)])
def test_w8a16_rows_across_spans_and_chunks(isa_ops, threads, n, k, groups):
    """The W8A16 fixed-point kernel (bf16 x on AVX2) runs 64-row spans too; M up to 5 (its 4-token passes)."""
    with num_threads(threads):
        for m in (1, 5):
            x, q, scale, zero, bias = operands(m, k, n, groups, 8, n * 11 + k + m, torch.bfloat16)
            for z, b in ((None, None), (zero, bias)):
                assert_close(isa_ops.w8a16_linear(x, q, scale, z, b), ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [4, 7, 131, 1030])
@pytest.mark.parametrize("k,groups", [(576, 1), (1536, 12), (100, 1), (2096, 1), (576, 9)])
def test_w8a16_streams_equal_the_row_kernel(ops, threads, n, k, groups):
    """W8A16's side-by-side streams (bf16 x on AVX2 without AVX512: 4 rows far apart at once, 1-4 tokens) sum the
    row kernel's int32 spans and flush them alike, so every output is bit-identical to the row kernel's: rows not a
    multiple of 4 (the row kernel takes the rest), a K with a 16-column step and a scalar tail, a K past one int32
    span (2048) and scale groups. Elsewhere both settings run the same kernel and must agree too."""
    with num_threads(threads):
        for m in (1, 2, 3, 4, 5):
            x, q, scale, zero, bias = operands(m, k, n, groups, 8, n * 5 + k + m, torch.bfloat16)
            for z, b in ((None, None), (zero, bias)):
                old = ops.set_wo_streams(0)
                try:
                    rows = ops.w8a16_linear(x, q, scale, z, b)
                    ops.set_wo_streams(1)
                    streams = ops.w8a16_linear(x, q, scale, z, b)
                finally:
                    ops.set_wo_streams(old)
                assert torch.equal(streams, rows)
                assert_close(streams, ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [4, 7, 131, 1030])
@pytest.mark.parametrize("k,groups", [(576, 9), (576, 1), (1536, 12), (128, 2)])
def test_w4a16_blocked_streams_equal_one_stream(ops, threads, n, k, groups):
    """W4A16's blocked layout at one token reads two parts of whole row blocks side by side (AVX2 without
    AVX512-VNNI); each block's sums are the one-stream kernel's, so the outputs are bit-identical to it: row counts
    with tail rows and too few blocks for two parts, per-channel and grouped scales, zero points and bias. Elsewhere
    both settings run the same kernel and must agree too."""
    with num_threads(threads):
        for m in (1, 2):
            x, q, scale, zero, bias = operands(m, k, n, groups, 4, n * 3 + k + m, torch.bfloat16)
            blocked = ops.w4a16_block_pack(ops.w4a16_pack(q))
            for z, b in ((None, None), (zero, bias)):
                old = ops.set_wo_streams(0)
                try:
                    one = ops.w4a16_linear_blocked(x, blocked, k, scale, z, b)
                    ops.set_wo_streams(1)
                    two = ops.w4a16_linear_blocked(x, blocked, k, scale, z, b)
                finally:
                    ops.set_wo_streams(old)
                assert torch.equal(two, one)
                assert_close(two, ref_weight_only(x, q, scale, z, b))
