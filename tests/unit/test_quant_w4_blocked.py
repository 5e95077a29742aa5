"""The blocked W4A16 layout of AVX2 CPUs without AVX512-VNNI (``cpu_kernels/quant_w4_layouts.h``): 4 rows' 64-column
halves side by side, the N % 4 tail rows as rows. ``w4a16_linear_blocked`` must give exactly ``w4a16_linear``'s
values on the rows for every x (the blocked kernel for 16-bit x on those CPUs, the rows restored for the rest), and
a W4A16 model loaded with the layout must generate exactly what the row layout generates."""

from __future__ import annotations

import pytest
import torch

from ascent.quantization.kernels import STACK_KIND_W4A16, prepare_wo_gemv
from ascent.quantization.wo_nv import w4_blocked_applies
from tests.unit.test_quant_gemv_kernels import (assert_close, isa_ops, operands,  # noqa: F401 (fixtures)
                                                ops, ref_weight_only)
from tests.unit.test_quant_row_spans import num_threads


def blocked_reference(packed: torch.Tensor) -> torch.Tensor:
    """The layout by definition: rows 4b..4b+3 as [halves, 4, 32] per block, the tail rows unchanged."""
    n, ldw = packed.shape
    whole = n // 4 * 4
    blocks = packed[:whole].reshape(n // 4, 4, ldw // 32, 32).permute(0, 2, 1, 3).reshape(whole, ldw)
    return torch.cat([blocks, packed[whole:]])


def same_values(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-identical, NaN where the reference has NaN."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(ref))


@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 131])
@pytest.mark.parametrize("ldw", [32, 288, 768])
def test_block_pack_is_the_documented_permutation_and_unpacks(ops, n, ldw):
    packed = torch.randint(0, 256, (n, ldw), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + ldw))
    blocked = ops.w4a16_block_pack(packed)
    assert torch.equal(blocked, blocked_reference(packed))
    assert torch.equal(ops.w4a16_block_unpack(blocked), packed)


def test_block_layout_rejects_partial_halves(ops):
    with pytest.raises(RuntimeError, match="K % 64"):
        ops.w4a16_block_pack(torch.zeros(8, 100, dtype=torch.uint8))
    x, q, scale, _, _ = operands(1, 576, 8, 18, 4, 1, torch.bfloat16)  # group 32
    with pytest.raises(RuntimeError, match="multiples of 64"):
        ops.w4a16_linear_blocked(x, ops.w4a16_pack(q), 576, scale, None, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [3, 64, 131, 300, 1030])
@pytest.mark.parametrize("k,groups", [(576, 9), (576, 1), (1536, 12), (512, 4), (128, 2)])
def test_blocked_equals_rows(isa_ops, threads, n, k, groups):
    """Every ISA the fixture forces (the portable and capped paths run on the restored rows), row counts with tail
    rows and across spans and chunks, M up to 5 (the kernel's two-row passes and their remainder)."""
    with num_threads(threads):
        for m, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (5, torch.bfloat16), (1, torch.float16),
                         (3, torch.float32)):
            x, q, scale, zero, bias = operands(m, k, n, groups, 4, n * 17 + k + m, dtype)
            packed = isa_ops.w4a16_pack(q)
            blocked = isa_ops.w4a16_block_pack(packed)
            for z, b in ((None, None), (zero, bias)):
                y = isa_ops.w4a16_linear_blocked(x, blocked, k, scale, z, b)
                same_values(y, isa_ops.w4a16_linear(x, packed, k, scale, z, b))
                assert_close(y, ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_blocked_with_non_finite_x_takes_the_rows(ops, bad):
    x, q, scale, zero, bias = operands(3, 576, 64, 9, 4, 5, torch.bfloat16)
    x[1, 7] = bad
    packed = ops.w4a16_pack(q)
    y = ops.w4a16_linear_blocked(x, ops.w4a16_block_pack(packed), 576, scale, zero, bias)
    same_values(y, ops.w4a16_linear(x, packed, 576, scale, zero, bias))
    assert torch.isnan(y[1]).any() or torch.isinf(y[1]).any()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


@pytest.mark.parametrize("env", [None, "0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepare_wo_gemv_takes_the_blocked_layout_where_it_applies(ops, monkeypatch, env, dtype):
    if env is not None:
        monkeypatch.setenv("ASCENT_QUANT_NV", env)
    x, q, scale, zero, bias = operands(2, 576, 131, 9, 4, 11, dtype)
    gemv = prepare_wo_gemv(q, 4, 576, scale, zero, dtype)
    assert gemv is not None
    expected = w4_blocked_applies(ops, 4, 576, 9, dtype)
    assert gemv.blocked == expected
    assert expected == (env is None and dtype == torch.bfloat16 and ops.isa() != "generic"
                        and "vnni" not in ops.isa())
    packed = ops.w4a16_pack(q)
    assert torch.equal(gemv.weight, ops.w4a16_block_pack(packed) if expected else packed)
    kind, tensors, ints = gemv.stack_spec(bias)
    if gemv.nv is None:
        assert kind == STACK_KIND_W4A16 and ints == [576, int(expected)]
    same_values(gemv.linear(x, bias), ops.w4a16_linear(x, packed, 576, scale, zero, bias))



def test_w4a16_model_generates_the_same_with_blocks_and_rows(tmp_path, monkeypatch, ops):
    """A tiny bf16 Llama quantized to W4A16 group 64: tokens and top-3 logprobs are bit-identical through the C++
    decode stack and the module path for each layout, and across the blocked layout and the rows where the CPU takes
    the blocked one. (On AVX512-VNNI CPUs ``ASCENT_QUANT_NV=1`` selects the row-interleaved VNNI layout instead, whose
    own rounding ``test_quant_wo_nv_kernel.py`` checks against the reference: a random tiny model's near-tied logits
    may then pick other tokens than the rows.)"""
    from ascent import LLM, SamplingParams
    from ascent.quantization.export.quantize import quantize_model
    from tests.fixtures.tiny_models import build_model
    from tests.integration.test_cpu_decode_stack import PROMPTS, _decoder_model

    float_dir = build_model("llama", tmp_path / "float", seed=9, hidden_size=128, intermediate_size=256, head_dim=32)
    quant_dir = str(tmp_path / "w4a16")
    quantize_model(str(float_dir), "w4a16", "compressed-tensors", quant_dir, group_size=64, calib_tokens=64,
                   dtype="bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    monkeypatch.delenv("ASCENT_QUANT_NV", raising=False)
    blocked_here = w4_blocked_applies(ops, 4, 256, 4, torch.bfloat16)
    results = {}
    for layout in ("1", "0"):
        monkeypatch.setenv("ASCENT_QUANT_NV", layout)
        for stack in ("1", "0"):
            monkeypatch.setenv("ASCENT_CPU_DECODE_STACK", stack)
            llm = LLM(model=quant_dir, dtype="bfloat16", max_model_len=128, disable_log_stats=True, seed=0)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            results[layout, stack] = [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in d.items()}
                                                                      for d in o.outputs[0].logprobs]) for o in outs]
            model = _decoder_model(llm)
            gemv = model.layers[0].mlp.down_proj.wo_gemv
            assert gemv.blocked == (layout == "1" and blocked_here)
            assert stack == "0" or model._decode_stack.steps_run > 0
    for layout in ("1", "0"):
        assert results[layout, "1"] == results[layout, "0"]
    if blocked_here:
        assert results["1", "1"] == results["0", "1"]
