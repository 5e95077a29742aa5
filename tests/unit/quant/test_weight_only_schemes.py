"""W8A16 / W4A16 / W4A8_DYNAMIC / W8A8FP8_DYNAMIC linear schemes: fast paths (int8pack / int4pack for decode-sized
M, dequantize-once for prefill, _int_mm for W4A8) against the scheme reference and numpy float64 formulas of spec §2
written here; compressed-tensors' packer as the checkpoint writer; scheme-level error vs fp32 (spec §9.1 x 1.5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack

from ascent.layers.linear import ReplicatedLinear
from ascent.quantization.base import QuantSpec
from tests.unit.quant.scheme_utils import (
    TABLE_91,
    SpecConfig,
    finish,
    gaussian,
    load,
    np_per_token_int8,
    quant_asym,
    quant_sym,
    rel,
    t,
)

M, K, N = 128, 512, 512


def build(spec: QuantSpec, ck: dict[str, np.ndarray | torch.Tensor], bias: np.ndarray | None = None):
    layer = ReplicatedLinear(K, N, bias=bias is not None, params_dtype=torch.float32, quant_config=SpecConfig(spec))
    load(layer, {k: v if isinstance(v, torch.Tensor) else t(v) for k, v in ck.items()})
    if bias is not None:
        layer.bias.data.copy_(t(bias))
    return finish(layer)


def check_paths(layer, x: np.ndarray, expected: np.ndarray, fp32_err: float, table_err: float | None,
                w: np.ndarray | None = None, b: np.ndarray | None = None) -> None:
    """Decode-sized (M=1) and prefill-sized (M=128) fast paths vs the reference and the numpy formula."""
    method, bias = layer.quant_method, layer.bias
    for rows in (slice(0, 1), slice(0, M)):
        xs = t(x[rows])
        y = layer(xs).numpy()
        assert rel(y, method.apply_reference(layer, xs, bias).numpy()) < fp32_err
        assert rel(y, expected[rows]) < fp32_err
        xb = xs.bfloat16()
        assert rel(layer(xb).float(), method.apply_reference(layer, xb, bias).float()) < 1e-2
    if table_err is not None:
        y_fp = x.astype(np.float64) @ w.T.astype(np.float64) + (b if b is not None else 0)
        assert rel(layer(t(x)).numpy(), y_fp) < 1.5 * table_err


def test_w8a16_per_channel_symmetric():
    w, x, b = gaussian((N, K), 0, 0.02), gaussian((M, K), 1), gaussian((N,), 2, 0.1)
    q, s = quant_sym(w, 8)
    layer = build(QuantSpec("W8A16"), {"weight": q, "weight_scale": s, "weight_offset": np.zeros_like(s)}, b)
    assert layer.wo_packed is not None
    expected = x.astype(np.float64) @ (q.astype(np.float64) * s).T + b
    check_paths(layer, x, expected, 1e-5, TABLE_91["W8A16"], w, b)


def test_w8a16_per_group_asymmetric_subtractive_offset():
    w, x = gaussian((N, K), 3, 0.02) + 0.01, gaussian((M, K), 4)
    q, s, zp = quant_asym(w, 8, 128)
    spec = QuantSpec("W8A16", weight_strategy="group", group_size=128, weight_symmetric=False)
    layer = build(spec, {"weight": q, "weight_scale": s, "weight_offset": zp.astype(np.float32)})
    assert layer.wo_packed is None  # int8pack takes per-channel symmetric only
    w_deq = (q.astype(np.float64) - np.repeat(zp, 128, 1)) * np.repeat(s, 128, 1)
    check_paths(layer, x, x.astype(np.float64) @ w_deq.T, 1e-5, TABLE_91["W8A16"], w)


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_pack_quantized(symmetric):
    w, x, b = gaussian((N, K), 5, 0.02), gaussian((M, K), 6), gaussian((N,), 7, 0.1)
    if symmetric:
        q, s = quant_sym(w, 4, 128)
        zp = np.zeros_like(s, dtype=np.int8)
    else:
        q, s, zp = quant_asym(w, 4, 128)
    ck = {"weight_packed": ct_pack(t(q), 4, 1), "weight_scale": s, "weight_shape": np.array([N, K])}
    if not symmetric:
        ck["weight_zero_point"] = ct_pack(t(zp), 4, 0)
    spec = QuantSpec("W4A16", source_format="compressed-tensors", weight_bits=4, weight_strategy="group",
                     group_size=128, weight_symmetric=symmetric)
    layer = build(spec, ck, b)
    assert layer.wo_packed is not None and layer.wo_packed[2] == 128
    w_deq = (q.astype(np.float64) - np.repeat(zp, 128, 1)) * np.repeat(s, 128, 1)
    check_paths(layer, x, x.astype(np.float64) @ w_deq.T + b, 1e-5, TABLE_91["W4A16_g128"], w, b)


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_activation_order_weight_g_idx(symmetric):
    """GPTQ act-order (compressed-tensors actorder "group"): column k uses scale group g_idx[k], the groups'
    columns scattered over K; the numpy reference dequantizes in the checkpoint's column order."""
    w, x, b = gaussian((N, K), 8, 0.02), gaussian((M, K), 9), gaussian((N,), 10, 0.1)
    perm = np.random.default_rng(0).permutation(K)
    g_idx = np.empty(K, dtype=np.int32)
    g_idx[perm] = np.arange(K) // 128  # groups of 128 in the permuted order
    if symmetric:
        qp, s = quant_sym(w[:, perm], 4, 128)
        zp = np.zeros_like(s, dtype=np.int8)
    else:
        qp, s, zp = quant_asym(w[:, perm], 4, 128)
    q = qp[:, np.argsort(perm)]  # stored in the checkpoint's column order
    ck = {"weight_packed": ct_pack(t(q), 4, 1), "weight_scale": s, "weight_shape": np.array([N, K]),
          "weight_g_idx": g_idx}
    if not symmetric:
        ck["weight_zero_point"] = ct_pack(t(zp), 4, 0)
    spec = QuantSpec("W4A16", source_format="compressed-tensors", weight_bits=4, weight_strategy="group",
                     group_size=128, weight_symmetric=symmetric,
                     extra={"format": "pack-quantized", "actorder": "group"})
    layer = build(spec, ck, b)
    assert layer.wo_input_perm is not None and layer.quant_method.decode_stack_call(layer) is None
    w_deq = (q.astype(np.float64) - zp[:, g_idx]) * s[:, g_idx]
    check_paths(layer, x, x.astype(np.float64) @ w_deq.T + b, 1e-5, TABLE_91["W4A16_g128"], w, b)
    with pytest.raises(ValueError, match="weight_g_idx does not give each group 128 columns"):
        build(spec, dict(ck, weight_g_idx=np.minimum(np.arange(K) // 100, K // 128 - 1).astype(np.int32)), b)


def test_w4a16_activation_order_of_fused_shards():
    """q/k/v quantized with GPTQ act-order share their input, hence their order: the fused layer sorts its columns
    once; shards with different orders cannot share one permuted input and are refused by name."""
    from ascent.layers.linear import QKVParallelLinear

    hidden, head, heads, kv = 256, 16, 4, 2
    rng = np.random.default_rng(1)
    spec = QuantSpec("W4A16", source_format="compressed-tensors", weight_bits=4, weight_strategy="group",
                     group_size=64, extra={"format": "pack-quantized", "actorder": "group"})

    def make(same_order: bool):
        layer = QKVParallelLinear(hidden, head, heads, kv, bias=False, params_dtype=torch.float32,
                                  quant_config=SpecConfig(spec), prefix="model.layers.0.qkv_proj")
        perm, parts = rng.permutation(hidden), []
        for i, (sid, n) in enumerate({"q": heads * head, "k": kv * head, "v": kv * head}.items()):
            perm = perm if same_order else rng.permutation(hidden)
            g_idx = np.empty(hidden, dtype=np.int32)
            g_idx[perm] = np.arange(hidden) // 64
            qp, sc = quant_sym(gaussian((n, hidden), 40 + i, 0.05)[:, perm], 4, 64)
            q = qp[:, np.argsort(perm)]
            load(layer, {"weight_packed": ct_pack(t(q), 4, 1), "weight_scale": t(sc),
                         "weight_shape": t(np.array([n, hidden])), "weight_g_idx": t(g_idx)}, shard_id=sid)
            parts.append(q.astype(np.float64) * sc[:, g_idx])
        return layer, np.concatenate(parts)

    layer, w_deq = make(True)
    finish(layer)
    x = gaussian((4, hidden), 50)
    assert rel(layer(t(x)).numpy(), x.astype(np.float64) @ w_deq.T) < 1e-5
    with pytest.raises(NotImplementedError, match="qkv_proj: fused shards with different activation orders"):
        finish(make(False)[0])


def test_w4a16_modelslim_one_int4_per_byte():
    w, x = gaussian((N, K), 8, 0.02), gaussian((M, K), 9)
    q, s = quant_sym(w, 4, 64)
    spec = QuantSpec("W4A16", weight_bits=4, weight_strategy="group", group_size=64)
    layer = build(spec, {"weight": q, "weight_scale": s, "weight_offset": np.zeros_like(s)})
    w_deq = q.astype(np.float64) * np.repeat(s, 64, 1)
    check_paths(layer, x, x.astype(np.float64) @ w_deq.T, 1e-5, None)
    bad = q.copy()
    bad[0, 0] = 9
    with pytest.raises(ValueError, match="outside"):
        build(spec, {"weight": bad, "weight_scale": s, "weight_offset": np.zeros_like(s)})


def np_pairs(q: np.ndarray) -> np.ndarray:
    """Independent ModelSlim pair packing along rows: low nibble = even row."""
    lo, hi = q[0::2].astype(np.int16) & 0xF, q[1::2].astype(np.int16) & 0xF
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def test_w4a8_modelslim_pairs_and_scale_bias():
    w, x, b = gaussian((N, K), 10, 0.02), gaussian((M, K), 11), gaussian((N,), 12, 0.1)
    q, s = quant_sym(w, 4)
    scale_bias = (8.0 * q.astype(np.float64).sum(1, keepdims=True) * s).astype(np.float32)
    ck = {"weight": np_pairs(q), "weight_scale": s, "weight_offset": np.zeros_like(s), "scale_bias": scale_bias}
    layer = build(QuantSpec("W4A8_DYNAMIC", weight_bits=4), ck, b)
    assert torch.equal(layer.w4a8_q, t(q))
    xq, s_x = np_per_token_int8(x)
    expected = (xq @ q.astype(np.int64).T) * s_x.astype(np.float64)[:, None] * s.astype(np.float64).T + b
    check_paths(layer, x, expected, 1e-5, TABLE_91["W4A8"], w, b)
    with pytest.raises(ValueError, match="scale_bias"):
        build(QuantSpec("W4A8_DYNAMIC", weight_bits=4), dict(ck, scale_bias=scale_bias * 1.5))


@pytest.mark.parametrize("group", [None, 128])
def test_w4a8_compressed_tensors(group):
    w, x = gaussian((N, K), 13, 0.02), gaussian((M, K), 14)
    q, s = quant_sym(w, 4, group)
    spec = QuantSpec("W4A8_DYNAMIC", source_format="compressed-tensors", weight_bits=4,
                     weight_strategy="group" if group else "channel", group_size=group)
    layer = build(spec, {"weight": q, "weight_scale": s})
    xq, s_x = np_per_token_int8(x)
    g = group or K
    acc = np.stack([xq[:, i * g:(i + 1) * g] @ q[:, i * g:(i + 1) * g].astype(np.int64).T
                    for i in range(K // g)], axis=-1)  # exact per-group int products [M, N, G]
    expected = s_x.astype(np.float64)[:, None] * (acc * s.astype(np.float64)[None]).sum(-1)
    check_paths(layer, x, expected, 1e-5, TABLE_91["W4A8"] if group is None else None, w)


@pytest.mark.parametrize("group", [None, 128])
def test_w4a8_channel_scales_take_the_w8a8_dynamic_kernels(group, monkeypatch):
    """Per-channel W4A8 is W8A8 dynamic on int8 weights in [-8, 7]: decode-sized M takes the W8A8-dynamic small-M
    (or AMX) kernel, bit-identical to the _int_mm path, and joins the decode stack; group scales keep their own path
    and stay out of the stack."""
    from ascent.quantization import kernels

    q, s = quant_sym(gaussian((N, K), 21, 0.02), 4, group)
    spec = QuantSpec("W4A8_DYNAMIC", source_format="compressed-tensors", weight_bits=4,
                     weight_strategy="group" if group else "channel", group_size=group)
    layer = build(spec, {"weight": q, "weight_scale": s}, gaussian((N,), 22, 0.1))
    stack = layer.quant_method.decode_stack_call(layer)
    if group is not None:
        assert stack is None and getattr(layer, "w8a8_gemv", None) is None
        return
    assert layer.w8a8_gemv is not None and layer.w8a8_gemv.weight.data_ptr() == layer.w4a8_q.data_ptr()
    amx = layer.w8a8_amx
    small_m = kernels.STACK_KIND_W8A8_DYNAMIC if layer.w8a8_gemv.nv is None else kernels.STACK_KIND_W8A8_DYNAMIC_NV
    assert stack[0] == (small_m if amx is None else kernels.STACK_KIND_W8A8_DYNAMIC_AMX)
    xs = [t(gaussian((m, K), 23 + m)).bfloat16() for m in (1, 3)]
    wants = [kernels.int8_linear_dynamic(x, layer.w4a8_q.t(), layer.w4a8_ws.reshape(-1), layer.bias) for x in xs]

    def not_at_decode_sizes(*args, **kwargs):
        raise AssertionError("decode-sized M must take the small-M kernel")

    monkeypatch.setattr("ascent.quantization.schemes.w8a8_dynamic.int8_linear_dynamic", not_at_decode_sizes)
    for x, want in zip(xs, wants):
        assert torch.equal(layer(x), want)


def test_fp8_dynamic():
    w, x, b = gaussian((N, K), 15, 0.02), gaussian((M, K), 16), gaussian((N,), 17, 0.1)
    wt = torch.from_numpy(w).double()
    s_w = (wt.abs().amax(1, keepdim=True) / 448.0).float()
    wf = (wt / s_w.double()).clamp(-448, 448).to(torch.float8_e4m3fn)
    layer = build(QuantSpec("W8A8FP8_DYNAMIC", source_format="compressed-tensors", weight_type="float"),
                  {"weight": wf, "weight_scale": s_w}, b)
    xt = torch.from_numpy(x)
    s_x = xt.abs().amax(1, keepdim=True) / 448.0
    xf = (xt / s_x).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = (xf.double() @ wf.double().t()) * s_x.double() * s_w.double().t() + torch.from_numpy(b).double()
    check_paths(layer, x, expected.numpy(), 1e-5, TABLE_91["FP8"], w, b)
