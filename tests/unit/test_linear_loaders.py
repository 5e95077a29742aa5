"""Weight loaders: packed shard placement (q/k/v, gate/up), TP slicing under a simulated rank/size, vocab sharding,
and the model-loader registry (safetensors index / consolidated files, dummy, missing weights)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from ascent.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_tensor_parallel,
    tensor_model_parallel_all_reduce,
)
from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from ascent.loader.base import get_model, get_model_loader
from ascent.models.registry import get_model_class

HIDDEN, HEAD, HEADS, KV_HEADS = 32, 4, 8, 2


@pytest.fixture(autouse=True)
def reset_tp():
    yield
    init_tensor_parallel(0, 1)


def qkv_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(HEADS * HEAD, HIDDEN, generator=g), "k": torch.randn(KV_HEADS * HEAD, HIDDEN, generator=g),
        "v": torch.randn(KV_HEADS * HEAD, HIDDEN, generator=g), "qb": torch.randn(HEADS * HEAD, generator=g),
        "kb": torch.randn(KV_HEADS * HEAD, generator=g), "vb": torch.randn(KV_HEADS * HEAD, generator=g),
    }


def load_qkv(ckpt: dict[str, torch.Tensor]) -> QKVParallelLinear:
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, params_dtype=torch.float32, prefix="qkv")
    for sid in "vqk":  # any order
        layer.weight.weight_loader(layer.weight, ckpt[sid], sid)
        layer.bias.weight_loader(layer.bias, ckpt[sid + "b"], sid)
    return layer


def test_packed_placement_tp1() -> None:
    ckpt = qkv_checkpoint()
    layer = load_qkv(ckpt)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert torch.equal(layer.weight, torch.cat([ckpt["q"], ckpt["k"], ckpt["v"]]))
    x = torch.randn(5, HIDDEN)
    expected = torch.cat([F.linear(x, ckpt[s], ckpt[s + "b"]) for s in "qkv"], dim=-1)
    torch.testing.assert_close(layer(x), expected)
    fused = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, params_dtype=torch.bfloat16)
    fused.weight.weight_loader(fused.weight, layer.weight.data, None)
    assert fused.weight.dtype == torch.bfloat16 and torch.equal(fused.weight, layer.weight.data.bfloat16())

    gate, up = torch.randn(24, HIDDEN), torch.randn(24, HIDDEN)
    mlp = MergedColumnParallelLinear(HIDDEN, [24, 24], bias=False, params_dtype=torch.float32)
    mlp.weight.weight_loader(mlp.weight, up, 1)
    mlp.weight.weight_loader(mlp.weight, gate, 0)
    assert torch.equal(mlp.weight, torch.cat([gate, up]))
    torch.testing.assert_close(mlp(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_and_merged_tp_slicing(tp_size: int) -> None:
    ckpt = qkv_checkpoint()
    gate, up = torch.randn(24, HIDDEN), torch.randn(24, HIDDEN)
    replicas = max(1, tp_size // KV_HEADS)
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (rank, tp_size)
        layer = load_qkv(ckpt)
        nq, nkv = HEADS // tp_size, max(1, KV_HEADS // tp_size)
        kv_head = rank // replicas if replicas > 1 else rank * nkv
        q_rows = slice(rank * nq * HEAD, (rank + 1) * nq * HEAD)
        kv_rows = slice(kv_head * HEAD, (kv_head + nkv) * HEAD)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (nq, nkv, replicas)
        expected_w = torch.cat([ckpt["q"][q_rows], ckpt["k"][kv_rows], ckpt["v"][kv_rows]])
        expected_b = torch.cat([ckpt["qb"][q_rows], ckpt["kb"][kv_rows], ckpt["vb"][kv_rows]])
        assert torch.equal(layer.weight, expected_w) and torch.equal(layer.bias, expected_b)

        mlp = MergedColumnParallelLinear(HIDDEN, [24, 24], bias=False, params_dtype=torch.float32)
        mlp.weight.weight_loader(mlp.weight, torch.cat([gate, up]), None)
        rows = slice(rank * 24 // tp_size, (rank + 1) * 24 // tp_size)
        assert torch.equal(mlp.weight, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_column_row_shards_recompose(tp_size: int) -> None:
    w_col, b_col = torch.randn(16, HIDDEN), torch.randn(16)
    w_row, b_row = torch.randn(HIDDEN, 16), torch.randn(HIDDEN)
    x = torch.randn(3, HIDDEN)
    col_parts, row_sum = [], torch.zeros(3, HIDDEN)
    h = x @ w_col.T + b_col
    for rank in range(tp_size):
        init_tensor_parallel(rank, tp_size)
        col = ColumnParallelLinear(HIDDEN, 16, bias=True, params_dtype=torch.float32)
        col.weight.weight_loader(col.weight, w_col)
        col.bias.weight_loader(col.bias, b_col)
        assert torch.equal(col.weight, w_col.chunk(tp_size)[rank])
        col_parts.append(col(x))
        row = RowParallelLinear(16, HIDDEN, bias=True, params_dtype=torch.float32)
        row.weight.weight_loader(row.weight, w_row)
        row.bias.weight_loader(row.bias, b_row)
        assert torch.equal(row.weight, w_row.chunk(tp_size, dim=1)[rank]) and torch.equal(row.bias, b_row)
        row_sum += F.linear(h.chunk(tp_size, dim=-1)[rank], row.weight)
    torch.testing.assert_close(torch.cat(col_parts, dim=-1), h)
    torch.testing.assert_close(row_sum + b_row, h @ w_row.T + b_row)


def test_vocab_parallel_embedding_and_head_tp2() -> None:
    vocab, dim = 100, 8
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 5, 63, 64, 99, 70])
    hidden = torch.randn(4, dim)
    emb_sum, logits = torch.zeros(len(ids), dim), []
    for rank in range(2):
        init_tensor_parallel(rank, 2)
        emb = VocabParallelEmbedding(vocab, dim, torch.float32)
        emb.weight.weight_loader(emb.weight, table)
        assert emb.num_embeddings_padded == 128 and emb.weight.shape == (64, dim)
        in_shard = (ids >= emb.vocab_start_index) & (ids < emb.vocab_end_index)
        local = F.embedding((ids - emb.vocab_start_index) * in_shard, emb.weight) * in_shard[:, None]
        emb_sum += local
        head = ParallelLMHead(vocab, dim, params_dtype=torch.float32)
        head.weight.weight_loader(head.weight, table)
        logits.append(hidden @ head.weight.T)
    torch.testing.assert_close(emb_sum, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], hidden @ table.T)
    assert torch.all(torch.cat(logits, dim=-1)[:, vocab:] == 0)


def test_tp1_embedding_head_and_collectives() -> None:
    table = torch.randn(50, 8)
    emb = VocabParallelEmbedding(50, 8, torch.float32)
    emb.weight.weight_loader(emb.weight, table)
    head = ParallelLMHead(50, 8, params_dtype=torch.bfloat16).tie_weights(emb)
    assert head.weight is emb.weight
    ids = torch.tensor([3, 49, 0])
    assert torch.equal(emb(ids), table[ids])
    logits = head(table[ids])
    assert logits.dtype == torch.float32 and torch.allclose(logits, table[ids] @ table.T)
    x = torch.randn(3)
    assert tensor_model_parallel_all_reduce(x) is x


def test_loader_validation_errors() -> None:
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False)
    with pytest.raises(ValueError, match="shard id 'x'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(HEAD, HIDDEN), "x")
    with pytest.raises(ValueError, match=r"\(8, 31\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(KV_HEADS * HEAD, HIDDEN - 1), "k")
    rep = ReplicatedLinear(HIDDEN, 4, bias=False)
    with pytest.raises(ValueError, match="shape"):
        rep.weight.weight_loader(rep.weight, torch.zeros(5, HIDDEN))
    init_tensor_parallel(0, 3)
    with pytest.raises(ValueError, match="num_heads 8"):
        QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS)
    with pytest.raises(ValueError, match="rank 2"):
        init_tensor_parallel(2, 2)


def tiny_config(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**fields, **overrides})


def test_sharded_safetensors_index_and_consolidated_skip(tmp_path) -> None:
    config = tiny_config()
    torch.manual_seed(0)
    hf = HFLlama(config)
    hf.save_pretrained(str(tmp_path), max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_file({"garbage": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    model = get_model(str(tmp_path), config, torch.float32, "cpu", load_format="safetensors")
    state = hf.state_dict()
    layer = model.model.layers[1]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
        [state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.mlp.down_proj.weight, state["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"]) and not model.training
    auto = get_model(str(tmp_path), config, torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(auto.parameters(), model.parameters()))


def test_missing_weights_unknown_format_and_dummy(tmp_path) -> None:
    config = tiny_config()
    state = {k: v for k, v in HFLlama(config).state_dict().items() if "layers.0.self_attn.v_proj" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.0.self_attn.qkv_proj.weight"):
        get_model(str(tmp_path), config, torch.float32, "cpu")
    with pytest.raises(ValueError, match="'tensorizer'"):
        get_model_loader("tensorizer")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class(["GPT2LMHeadModel"])
    dummy_a = get_model("/nonexistent", config, torch.bfloat16, "cpu", load_format="dummy")
    dummy_b = get_model("/nonexistent", config, torch.bfloat16, "cpu", load_format="dummy")
    params_a = dict(dummy_a.named_parameters())
    assert all(torch.equal(p, params_a[n]) for n, p in dummy_b.named_parameters())
    assert params_a["model.norm.weight"].eq(1).all() and params_a["lm_head.weight"].abs().max() <= 1e-3
    assert params_a["lm_head.weight"].dtype == torch.bfloat16 and params_a["lm_head.weight"].std() > 0


def test_pickle_only_checkpoint_is_named_in_the_error(tmp_path) -> None:
    from ascent.loader.hf import safetensors_files

    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*.safetensors files .*pytorch_model.bin: PyTorch pickle"):
        safetensors_files(str(tmp_path))
