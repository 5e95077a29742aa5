"""DeviceAdaptor MoE routing, gating, quantization, grouped matmul and layout ops vs naive loop references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ascent.platform.adaptor import A5DeviceAdaptor, A310PDeviceAdaptor, DeviceAdaptor
from ascent.platform.profile import WeightLayoutPolicy

ADAPTORS = [DeviceAdaptor(), A5DeviceAdaptor(), A310PDeviceAdaptor()]
IDS = ["base", "a5", "310p"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----- gating top-k -----
def _gating_ref(x: torch.Tensor, k: int, k_group: int, group_count: int, mode: int, renorm: bool, norm_type: int,
                factor: float, bias: list[float] | None) -> tuple[list[list[float]], list[list[int]]]:
    weights, ids = [], []
    for row in x.double().tolist():
        e = len(row)
        if norm_type == 0:
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
        size = e // group_count
        groups = [sorted(choice[g * size: (g + 1) * size], reverse=True) for g in range(group_count)]
        gscore = [sum(gr[:2]) if mode == 1 else gr[0] for gr in groups] if group_count > 1 else [0.0]
        kept = sorted(range(len(gscore)), key=lambda g: -gscore[g])[:k_group] if group_count > 1 else [0]
        cand = [i for i in range(e) if (i // size if group_count > 1 else 0) in kept]
        top = sorted(cand, key=lambda i: -choice[i])[:k]
        w = [scores[i] for i in top]
        if renorm:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        weights.append([v * factor for v in w])
        ids.append(top)
    return weights, ids


GATING_CASES = [
    dict(k=2, k_group=1, group_count=1, mode=1, renorm=True, norm_type=0, factor=1.0, bias=False),
    dict(k=3, k_group=1, group_count=1, mode=1, renorm=False, norm_type=0, factor=2.5, bias=False),
    dict(k=4, k_group=2, group_count=4, mode=1, renorm=True, norm_type=1, factor=2.5, bias=True),
    dict(k=2, k_group=3, group_count=4, mode=0, renorm=True, norm_type=0, factor=1.0, bias=True),
    dict(k=3, k_group=2, group_count=4, mode=1, renorm=True, norm_type=0, factor=1.0, bias=False),
]


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("case", GATING_CASES)
def test_moe_gating_top_k(adaptor: DeviceAdaptor, case: dict) -> None:
    g = _gen(10)
    num_tokens = 1030 if isinstance(adaptor, A310PDeviceAdaptor) else 37  # 310P: spans two router chunks
    x = torch.randn(num_tokens, 16, generator=g)
    bias = (torch.randn(16, generator=g) * 0.1) if case["bias"] else None
    w, ids, scores = adaptor.moe_gating_top_k(
        x, k=case["k"], k_group=case["k_group"], group_count=case["group_count"], group_select_mode=case["mode"],
        renorm=case["renorm"], norm_type=case["norm_type"], routed_scaling_factor=case["factor"], bias=bias)
    ref_w, ref_ids = _gating_ref(x, case["k"], case["k_group"], case["group_count"], case["mode"], case["renorm"],
                                 case["norm_type"], case["factor"], bias.tolist() if bias is not None else None)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and scores.shape == x.shape
    assert ids.tolist() == ref_ids
    torch.testing.assert_close(w.double(), torch.tensor(ref_w, dtype=torch.float64), atol=1e-6, rtol=1e-5)


def test_moe_gating_validation() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="group_count=3"):
        DeviceAdaptor().moe_gating_top_k(x, k=2, group_count=3, k_group=1)
    with pytest.raises(ValueError, match="k=9"):
        DeviceAdaptor().moe_gating_top_k(x, k=9)


# ----- init routing / unpermute -----
@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("expert_range, active_num, count_type",
                         [(None, None, 1), ((2, 6), None, 1), ((0, 8), 9, 0), ((3, 5), 2, 1)])
def test_moe_init_routing_and_unpermute(adaptor: DeviceAdaptor, expert_range, active_num, count_type) -> None:
    g = _gen(11)
    t, k, h, e = 7, 3, 5, 8
    hidden = torch.randn(t, h, generator=g)
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    r = adaptor.moe_init_routing(hidden, topk_ids, num_experts=e, active_num=active_num,
                                 expert_tokens_num_type=count_type, active_expert_range=expert_range)
    start, end = expert_range or (0, e)
    entries = sorted((int(topk_ids[ti, j]), ti * k + j) for ti in range(t) for j in range(k)
                     if start <= int(topk_ids[ti, j]) < end)
    if active_num is not None:
        entries = entries[:active_num]
    assert torch.equal(r.expanded_x, torch.stack([hidden[f // k] for _, f in entries]))
    row_ref = [-1] * (t * k)
    for row, (_, f) in enumerate(entries):
        row_ref[f] = row
    assert r.expanded_row_idx.tolist() == row_ref
    counts = [sum(1 for ex, _ in entries if ex == x) for x in range(start, end)]
    assert r.expert_tokens.tolist() == (counts if count_type == 1 else np.cumsum(counts).tolist())
    probs = torch.rand(t, k, generator=g)
    out = adaptor.moe_token_unpermute(r.expanded_x * 2.0, r.expanded_row_idx, probs)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for ti in range(t):
        for j in range(k):
            row = row_ref[ti * k + j]
            if row >= 0:
                ref[ti] += probs[ti, j].double() * 2.0 * hidden[ti].double()
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)


def test_moe_init_routing_quant_and_scale() -> None:
    g = _gen(12)
    hidden = torch.randn(4, 6, generator=g)
    topk_ids = torch.tensor([[1, 0], [0, 2], [2, 1], [1, 0]])
    a = DeviceAdaptor()
    r = a.moe_init_routing(hidden, topk_ids, num_experts=3, quant=True)
    plain = a.moe_init_routing(hidden, topk_ids, num_experts=3)
    q_ref, s_ref = _quant_ref(plain.expanded_x)
    assert r.expanded_x.dtype == torch.int8 and r.expanded_x.tolist() == q_ref
    torch.testing.assert_close(r.expanded_scale.double(), torch.tensor(s_ref, dtype=torch.float64))
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    r2 = a.moe_init_routing(hidden, topk_ids, num_experts=3, scale=scale)
    tokens = [f // 2 for f in sorted(range(8), key=lambda f: (int(topk_ids.view(-1)[f]), f))]
    assert r2.expanded_scale.tolist() == [scale[tk].item() for tk in tokens]
    with pytest.raises(ValueError, match="active_expert_range"):
        a.moe_init_routing(hidden, topk_ids, num_experts=3, active_expert_range=(2, 5))


# ----- dynamic quant -----
def _quant_ref(x: torch.Tensor) -> tuple[list[list[int]], list[float]]:
    """int8 per-row symmetric quant, emulating the fp32 arithmetic with numpy float32 scalars."""
    qs, scales = [], []
    for row in x.float().numpy():
        amax = np.float32(max(abs(float(v)) for v in row))
        scale = np.float32(amax / np.float32(127.0))
        div = scale if scale > 0 else np.float32(1.0)
        qs.append([max(-128, min(127, round(float(np.float32(v) / div)))) for v in row])
        scales.append(float(scale))
    return qs, scales


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_dynamic_quant_int8(adaptor: DeviceAdaptor) -> None:
    x = torch.randn(6, 33, generator=_gen(13)) * 3
    x[2] = 0.0
    q, s = adaptor.dynamic_quant(x)
    q_ref, s_ref = _quant_ref(x)
    assert q.dtype == torch.int8 and q.tolist() == q_ref and s.tolist() == pytest.approx(s_ref, rel=1e-7)
    assert s[2] == 0 and bool((q[2] == 0).all())
    passthrough = adaptor.dynamic_quant(x, s)
    assert passthrough[0] is x and passthrough[1] is s


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_dynamic_quant_fp8(adaptor: DeviceAdaptor) -> None:
    x = torch.randn(3, 4, 40, generator=_gen(14))
    q, s = adaptor.dynamic_quant(x, quant_dtype=torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 4)
    for idx in np.ndindex(3, 4):
        row = x[idx].double()
        scale = float(row.abs().max()) / 448.0
        assert float(s[idx]) == pytest.approx(scale, rel=1e-6)
        deq = q[idx].double() * float(s[idx])
        assert float((deq - row).abs().max()) <= float(row.abs().max()) / 16 + 1e-12
        assert float(q[idx].double().abs().max()) == 448.0


@pytest.mark.parametrize("adaptor", [DeviceAdaptor(), A310PDeviceAdaptor()], ids=["base", "310p"])
def test_mxfp_rejected_outside_a5(adaptor: DeviceAdaptor) -> None:
    with pytest.raises(ValueError, match="MXFP MoE quantization is only supported on Ascend A5"):
        adaptor.dynamic_quant(torch.zeros(2, 64), use_mxfp_quant=True)
    s = torch.zeros(2, 4)
    assert adaptor.maybe_normalize_mxfp_scale_layout(s) is s


def test_a5_mxfp8_quant() -> None:
    a = A5DeviceAdaptor()
    x = torch.randn(3, 128, generator=_gen(15)) * torch.tensor([1e-3, 1.0, 300.0]).unsqueeze(1)
    x[1, 32:64] = 0.0
    q, scale = a.dynamic_quant(x, use_mxfp_quant=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2, 2) and scale.dtype == torch.uint8
    flat_scale = scale.reshape(3, 4)
    for r in range(3):
        for b in range(4):
            block = [float(v) for v in x[r, b * 32: (b + 1) * 32]]
            amax = max(abs(v) for v in block)
            e = max(-127, min(127, math.frexp(amax)[1] - 1 - 8)) if amax > 0 else -127
            assert int(flat_scale[r, b]) == e + 127
            for i, v in enumerate(block):
                target = max(-448.0, min(448.0, v / 2.0 ** e))
                got = float(q[r, b * 32 + i])
                assert abs(got - target) <= abs(target) / 16 + 2.0 ** -9
    with pytest.raises(ValueError, match="Invalid MXFP scale shape"):
        a.maybe_normalize_mxfp_scale_layout(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Invalid MXFP scale shape"):
        a.dynamic_quant(torch.zeros(2, 96), use_mxfp_quant=True)
    assert a.maybe_normalize_mxfp_scale_layout(torch.zeros(2, 6)).shape == (2, 3, 2)


# ----- grouped matmul -----
def _gmm_ref(x: torch.Tensor, w: torch.Tensor, counts: list[int], bias: torch.Tensor | None = None) -> torch.Tensor:
    xd, wd = x.double().tolist(), w.double().tolist()
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64)
    row = 0
    for e, c in enumerate(counts):
        for r in range(row, row + c):
            for n in range(w.shape[-1]):
                acc = sum(xd[r][kk] * wd[e][kk][n] for kk in range(x.shape[1]))
                out[r, n] = acc + (float(bias[e, n]) if bias is not None else 0.0)
        row += c
    return out


def _silu_mul(h: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    half = h.shape[-1] // 2
    gate, up = h[:, :half], h[:, half:]
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_and_swiglu(adaptor: DeviceAdaptor, group_list_type: int) -> None:
    g = _gen(16)
    counts = [3, 0, 4, 2]
    x, w = torch.randn(11, 6, generator=g), torch.randn(4, 6, 8, generator=g)
    bias = torch.randn(4, 8, generator=g)
    gl = torch.tensor(counts if group_list_type == 1 else np.cumsum(counts).tolist())
    out = adaptor.grouped_matmul(x, w, gl, group_list_type=group_list_type, bias=bias)
    ref = _gmm_ref(x, w, counts, bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert bool((out[9:] == 0).all())
    sw = adaptor.grouped_matmul_swiglu(x, w, gl, group_list_type=group_list_type, swiglu_limit=0.7)
    torch.testing.assert_close(sw.double(), _silu_mul(_gmm_ref(x, w, counts), 0.7), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="group_list"):
        adaptor.grouped_matmul(x, w, torch.tensor([3, 4, 5, 6]))


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_w8a8_grouped_matmuls(adaptor: DeviceAdaptor) -> None:
    g = _gen(17)
    counts = [2, 3, 1]
    x = torch.randint(-128, 128, (6, 40), generator=g, dtype=torch.int8)
    w13 = torch.randint(-128, 128, (3, 40, 10), generator=g, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (3, 40, 7), generator=g, dtype=torch.int8)
    xs, ws13 = torch.rand(6, generator=g) * 1e-2, torch.rand(3, 10, generator=g) * 1e-3
    ws2 = torch.rand(3, 7, generator=g)
    row_expert = [e for e, c in enumerate(counts) for _ in range(c)]
    h_ref = _gmm_ref(x, w13, counts) * xs.double().unsqueeze(1) * torch.stack([ws13[e] for e in row_expert]).double()
    q, s = adaptor.grouped_matmul_swiglu_quant(x, w13, torch.tensor(counts), ws13, xs)
    act = _silu_mul(h_ref)
    s_ref = act.abs().amax(dim=1) / 127
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=0)
    assert q.dtype == torch.int8 and int((q.double() - act / s_ref.unsqueeze(1)).abs().max().ceil()) <= 1
    dtype_rule = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
    for dtype, expect in dtype_rule:
        out = adaptor.grouped_matmul_dequant(x, w2, counts, ws2, xs, input_dtype=dtype)
        ref = _gmm_ref(x, w2, counts) * xs.double().unsqueeze(1) * torch.stack([ws2[e] for e in row_expert]).double()
        assert out.dtype == expect
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="int8"):
        adaptor.grouped_matmul_dequant(x.float(), w2, counts, ws2, xs, input_dtype=torch.float16)


# ----- weight layout -----
@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_format_cast(adaptor: DeviceAdaptor) -> None:
    w = torch.randn(8, 16, generator=_gen(18)).to(torch.bfloat16)
    nz = adaptor.format_cast(w, WeightLayoutPolicy.FORCE_NZ)
    assert torch.equal(nz, w) and nz.shape == w.shape and nz.stride() == (1, 8)
    assert torch.equal(nz @ torch.ones(16, 2, dtype=torch.bfloat16), w @ torch.ones(16, 2, dtype=torch.bfloat16))
    assert adaptor.format_cast(w, WeightLayoutPolicy.CONFIGURABLE) is w
    assert adaptor.format_cast(w, WeightLayoutPolicy.CONFIGURABLE, enable_nz=True).stride() == (1, 8)
    for ineligible in (w.float(), w[:, :1], w[:1], w[0]):
        assert adaptor.format_cast(ineligible, WeightLayoutPolicy.FORCE_NZ) is ineligible
