"""The fused causal prefill attention kernels (``prefill_attention``: AVX512-BF16, AMX tiles on AMX CPUs, and AVX2 + FMA in
fp32 on CPUs without AVX512-BF16) against a float64 recomputation, alone and as the SDPA backend's fresh / cached-prefix prefill path; routing falls back to torch
SDPA where neither applies.

Shapes cover one row, partial query blocks and key blocks (64 keys for AVX512, 16 / 32 keys and 256-key softmax
chunks for AMX, 64 keys for AVX2), GQA groups 1-8, head dims 32-256 (AMX: 32 / 64 / 128), row-strided q/k/v (slices of one fused QKV
row), cached prefixes (query i at position q_offset + i) and sliding windows, including windows that leave some query
rows of a tile without any key in the first key block or chunk the tile visits.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ascent.attention.backends.sdpa import SDPABackend
from ascent.layers import cpu_kernels
from tests.fixtures.paged_case import make_paged_case

TOL = 3e-2  # bf16 output rounding (values of magnitude ~1-8) plus P rounded to bf16 before P.V


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels.fused_ops()
    assert module is not None, "the CPU profile must build the fused kernels (a C++ compiler is a test requirement)"
    return module


AVX512_MODE, AMX_MODE, AVX2_MODE = 1, 2, 3


@pytest.fixture(params=[AVX512_MODE, AMX_MODE, AVX2_MODE], ids=["avx512", "amx", "avx2"])
def kernel(ops, request):
    """The AVX512-BF16 kernel (mode 1: wherever AVX512-BF16 exists), the AMX kernel (mode 2: AMX CPUs) or the AVX2
    kernel (mode 3: AVX2 + FMA CPUs), at full ISA level; a CPU without that ISA cannot run it (the routing tests
    cover what it does there)."""
    previous, previous_mode = ops.set_isa_limit(2), ops.set_prefill_attention(request.param)
    try:
        if not ops.prefill_attention_available(64):
            pytest.skip(f"this CPU lacks the ISA of prefill attention mode {request.param}")
        yield ops
    finally:
        ops.set_isa_limit(previous)
        ops.set_prefill_attention(previous_mode)


def test_mode_switch_validates_and_gates(ops) -> None:
    with pytest.raises(RuntimeError, match="prefill attention mode"):
        ops.set_prefill_attention(4)
    previous = ops.set_prefill_attention(0)
    try:
        assert not ops.prefill_attention_available(64)
        assert ops.set_prefill_attention(-1) == 0
        auto = ops.prefill_attention_available(64)
        ops.set_prefill_attention(AVX512_MODE)
        avx512 = ops.prefill_attention_available(64)
        ops.set_prefill_attention(AVX2_MODE)
        avx2 = ops.prefill_attention_available(64)
        assert not ops.prefill_attention_available(48)  # the AVX2 kernel takes multiples of 32
        ops.set_prefill_attention(AMX_MODE)
        amx = ops.prefill_attention_available(64)
        assert auto == (avx512 or amx or avx2)  # auto picks one of them wherever any exists
        assert not ops.prefill_attention_available(256)  # the AMX kernel stops at head dim 128
        ops.set_prefill_attention(-1)
        limit = ops.set_isa_limit(1)  # an AVX2 CPU (no AVX512-BF16): auto takes the AVX2 kernel where AVX2 exists
        try:
            assert ops.prefill_attention_available(64) == avx2
        finally:
            ops.set_isa_limit(limit)
    finally:
        ops.set_prefill_attention(previous)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, d: int, q_offset: int,
              window: int) -> torch.Tensor:
    """float64 causal attention: q ``[tq, heads*d]`` at positions q_offset.., k/v ``[tk, kv_heads*d]``."""
    tq, tk, kv_heads = q.shape[0], k.shape[0], k.shape[1] // d
    qh = q.double().reshape(tq, heads, d).transpose(0, 1)
    kh = k.double().reshape(tk, kv_heads, d).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    vh = v.double().reshape(tk, kv_heads, d).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = qh @ kh.transpose(1, 2) / math.sqrt(d)
    q_pos = torch.arange(q_offset, q_offset + tq).unsqueeze(1)
    k_pos = torch.arange(tk).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(tq, heads * d)


def fused_qkv(tq: int, q_offset: int, heads: int, kv_heads: int, d: int, seed: int):
    """q (the last tq rows) and k / v (all q_offset + tq rows) as column slices of one bf16 QKV tensor."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(q_offset + tq, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(torch.bfloat16)
    return qkv[q_offset:, : heads * d], qkv[:, heads * d : (heads + kv_heads) * d], qkv[:, (heads + kv_heads) * d :]


@pytest.mark.parametrize(
    "tq,q_offset,heads,kv_heads,d,window",
    [(1, 0, 9, 3, 64, 0), (7, 0, 9, 3, 64, 0), (64, 0, 4, 4, 64, 0), (65, 0, 8, 1, 32, 0), (200, 0, 9, 3, 64, 0),
     (100, 37, 8, 2, 128, 0), (33, 300, 6, 2, 256, 0), (257, 0, 4, 4, 64, 50), (130, 10, 6, 3, 64, 1),
     (150, 0, 6, 2, 64, 64), (70, 90, 9, 3, 64, 17), (600, 0, 9, 3, 64, 0), (300, 500, 4, 2, 128, 0),
     (40, 700, 4, 2, 32, 100), (17, 15, 9, 3, 64, 0), (530, 0, 6, 2, 64, 300)],
)
def test_kernel_matches_float64(kernel, tq: int, q_offset: int, heads: int, kv_heads: int, d: int,
                                window: int) -> None:
    q, k, v = fused_qkv(tq, q_offset, heads, kv_heads, d, seed=tq * 1000 + q_offset)
    if not kernel.prefill_attention_available(d):  # the AMX kernel's head dims are 32, 64 and 128
        with pytest.raises(RuntimeError, match="head dim"):
            kernel.prefill_attention(q, k, v, heads, 1 / math.sqrt(d), q_offset, window)
        return
    out = kernel.prefill_attention(q, k, v, heads, 1 / math.sqrt(d), q_offset, window)
    assert out.shape == (tq, heads * d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    want = reference(q, k, v, heads, d, q_offset, window)
    assert (out.double() - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item())


def test_kernel_equals_itself_on_contiguous_copies(kernel) -> None:
    q, k, v = fused_qkv(90, 20, 9, 3, 64, seed=3)
    strided = kernel.prefill_attention(q, k, v, 9, 0.125, 20, 0)
    dense = kernel.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 9, 0.125, 20, 0)
    assert torch.equal(strided, dense)


def test_kernel_writes_into_given_output_rows(kernel) -> None:
    """out=: the rows of a larger output (as the SDPA backend passes them) get the result in place, bit-identical to
    a new tensor's, and the rows around them keep their values; an out of the wrong shape, dtype or layout raises."""
    q, k, v = fused_qkv(40, 10, 9, 3, 64, seed=7)
    want = kernel.prefill_attention(q, k, v, 9, 0.125, 10, 0)
    whole = torch.full((50, 9 * 64), 3.0, dtype=torch.bfloat16)
    rows = whole[5:45]
    got = kernel.prefill_attention(q, k, v, 9, 0.125, 10, 0, out=rows)
    assert got.data_ptr() == rows.data_ptr() and torch.equal(rows, want)
    assert torch.equal(whole[:5], torch.full_like(whole[:5], 3.0)) and torch.equal(whole[45:], whole[:5])
    for bad in (whole[5:44], rows.float(), torch.empty(9 * 64, 40, dtype=torch.bfloat16).t()):
        with pytest.raises(RuntimeError, match="out must be a contiguous bf16"):
            kernel.prefill_attention(q, k, v, 9, 0.125, 10, 0, out=bad)


def test_kernel_rejects_bad_inputs(kernel) -> None:
    q, k, v = fused_qkv(8, 4, 4, 2, 64, seed=5)
    with pytest.raises(RuntimeError, match="must equal q_offset"):
        kernel.prefill_attention(q, k, v, 4, 0.125, 0, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.prefill_attention(q.float(), k, v, 4, 0.125, 4, 0)
    with pytest.raises(RuntimeError, match="kv_heads dividing"):
        kernel.prefill_attention(q, k[:, :96], v[:, :96], 4, 0.125, 4, 0)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel.prefill_attention(q[:, :40 * 4], k[:, :40 * 2], v[:, :40 * 2], 4, 0.125, 4, 0)
    with pytest.raises(RuntimeError, match="head dim"):  # 256: the AVX512 kernel's, not the AMX kernel's
        qb, kb, vb = fused_qkv(8, 4, 4, 2, 256, seed=5)
        previous = kernel.set_prefill_attention(AMX_MODE)
        try:
            kernel.prefill_attention(qb, kb, vb, 4, 0.0625, 4, 0)
        finally:
            kernel.set_prefill_attention(previous)
    with pytest.raises(RuntimeError, match="window"):
        kernel.prefill_attention(q, k, v, 4, 0.125, 4, -1)


@pytest.mark.parametrize("value,mode", [("0", 0), ("1", 1), ("2", 2), ("3", 3), ("", -1), ("yes", -1), ("4", -1), ("11", -1)])
def test_environment_sets_the_initial_mode(value: str, mode: int) -> None:
    """ASCENT_CPU_PREFILL_ATTENTION is read when the kernels load: 0 off, 1 AVX512, 2 AMX, 3 AVX2, anything else
    auto."""
    code = ("from ascent.layers import cpu_kernels; ops = cpu_kernels.fused_ops(); "
            "print(ops.set_prefill_attention(-1))")
    env = {**os.environ, "ASCENT_CPU_PREFILL_ATTENTION": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(mode)


def _backend_case(dtype: torch.dtype, window: int | None):
    """Fresh and cached-prefix prefills (longer than the batched short-query path) plus decodes, head dim 64."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    reqs = [(0, 70), (40, 30), (23, 1), (0, 17), (66, 65)]
    case = make_paged_case(reqs, dtype, 2, rng, gen, num_blocks=64, block_size=16, num_kv_heads=3, num_heads=9,
                           head=64, sentinel=77.0, spare_blocks=1)
    return reqs, *case


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("isa_level,mode", [(2, AVX512_MODE), (2, AMX_MODE), (2, AVX2_MODE), (0, -1)],
                         ids=["avx512-kernel", "amx-kernel", "avx2-kernel", "torch-sdpa"])
def test_backend_prefills_match_float64(ops, isa_level: int, mode: int, window: int | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 prefills through SDPAImpl: with each kernel (where the CPU has it) and with all ruled out (ISA limit 0),
    all match float64; the kernel is called exactly for the prefill requests when it applies."""
    reqs, common, cache, q, k_new, v_new, full_k, full_v = _backend_case(torch.bfloat16, window)
    previous, previous_mode = ops.set_isa_limit(isa_level), ops.set_prefill_attention(mode)
    try:
        applies = bool(ops.prefill_attention_available(64))
        calls = []
        impl = SDPABackend.get_impl_cls()(9, 64, 0.125, 3, sliding_window=window)
        if impl._fused is not None:
            real = impl._fused

            class Spy:
                def __getattr__(self, name):
                    return getattr(real, name)

                def prefill_attention(self, *args):
                    calls.append(args[5])  # q_offset
                    return real.prefill_attention(*args)

            monkeypatch.setattr(impl, "_fused", Spy())
        out = impl.forward(q, k_new, v_new, cache, SDPABackend.get_builder_cls()().build(common))
    finally:
        ops.set_isa_limit(previous)
        ops.set_prefill_attention(previous_mode)
    qsl = common.query_start_loc_np
    for i, (c, n) in enumerate(reqs):
        want = reference(q[qsl[i] : qsl[i + 1]], full_k[i], full_v[i], 9, 64, c, window or 0)
        got = out[qsl[i] : qsl[i + 1]].double()
        assert (got - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item()), (i, c, n)
    expected_calls = sorted(c for c, n in reqs if n > 16 or (c == 0 and n > 1)) if applies else []
    assert sorted(calls) == expected_calls
    if isa_level == 0:
        assert not applies
