"""oneDNN-packed bf16 linear weights give F.linear's result; fp32 and non-CPU weights are never packed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascent.layers.cpu_packing import pack_linear_weight, packed_linear, packing_supported
from ascent.layers.linear import QKVParallelLinear


def test_packed_linear_matches_dense_reference():
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    packed = pack_linear_weight(w)
    # oneDNN's packed 16-bit layout where the CPU has native 16-bit GEMM, else the fp32 GEMM copy
    assert packed is not None and (packed.dtype == torch.float32) == (not packing_supported(w))
    for shape in [(1, 64), (7, 64), (3, 5, 64)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        ref = (x.double() @ w.double().T + b.double())
        out = packed_linear(x, packed, b)
        assert out.shape == ref.shape[:-1] + (96,)
        assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_fp32_is_not_packed(monkeypatch):
    assert pack_linear_weight(torch.randn(8, 8)) is None
    monkeypatch.setenv("ASCENT_CPU_PACK_WEIGHTS", "0")
    assert pack_linear_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None


def test_layer_uses_packed_weight_after_loading():
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False, params_dtype=torch.bfloat16)
    dense = torch.randn(128, 64, dtype=torch.bfloat16)
    layer.weight.data.copy_(dense)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    before = layer(x)
    before = before[0] if isinstance(before, tuple) else before
    layer.quant_method.process_weights_after_loading(layer)
    after = layer(x)
    after = after[0] if isinstance(after, tuple) else after
    assert torch.allclose(before.float(), after.float(), rtol=2e-2, atol=2e-2)
    packed = getattr(layer, "packed_weight", None)  # the oneDNN layout, or the fp32 GEMM copy without native 16-bit GEMM
    if layer.panel_weight is not None:  # the small-M kernel's AVX2 path takes every call: prepacked panels instead
        assert packed is None and layer.panel_weight.panels.shape == (128 // 16, 64, 16)
        return
    assert packed is not None and (packed.dtype == torch.float32) == (not packing_supported(dense))
