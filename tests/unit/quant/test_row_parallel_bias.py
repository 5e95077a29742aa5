"""The float bias of a quantized RowParallelLinear is counted exactly once at TP > 1, for every linear scheme.

ModelSlim W8A8 static folds the float bias into ``quant_bias`` (rank 0 only); the other schemes add the layer's
bias argument. The layer passes its bias to rank 0's ``apply`` only, so the sum of the TP partial outputs equals the
TP=1 output: simulated (two ranks' shards built in one process with ``reduce_results=False``, partials summed here)
for every scheme, and over gloo with two spawned ranks (the real all-reduce) for the folding schemes.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack

from ascent.distributed import parallel_state as ps
from ascent.distributed.parallel_state import init_tensor_parallel
from ascent.layers.linear import RowParallelLinear
from ascent.quantization.base import QuantSpec
from tests.fixtures.spawn import run_spawned
from tests.unit.quant.scheme_utils import SpecConfig, finish, gaussian, load, quant_sym, rel, t
from tests.unit.quant.test_linear_schemes import modelslim_w8a8

M, K, N, TP = 6, 256, 128, 2
WORLD, TIMEOUT_S = 2, 120.0
# (spec, tolerance of the TP=2 sum against TP=1): per-token dynamic activations are quantized per K-shard at TP=2
# (a slightly different, not worse, rounding), everything else sums exactly up to float addition order.
CASES: dict[str, tuple[QuantSpec, float]] = {
    "modelslim_w8a8_static": (QuantSpec("W8A8"), 1e-5),
    "modelslim_w8a8_mix_static": (QuantSpec("W8A8_MIX", extra={"kv_consumer": True}), 1e-5),
    "modelslim_w8a8_mix_dynamic": (QuantSpec("W8A8_MIX"), 3e-2),
    "ct_w8a8_static": (QuantSpec("W8A8", source_format="compressed-tensors"), 1e-5),
    "w8a8_dynamic": (QuantSpec("W8A8_DYNAMIC"), 3e-2),
    "w8a16": (QuantSpec("W8A16"), 1e-5),
    "ct_w4a16_g64": (QuantSpec("W4A16", source_format="compressed-tensors", weight_bits=4, weight_strategy="group",
                               group_size=64), 1e-5),
    "ct_w4a8": (QuantSpec("W4A8_DYNAMIC", source_format="compressed-tensors", weight_bits=4), 3e-2),
    "ct_fp8_dynamic": (QuantSpec("W8A8FP8_DYNAMIC", source_format="compressed-tensors", weight_type="float"), 6e-2),
}


@pytest.fixture(autouse=True)
def reset_tp():
    yield
    init_tensor_parallel(0, 1)


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight [N, K], bias [N] as large as the outputs — a second copy would double the error budget, input)."""
    return gaussian((N, K), 60, 0.02), gaussian((N,), 61, 0.5), gaussian((M, K), 62)


def checkpoint(name: str) -> dict[str, np.ndarray | torch.Tensor]:
    w, b, x = data()
    if name.startswith("modelslim_w8a8"):
        return modelslim_w8a8(w, b, x, deq_int64=True)  # quant_bias folds b
    if name == "ct_w8a8_static":
        q, s_w = quant_sym(w, 8)
        return {"weight": q, "weight_scale": s_w, "input_scale": np.array([np.abs(x).max() / 127.0], np.float32)}
    if name in ("w8a8_dynamic", "w8a16"):
        q, s_w = quant_sym(w, 8)
        return {"weight": q, "weight_scale": s_w, "weight_offset": np.zeros_like(s_w)}
    if name == "ct_w4a16_g64":
        q, s_w = quant_sym(w, 4, 64)
        return {"weight_packed": ct_pack(t(q), 4, 1), "weight_scale": s_w, "weight_shape": np.array([N, K])}
    if name == "ct_w4a8":
        q, s_w = quant_sym(w, 4)
        return {"weight": q, "weight_scale": s_w}
    assert name == "ct_fp8_dynamic"
    wt = torch.from_numpy(w).double()
    s_w = (wt.abs().amax(1, keepdim=True) / 448.0).float()
    return {"weight": (wt / s_w.double()).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": s_w}


def build(name: str, reduce_results: bool = True) -> RowParallelLinear:
    """The row-parallel layer of this process's TP rank, loaded from the full checkpoint plus the float bias."""
    spec, _ = CASES[name]
    layer = RowParallelLinear(K, N, bias=True, reduce_results=reduce_results, params_dtype=torch.float32,
                              quant_config=SpecConfig(spec), prefix="model.layers.0.self_attn.o_proj")
    load(layer, {k: v if isinstance(v, torch.Tensor) else t(v) for k, v in checkpoint(name).items()})
    layer.bias.weight_loader(layer.bias, t(data()[1]))
    return finish(layer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_shards_sum_to_the_tp1_output_with_the_bias_once(name: str) -> None:
    _, b, x = data()
    full = build(name)
    expected = full(t(x))
    assert rel(expected.numpy(), full.quant_method.apply_reference(full, t(x), full.bias).numpy()) < 1e-4
    partials = []
    for rank in range(TP):
        init_tensor_parallel(rank, TP)
        layer = build(name, reduce_results=False)
        partials.append(layer(t(x[:, rank * K // TP:(rank + 1) * K // TP])))
    init_tensor_parallel(0, 1)
    total = sum(partials)
    tol = CASES[name][1]
    assert rel(total.numpy(), expected.numpy()) < tol
    assert rel(total.numpy() - b, expected.numpy() - b) < 4 * tol  # the bias-free parts agree too


def _child(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        _, _, x = data()
        names = ("modelslim_w8a8_static", "modelslim_w8a8_mix_static", "ct_w8a8_static", "w8a16")
        expected = {name: build(name)(t(x)) for name in names}  # before the groups exist: TP = 1
        ps.init_distributed_environment(rank, WORLD, port, "gloo", timeout_s=TIMEOUT_S)
        ps.initialize_model_parallel(WORLD, 1, timeout_s=TIMEOUT_S)
        for name in names:
            layer = build(name)
            assert layer.tp_size == WORLD and layer.weight.shape[1] == K // WORLD
            got = layer(t(x[:, rank * K // WORLD:(rank + 1) * K // WORLD]))
            err = rel(got.numpy(), expected[name].numpy())
            assert err < CASES[name][1], f"{name}: TP=2 differs from TP=1 by {err}"
        ps.destroy_distributed_environment()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_tp2_all_reduce_counts_the_bias_once() -> None:
    run_spawned(_child, WORLD, TIMEOUT_S)
