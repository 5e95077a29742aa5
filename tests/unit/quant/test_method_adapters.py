"""Method adapters (scheme -> layer quant_method) with a test-only scheme in a fresh registry, and the linear
loader extensions quantization schemes rely on (per-shard scalars, packed dims, rank-0-only row vectors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascent.attention.layer import Attention
from ascent.distributed.parallel_state import init_tensor_parallel
from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.fused_moe import FusedMoE
from ascent.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from ascent.loader.base import check_all_loaded, finalize_model
from ascent.platform.device_config import set_current_profile
from ascent.platform.families import get_hardware_profile
from ascent.quantization.base import QuantAttentionScheme, QuantizationConfig, QuantMoEScheme, QuantSpec
from ascent.quantization.method_adapters import (
    QuantKVCacheMethod,
    QuantLinearMethod,
    QuantMoEMethod,
    quant_method_for,
    registry_of,
)
from ascent.quantization.registry import DEFAULT_REGISTRY, REGISTRY_310P, SchemeRegistry
from tests.unit.quant.helpers import FakeInt8Linear

HIDDEN, HEAD, HEADS, KV_HEADS = 16, 4, 4, 2


class FakeMoE(QuantMoEScheme):
    def create_weights(self, layer, num_local_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader) -> None:
        layer.created = (num_local_experts, hidden_size, intermediate_size_per_partition)

    def dequantized_weights(self, layer):
        return torch.zeros(1), torch.ones(1)

    def apply_experts(self, layer, x, group_list, activation):
        return x * 2


class FakeKV(QuantAttentionScheme):
    def create_weights(self, layer, num_kv_heads, head_size, params_dtype, weight_loader) -> None:
        layer.kv_created = (num_kv_heads, head_size)

    def quantize_kv(self, layer, key, value):
        return key.round(), value.round()

    def dequantize_kv(self, layer, key, value):
        return key, value


class DictConfig(QuantizationConfig):
    """prefix -> quant type (None: unquantized) for every layer type, with its own registry."""

    def __init__(self, types: dict[str, str], registry: SchemeRegistry | None) -> None:
        self.types, self.registry = types, registry

    @classmethod
    def from_model_dir(cls, model_dir, hf_config):
        raise ValueError("not file based")

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        quant_type = self.types.get(prefix)
        return QuantSpec(quant_type=quant_type, layer_type=layer_type) if quant_type else None


@pytest.fixture
def registry() -> SchemeRegistry:
    reg = SchemeRegistry("test")
    reg.register("FAKE8", "linear")(type("Fake8", (FakeInt8Linear,), {}))
    reg.register("FAKE8", "moe")(FakeMoE)
    reg.register("FAKE8", "attention")(FakeKV)
    return reg


@pytest.fixture(autouse=True)
def reset_tp():
    yield
    init_tensor_parallel(0, 1)


def test_linear_adapter_end_to_end(registry: SchemeRegistry) -> None:
    config = DictConfig({"qkv": "FAKE8"}, registry)
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, params_dtype=torch.float32,
                              quant_config=config, prefix="qkv")
    assert isinstance(layer.quant_method, QuantLinearMethod)
    assert layer.weight.dtype == torch.int8 and layer.input_scale.shape == (3, 1)
    assert layer.weight.weight_loader == layer.weight_loader  # passed through create_weights
    g = torch.Generator().manual_seed(0)
    ckpt = {s: torch.randint(-128, 128, (n * HEAD, HIDDEN), generator=g, dtype=torch.int8)
            for s, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    scales = {s: torch.rand(w.shape[0], 1, generator=g) for s, w in ckpt.items()}
    bias = {s: torch.randn(w.shape[0], generator=g) for s, w in ckpt.items()}
    loaded = set()
    for s in "qkv":
        layer.weight_loader(layer.weight, ckpt[s], s)
        layer.weight_loader(layer.weight_scale, scales[s], s)
        layer.weight_loader(layer.bias, bias[s], s)
    loaded |= {"weight", "weight_scale", "bias"}
    check_all_loaded(layer, loaded, "test")  # input_scale is quant_optional
    assert torch.equal(layer.input_scale, torch.ones(3, 1))
    finalize_model(layer)
    assert layer.processed
    x = torch.randn(3, HIDDEN, generator=g)
    expected = torch.cat([F.linear(x, ckpt[s].float() * scales[s], bias[s]) for s in "qkv"], dim=-1)
    torch.testing.assert_close(layer(x), expected)
    plain = RowParallelLinear(HIDDEN, 8, bias=False, params_dtype=torch.float32, quant_config=config, prefix="o")
    assert isinstance(plain.quant_method, UnquantizedLinearMethod)


def test_moe_attention_embedding_adapters(registry: SchemeRegistry) -> None:
    config = DictConfig({"experts": "FAKE8", "attn": "FAKE8", "embed": "W8A8", "lm_head": "W8A8"}, registry)
    moe = FusedMoE(2, 1, 8, 8, torch.float32, prefix="experts")
    method = quant_method_for(config, moe, "experts")
    assert isinstance(method, QuantMoEMethod)
    method.create_weights(moe, 2, 8, 4, torch.float32, None)
    assert moe.created == (2, 8, 4)
    x = torch.ones(3, 8)
    assert torch.equal(method.apply_experts(moe, x, torch.tensor([3, 0]), "silu"), 2 * x)
    assert torch.equal(method.dequantized_weights(moe)[1], torch.ones(1))
    attn = Attention(2, 4, 0.5, 2, prefix="attn")
    kv = quant_method_for(config, attn, "attn")
    assert isinstance(kv, QuantKVCacheMethod)
    kv.create_weights(attn, 2, 4, torch.float32, None)
    assert attn.kv_created == (2, 4)
    assert torch.equal(kv.quantize_kv(attn, torch.tensor([0.4]), torch.tensor([1.6]))[1], torch.tensor([2.0]))
    with pytest.raises(NotImplementedError, match=r"quant_type='W8A8' for layer_type='embedding'"):
        VocabParallelEmbedding(32, 8, torch.float32, prefix="embed", quant_config=config)
    with pytest.raises(NotImplementedError, match=r"quant_type='W8A8' for layer_type='embedding'"):
        ParallelLMHead(32, 8, params_dtype=torch.float32, prefix="lm_head", quant_config=config)
    assert quant_method_for(config, VocabParallelEmbedding(32, 8, torch.float32), "other") is None
    assert quant_method_for(config, nn.Linear(2, 2), "embed") is None  # not an engine layer kind


def test_unknown_type_and_profile_registry(registry: SchemeRegistry) -> None:
    config = DictConfig({"o": "W8A8_TIMESTEP"}, registry)
    with pytest.raises(NotImplementedError, match=r"quant_type='W8A8_TIMESTEP' for layer_type='linear'"):
        RowParallelLinear(HIDDEN, 8, bias=False, params_dtype=torch.float32, quant_config=config, prefix="o")
    no_registry = DictConfig({}, None)
    previous = set_current_profile(get_hardware_profile("310p"))
    try:
        assert registry_of(no_registry) is REGISTRY_310P
        set_current_profile(get_hardware_profile("cpu"))
        assert registry_of(no_registry) is DEFAULT_REGISTRY
    finally:
        set_current_profile(previous)


# ------------------------------------------------------------------------------ loader extensions (linear.py)
def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype=torch.float32, **attrs) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, -7, dtype=dtype), requires_grad=False)
    for key, value in {"weight_loader": layer.weight_loader, **attrs}.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param


@pytest.mark.parametrize("tp_size", [1, 2])
def test_per_shard_scalar(tp_size: int) -> None:
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, params_dtype=torch.float32)
        p = add_param(qkv, "input_scale", (3, 1), per_shard_scalar=True)
        qkv.weight_loader(p, torch.tensor([0.5]), "k")
        qkv.weight_loader(p, torch.tensor(0.25), "v")  # 0-d
        qkv.weight_loader(p, torch.tensor([[0.125]]), "q")
        assert torch.equal(p, torch.tensor([[0.125], [0.5], [0.25]]))
        qkv.weight_loader(p, torch.tensor([1.0, 2.0, 3.0]), None)  # the fused tensor: all rows
        assert torch.equal(p, torch.tensor([[1.0], [2.0], [3.0]]))
        with pytest.raises(ValueError, match="does not fit"):
            qkv.weight_loader(p, torch.tensor([1.0, 2.0]), "q")
        mlp = MergedColumnParallelLinear(HIDDEN, [8, 8], bias=False, params_dtype=torch.float32)
        p = add_param(mlp, "pair", (2, 2), per_shard_scalar=True)
        mlp.weight_loader(p, torch.tensor([3.0, 4.0]), 1)
        mlp.weight_loader(p, torch.tensor([1.0, 2.0]), 0)
        assert torch.equal(p, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        for cls in (ColumnParallelLinear, ReplicatedLinear):
            layer = cls(HIDDEN, 8, bias=False, params_dtype=torch.float32)
            p = add_param(layer, "input_scale", (1, 1), per_shard_scalar=True)
            layer.weight_loader(p, torch.tensor([0.75]))
            assert torch.equal(p, torch.tensor([[0.75]]))
        row = RowParallelLinear(8, HIDDEN, bias=False, params_dtype=torch.float32)
        p = add_param(row, "input_offset", (1,), per_shard_scalar=True)
        row.weight_loader(p, torch.tensor(3.0))
        assert torch.equal(p, torch.tensor([3.0]))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_packed_along_output_column_parallel(tp_size: int) -> None:
    """Two int4 per int8 along N (ModelSlim W4A8): stored [N/2, K]; offsets/sizes are halved."""
    gate = torch.arange(8 * 4, dtype=torch.int8).reshape(8, 4)  # logical N=16 -> stored 8 rows
    up = -torch.arange(8 * 4, dtype=torch.int8).reshape(8, 4)
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        mlp = MergedColumnParallelLinear(4, [16, 16], bias=False, params_dtype=torch.float32)
        local = 16 // tp_size // 2
        p = add_param(mlp, "weight_packed", (2 * local, 4), torch.int8, output_dim=0, input_dim=1, packed_dim=0,
                      packed_factor=2)
        mlp.weight_loader(p, up, 1)
        mlp.weight_loader(p, gate, 0)
        rows = slice(rank * local, (rank + 1) * local)
        assert torch.equal(p, torch.cat([gate[rows], up[rows]]))
        fused = MergedColumnParallelLinear(4, [16, 16], bias=False, params_dtype=torch.float32)
        q = add_param(fused, "weight_packed", (2 * local, 4), torch.int8, output_dim=0, packed_dim=0, packed_factor=2)
        fused.weight_loader(q, torch.cat([gate, up]), None)
        assert torch.equal(q, p)
        qkv = QKVParallelLinear(4, 4, 4, 2, bias=False, params_dtype=torch.float32)  # q 16, k 8, v 8 rows
        full = torch.arange(16 * 4, dtype=torch.int8).reshape(16, 4)  # packed: q 8, k 4, v 4
        r = add_param(qkv, "weight_packed", (16 // tp_size, 4), torch.int8, output_dim=0, packed_dim=0,
                      packed_factor=2)
        qkv.weight_loader(r, full, None)
        qn, kn = 8 // tp_size, 4 // tp_size
        expected = torch.cat([full[:8][rank * qn:(rank + 1) * qn], full[8:12][rank * kn:(rank + 1) * kn],
                              full[12:][rank * kn:(rank + 1) * kn]])
        assert torch.equal(r, expected)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_packed_along_input_row_parallel(tp_size: int) -> None:
    full = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)  # K=16 logical, 2 per element -> 8 stored
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        row = RowParallelLinear(16, 4, bias=False, params_dtype=torch.float32)
        width = 8 // tp_size
        p = add_param(row, "weight_packed", (4, width), torch.int32, output_dim=0, input_dim=1, packed_dim=1,
                      packed_factor=2)
        row.weight_loader(p, full)
        assert torch.equal(p, full[:, rank * width:(rank + 1) * width])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_row_parallel_rank0_only(tp_size: int) -> None:
    quant_bias = torch.arange(1, 9, dtype=torch.int32)
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        row = RowParallelLinear(16, 8, bias=False, params_dtype=torch.float32)
        p = add_param(row, "quant_bias", (8,), torch.int32, output_dim=0, row_parallel_rank0_only=True)
        row.weight_loader(p, quant_bias)
        assert torch.equal(p, quant_bias if rank == 0 else torch.zeros(8, dtype=torch.int32))
        with pytest.raises(ValueError, match="shape"):
            row.weight_loader(p, quant_bias[:4])
