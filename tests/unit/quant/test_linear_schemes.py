"""W8A8 static / dynamic / MIX linear schemes against numpy float64 implementations of spec §2 written here, the
int64 deq_scale encoding and quant_bias identity (spec §12 item 2), fused-shard checks and row-parallel loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.distributed.parallel_state import init_tensor_parallel
from ascent.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from ascent.quantization.base import QuantSpec
from tests.unit.quant.scheme_utils import (
    TABLE_91,
    SpecConfig,
    finish,
    gaussian,
    load,
    np_per_token_int8,
    np_static_int8,
    quant_sym,
    rel,
    t,
)

M, K, N = 128, 512, 512


@pytest.fixture(autouse=True)
def reset_tp():
    yield
    init_tensor_parallel(0, 1)


def modelslim_w8a8(w: np.ndarray, b: np.ndarray, x_cal: np.ndarray, deq_int64: bool) -> dict[str, np.ndarray]:
    """A ModelSlim W8A8 static checkpoint built from the spec's offline identities."""
    q, s_w = quant_sym(w, 8)
    mn, mx = float(x_cal.min()), float(x_cal.max())
    s_x = np.float32((mx - mn) / 255.0)
    z_x = np.float32(np.rint(-128.0 - mn / s_x))
    d = (s_x * s_w[:, 0]).astype(np.float32)
    beta = np.rint(b.astype(np.float64) / d - float(z_x) * q.astype(np.int64).sum(axis=1)).astype(np.int32)
    deq = d.view(np.int32).astype(np.int64) if deq_int64 else d
    return {"weight": q, "weight_scale": s_w, "weight_offset": np.zeros_like(s_w), "input_scale": np.array([s_x]),
            "input_offset": np.array([z_x]), "deq_scale": deq, "quant_bias": beta}


def np_static_formula(x: np.ndarray, ck: dict[str, np.ndarray], b: np.ndarray | None) -> np.ndarray:
    s_x, z_x = float(ck["input_scale"][0]), float(ck["input_offset"][0]) if "input_offset" in ck else 0.0
    xq = np_static_int8(x, s_x, z_x)
    w = ck["weight"].astype(np.float64) * ck["weight_scale"].astype(np.float64)
    y = ((xq - z_x) * s_x) @ w.T
    return y + b if b is not None else y


def build(spec: QuantSpec, ck: dict[str, np.ndarray], cls=ReplicatedLinear, bias: np.ndarray | None = None,
          **kw) -> torch.nn.Module:
    layer = cls(K, N, bias=bias is not None, params_dtype=torch.float32, quant_config=SpecConfig(spec), **kw)
    load(layer, {k: t(v) for k, v in ck.items()})
    if bias is not None:
        layer.bias.data.copy_(t(bias))
    return finish(layer)


@pytest.mark.parametrize("deq_int64", [True, False])
def test_w8a8_static_modelslim(deq_int64):
    w, x, b = gaussian((N, K), 0, 0.02), gaussian((M, K), 1), gaussian((N,), 2, 0.1)
    ck = modelslim_w8a8(w, b, x, deq_int64)
    layer = build(QuantSpec("W8A8"), ck, bias=b)
    # §12.2: the decoded deq_scale is input_scale * weight_scale bit for bit
    expected_d = (np.float32(ck["input_scale"][0]) * ck["weight_scale"][:, 0]).astype(np.float32)
    assert np.array_equal(layer.w8a8_deq.numpy().view(np.int32), expected_d.view(np.int32))
    # §12.2: quant_bias folds the float bias: d * (beta + z_x * sum Wq) recovers b within d/2
    assert np.all(np.abs(layer.quant_method.scheme.encoded_bias(layer).numpy() - b) <= expected_d * 0.5 + 1e-7)
    # the integer pipeline: int32 accumulators exact, y = d * (acc + beta)
    xq = np_static_int8(x, ck["input_scale"][0], ck["input_offset"][0])
    acc = xq @ ck["weight"].astype(np.int64).T + ck["quant_bias"]
    y = layer(t(x)).numpy()
    assert rel(y, expected_d.astype(np.float64) * acc) < 1e-6
    assert rel(y, layer.quant_method.apply_reference(layer, t(x)).numpy()) < 1e-5
    assert rel(y, np_static_formula(x, ck, b)) < 1e-4
    assert rel(y, x.astype(np.float64) @ w.T.astype(np.float64) + b) < 1.5 * TABLE_91["W8A8"]
    xb = t(x).bfloat16()
    assert rel(layer(xb).float(), layer.quant_method.apply_reference(layer, xb).float()) < 1e-2


def test_w8a8_static_compressed_tensors():
    w, x, b = gaussian((N, K), 3, 0.02), gaussian((M, K), 4), gaussian((N,), 5, 0.1)
    q, s_w = quant_sym(w, 8)
    s_x = np.float32(np.abs(x).max() / 127.0)
    ck = {"weight": q, "weight_scale": s_w, "input_scale": np.array([s_x], dtype=np.float32)}
    layer = build(QuantSpec("W8A8", source_format="compressed-tensors"), ck, bias=b)
    assert np.array_equal(layer.w8a8_deq.numpy(), (s_x * s_w[:, 0]).astype(np.float32))
    y = layer(t(x)).numpy()
    assert rel(y, np_static_formula(x, ck, b)) < 1e-5
    assert rel(y, layer.quant_method.apply_reference(layer, t(x), layer.bias).numpy()) < 1e-5


def test_w8a8_static_fused_qkv_shards_and_mismatch():
    hidden, head, heads, kv = 64, 16, 4, 2
    sizes = {"q": heads * head, "k": kv * head, "v": kv * head}
    x = gaussian((8, hidden), 6)
    cks = {sid: modelslim_w8a8(gaussian((n, hidden), 7 + i, 0.05), np.zeros(n, np.float32), x, True)
           for i, (sid, n) in enumerate(sizes.items())}
    for sid in ("k", "v"):  # the shards see the same x: same activation parameters
        cks[sid]["input_scale"], cks[sid]["input_offset"] = cks["q"]["input_scale"], cks["q"]["input_offset"]
        d = (np.float32(cks["q"]["input_scale"][0]) * cks[sid]["weight_scale"][:, 0]).astype(np.float32)
        cks[sid]["deq_scale"] = d.view(np.int32).astype(np.int64)
        cks[sid]["quant_bias"] = np.rint(-float(cks["q"]["input_offset"][0])
                                         * cks[sid]["weight"].astype(np.int64).sum(1)).astype(np.int32)

    def make(bad: bool) -> QKVParallelLinear:
        layer = QKVParallelLinear(hidden, head, heads, kv, bias=False, params_dtype=torch.float32,
                                  quant_config=SpecConfig(QuantSpec("W8A8")), prefix="model.layers.0.qkv_proj")
        for sid, ck in cks.items():
            ck = dict(ck, input_scale=ck["input_scale"] * (1.01 if bad and sid == "v" else 1.0))
            load(layer, {k: t(v) for k, v in ck.items()}, shard_id=sid)
        return layer

    layer = finish(make(False))
    expected = np.concatenate([np_static_formula(x, cks[s], None) for s in "qkv"], axis=1)
    assert rel(layer(t(x)).numpy(), expected) < 1e-4
    with pytest.raises(ValueError, match="model.layers.0.qkv_proj.*input_scale"):
        finish(make(True))


def test_w8a8_static_compressed_tensors_fused_shards_share_the_largest_input_scale():
    """compressed-tensors q/k/v calibrated to different input scales: the fused input is quantized once with the
    largest (vLLM's ScaledMM rule), each shard dequantized with it -- no ValueError, nothing clipped."""
    hidden, head, heads, kv = 64, 16, 4, 2
    sizes = {"q": heads * head, "k": kv * head, "v": kv * head}
    x = gaussian((8, hidden), 6)
    amax = float(np.abs(x).max())
    cks = {}
    for i, (sid, n) in enumerate(sizes.items()):
        q, s_w = quant_sym(gaussian((n, hidden), 7 + i, 0.05), 8)
        cks[sid] = {"weight": q, "weight_scale": s_w,
                    "input_scale": np.array([amax / 127.0 * (0.6, 0.8, 1.0)[i]], dtype=np.float32)}
    layer = QKVParallelLinear(hidden, head, heads, kv, bias=False, params_dtype=torch.float32,
                              quant_config=SpecConfig(QuantSpec("W8A8", source_format="compressed-tensors")),
                              prefix="model.layers.0.qkv_proj")
    for sid, ck in cks.items():
        load(layer, {k: t(v) for k, v in ck.items()}, shard_id=sid)
    finish(layer)
    largest = cks["v"]["input_scale"]
    assert layer.w8a8_sx == float(largest[0])
    expected = np.concatenate([np_static_formula(x, dict(cks[s], input_scale=largest), None) for s in "qkv"], axis=1)
    assert rel(layer(t(x)).numpy(), expected) < 1e-5


def test_w8a8_static_row_parallel_rank1_has_no_quant_bias():
    init_tensor_parallel(1, 2)
    ck = modelslim_w8a8(gaussian((N, K), 8, 0.02), gaussian((N,), 9), gaussian((4, K), 10), True)
    layer = build(QuantSpec("W8A8"), ck, cls=RowParallelLinear)
    assert layer.weight.shape == (N, K // 2)
    assert torch.equal(layer.weight, t(ck["weight"][:, K // 2:]))
    assert not bool(layer.quant_bias.any())


def test_w8a8_dynamic():
    w, x, b = gaussian((N, K), 11, 0.02), gaussian((M, K), 12), gaussian((N,), 13, 0.1)
    q, s_w = quant_sym(w, 8)
    layer = build(QuantSpec("W8A8_DYNAMIC"), {"weight": q, "weight_scale": s_w,
                                               "weight_offset": np.zeros_like(s_w)}, bias=b)
    xq, s_x = np_per_token_int8(x)
    acc = xq @ q.astype(np.int64).T
    expected = acc * s_x.astype(np.float64)[:, None] * s_w.astype(np.float64).T + b
    y = layer(t(x)).numpy()
    assert rel(y, expected) < 1e-6
    assert rel(y, layer.quant_method.apply_reference(layer, t(x), layer.bias).numpy()) < 1e-5
    assert rel(y, x.astype(np.float64) @ w.T.astype(np.float64) + b) < 1.5 * TABLE_91["W8A8_DYNAMIC"]
    xb = t(x).bfloat16()
    assert rel(layer(xb).float(), layer.quant_method.apply_reference(layer, xb, layer.bias).float()) < 1e-2


def test_w8a8_dynamic_rejects_weight_offset():
    q, s_w = quant_sym(gaussian((N, K), 14, 0.02), 8)
    offset = np.zeros_like(s_w)
    offset[3] = 1.0
    with pytest.raises(ValueError, match="weight_offset"):
        build(QuantSpec("W8A8_DYNAMIC"), {"weight": q, "weight_scale": s_w, "weight_offset": offset})


@pytest.mark.parametrize("kv_consumer", [True, False])
def test_w8a8_mix(kv_consumer):
    w, x, b = gaussian((N, K), 15, 0.02), gaussian((M, K), 16), gaussian((N,), 17, 0.1)
    ck = modelslim_w8a8(w, b, x, True)
    layer = build(QuantSpec("W8A8_MIX", extra={"kv_consumer": kv_consumer}), ck, bias=b)
    y = layer(t(x)).numpy()
    if kv_consumer:
        expected = np_static_formula(x, ck, b)
    else:
        xq, s_x = np_per_token_int8(x)
        expected = (xq @ ck["weight"].astype(np.int64).T) * s_x.astype(np.float64)[:, None] \
            * ck["weight_scale"].astype(np.float64).T + b
    assert rel(y, expected) < 1e-4
    assert rel(y, layer.quant_method.apply_reference(layer, t(x), layer.bias).numpy()) < 1e-5


@pytest.mark.parametrize("kv_consumer", [True, False])
def test_w8a8_mix_decode_rows_take_the_dynamic_kernel(kv_consumer, monkeypatch):
    """The dynamic path at decode-sized M is the AMX-INT8 kernel where the CPU has it, else the W8A8 dynamic small-M
    kernel (both bit-identical to the _int_mm path), and joins the decode stack as a W8A8 dynamic linear; the static
    path joins it through the AMX-INT8 kernel when there is one, else through the static small-M kernel."""
    from ascent.quantization import kernels

    w, b = gaussian((N, K), 15, 0.02), gaussian((N,), 17, 0.1)
    ck = modelslim_w8a8(w, b, gaussian((M, K), 16), True)
    layer = build(QuantSpec("W8A8_MIX", extra={"kv_consumer": kv_consumer}), ck, bias=b)
    spec = layer.quant_method.decode_stack_call(layer)
    assert layer.w8a8_gemv is not None
    amx = layer.w8a8_amx
    if kv_consumer:
        if amx is None:
            gemv = layer.w8a8_gemv
            kind = kernels.STACK_KIND_W8A8_STATIC if gemv.nv is None else kernels.STACK_KIND_W8A8_STATIC_NV
            assert spec[0] == kind and spec[1][0] is (gemv.weight if gemv.nv is None else gemv.nv)
        else:
            assert spec[0] == kernels.STACK_KIND_W8A8_STATIC_AMX and spec[1][0] is amx.packed
        return
    if amx is not None:
        assert spec[0] == kernels.STACK_KIND_W8A8_DYNAMIC_AMX and spec[1][0] is amx.packed
    else:
        gemv = layer.w8a8_gemv
        kind = kernels.STACK_KIND_W8A8_DYNAMIC if gemv.nv is None else kernels.STACK_KIND_W8A8_DYNAMIC_NV
        assert spec[0] == kind and spec[1][0] is (gemv.weight if gemv.nv is None else gemv.nv)
    xs = [t(gaussian((m, K), 20 + m)).bfloat16() for m in (1, 3)]
    wants = [kernels.int8_linear_dynamic(x, layer.w8a8_w_t, layer.w8a8_ws, layer.bias) for x in xs]

    def not_at_decode_sizes(*args, **kwargs):
        raise AssertionError("decode-sized M must take the small-M kernel")

    monkeypatch.setattr("ascent.quantization.schemes.w8a8_dynamic.int8_linear_dynamic", not_at_decode_sizes)
    for x, want in zip(xs, wants):
        assert torch.equal(layer(x), want)


def _fp8_qkv(quant_type: str, source: str, act_scales: tuple[float, ...] | None):
    """A fused q/k/v of FP8 weights with one (different) scale per shard, the tensor strategy of compressed-tensors
    and HF fp8; with ``act_scales`` also a static ``input_scale`` per shard."""
    hidden, head, heads, kv = 64, 16, 4, 2
    sizes = {"q": heads * head, "k": kv * head, "v": kv * head}
    layer = QKVParallelLinear(hidden, head, heads, kv, bias=False, params_dtype=torch.float32,
                              quant_config=SpecConfig(QuantSpec(quant_type, source_format=source, weight_type="float",
                                                                weight_strategy="tensor")),
                              prefix="model.layers.0.qkv_proj")
    weights, scales = {}, {}
    for i, (sid, n) in enumerate(sizes.items()):
        w = torch.from_numpy(gaussian((n, hidden), 20 + i, 0.05 * (i + 1))).double()
        s_w = torch.tensor([float(w.abs().max()) / 448.0], dtype=torch.float32)
        weights[sid] = (w / s_w.double()).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales[sid] = s_w
        tensors = {"weight": weights[sid], "weight_scale": s_w}
        if act_scales is not None:
            tensors["input_scale"] = torch.tensor([act_scales[i]], dtype=torch.float32)
        load(layer, tensors, shard_id=sid)
    finish(layer)
    w_deq = torch.cat([weights[s].double() * scales[s].double() for s in "qkv"])
    return layer, w_deq


def test_fp8_per_tensor_weight_scales_of_fused_shards():
    """compressed-tensors / HF fp8 tensor strategy: weight_scale [1] per checkpoint module, expanded per row."""
    for source in ("compressed-tensors", "fp8"):
        layer, w_deq = _fp8_qkv("W8A8FP8_DYNAMIC", source, None)
        x = torch.from_numpy(gaussian((8, 64), 30))
        s_x = x.abs().amax(1, keepdim=True) / 448.0
        xf = (x / s_x).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s_x.double()
        expected = xf @ w_deq.t()
        assert rel(layer(x).numpy(), expected.numpy()) < 1e-5
        assert rel(layer.quant_method.apply_reference(layer, x).numpy(), expected.numpy()) < 1e-5


def test_fp8_static_activations_share_the_largest_input_scale():
    """W8A8FP8 (llm-compressor "FP8", HF fp8 activation_scheme static): x quantized once with the largest shard
    input_scale, ``y = e4m3(clamp(x / s_x)) * s_x @ (Wf * s_w)^T``."""
    x = torch.from_numpy(gaussian((8, 64), 31))
    amax = float(x.abs().max())
    act = (amax / 448.0 * 0.5, amax / 448.0 * 0.9, amax / 448.0 * 0.7)  # the smaller ones would clip x
    layer, w_deq = _fp8_qkv("W8A8FP8", "compressed-tensors", act)
    assert layer.fp8_input_scale == pytest.approx(act[1])
    s_x = torch.tensor(layer.fp8_input_scale, dtype=torch.float64)
    xf = (x.double() / s_x).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s_x
    expected = xf @ w_deq.t()
    assert rel(layer(x).numpy(), expected.numpy()) < 1e-5
    assert rel(layer.quant_method.apply_reference(layer, x).numpy(), expected.numpy()) < 1e-5
