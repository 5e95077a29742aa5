"""Quantized lm_head / embedding tables (vLLM Ascend's ``AscendEmbeddingMethod``: the linear scheme of the layer's
quant type on a ``VocabParallelEmbedding``).

* end to end through ``get_model``: a hand-made ModelSlim checkpoint whose description marks ``lm_head.weight`` and
  ``model.embed_tokens.weight`` ``W8A16`` (int8 rows + per-row ``weight_scale`` / ``weight_offset``) gives the logits
  of HF transformers run on the dequantized tables;
* lm_head with an activation-quantized scheme (W8A8_DYNAMIC) and vocab sharding over two TP ranks (padding rows
  zero) equals the TP=1 head; an input embedding with W4A16 pack-quantized asymmetric groups dequantizes exactly the
  looked-up rows, also sharded; a bf16 W8A8-dynamic head writes float32 logits straight from its kernels;
* what is not supported says so: an activation-quantized *input* embedding, quantized tied embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from ascent.distributed.parallel_state import init_tensor_parallel
from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.loader.base import get_model
from ascent.quantization.base import QuantizationConfig, QuantSpec
from ascent.quantization.kernels import int8_linear_dynamic
from ascent.quantization.method_adapters import QuantEmbeddingMethod
from tests.fixtures.tiny_models import build_model
from tests.unit.quant.scheme_utils import gaussian, quant_asym, quant_sym, rel, t
from tests.reference.test_models_vs_hf import PagedHarness
from tests.unit.quant.test_quant_loading import hf_reference, quantize_w8a16, write_w8a16

VOCAB, DIM = 100, 64  # TP=2 pads the vocab to 128: 64 rows per rank, rank 1 holds 36 real rows


class OneSpec(QuantizationConfig):
    """Every embedding-kind layer gets ``spec`` (built through the real ``quant_method_for``)."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec

    @classmethod
    def from_model_dir(cls, model_dir, hf_config):
        raise ValueError("not file based")

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        return self.spec if layer_type == "embedding" else None


class Float32First(torch.nn.Module):
    """The model behind a float32 first parameter: the paged harness takes the KV-cache dtype from the first
    parameter, which is the (now int8) embedding table."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.inner = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


@pytest.fixture(autouse=True)
def reset_tp():
    yield
    init_tensor_parallel(0, 1)


def _load(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    params = dict(layer.named_parameters())
    for name, value in tensors.items():
        params[name].weight_loader(params[name], value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_modelslim_w8a16_lm_head_and_embedding_end_to_end(tmp_path: Path) -> None:
    float_dir = build_model("qwen3", tmp_path / "float")
    quant_dir = tmp_path / "w8a16_head"
    dequant = write_w8a16(float_dir, quant_dir, description_name="quant_model_description.json")
    tensors = load_file(str(quant_dir / "model.safetensors"))
    desc = json.loads((quant_dir / "quant_model_description.json").read_text())
    for module in ("lm_head", "model.embed_tokens"):
        q, s = quantize_w8a16(tensors[f"{module}.weight"])
        tensors.update({f"{module}.weight": q, f"{module}.weight_scale": s,
                        f"{module}.weight_offset": torch.zeros_like(s)})
        desc.update({f"{module}.weight": "W8A16", f"{module}.weight_scale": "W8A16",
                     f"{module}.weight_offset": "W8A16"})
        dequant[f"{module}.weight"] = q.float() * s
    save_file(tensors, str(quant_dir / "model.safetensors"))
    (quant_dir / "quant_model_description.json").write_text(json.dumps(desc))
    model = get_model(str(quant_dir), AutoConfig.from_pretrained(str(quant_dir)), torch.float32, "cpu")
    for layer in (model.lm_head, model.model.embed_tokens):
        assert isinstance(layer.quant_method, QuantEmbeddingMethod)
        assert layer.quant_method.scheme.spec.quant_type == "W8A16"
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (512, 1)
    ids = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = PagedHarness(Float32First(model)).step([("r", ids)])["r"]
    ref = hf_reference(float_dir, dequant, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_w8a8_dynamic_lm_head_vocab_sharded_over_two_ranks() -> None:
    w, b, hidden = gaussian((VOCAB, DIM), 70, 0.05), gaussian((VOCAB,), 71, 0.1), t(gaussian((5, DIM), 72))
    q, s = quant_sym(w, 8)
    ckpt = {"weight": t(q), "weight_scale": t(s), "weight_offset": torch.zeros(VOCAB, 1)}
    config = OneSpec(QuantSpec("W8A8_DYNAMIC", layer_type="embedding"))
    full = _load(ParallelLMHead(VOCAB, DIM, bias=True, params_dtype=torch.float32, prefix="lm_head",
                                quant_config=config), {**ckpt, "bias": t(b)})
    logits = full(hidden)
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    reference = full.quant_method.apply_reference(full, hidden, full.bias)
    assert rel(logits.numpy(), reference.numpy()) < 1e-5
    assert rel(logits.numpy(), hidden.numpy() @ w.T + b) < 2e-2
    parts = []
    for rank in range(2):
        init_tensor_parallel(rank, 2)
        head = _load(ParallelLMHead(VOCAB, DIM, bias=True, params_dtype=torch.float32, prefix="lm_head",
                                    quant_config=config), {**ckpt, "bias": t(b)})
        assert head.weight.shape == (64, DIM) and head.weight_scale.shape == (64, 1)
        if rank == 1:
            assert not bool(head.weight[36:].any()) and torch.equal(head.weight[:36], t(q[64:]))
        parts.append(head.quant_method.apply(head, hidden, head.bias))  # the all-gather concatenates these
    init_tensor_parallel(0, 1)
    torch.testing.assert_close(torch.cat(parts, -1)[:, :VOCAB], logits, rtol=1e-6, atol=1e-6)


def test_w8a8_dynamic_bf16_lm_head_writes_float32_logits_unrounded() -> None:
    """A bf16 model's W8A8-dynamic head: the kernels write float32 logits directly (the widened hidden state quantizes
    to the same int8 rows), equal to the float32 reference; rounded to bf16 they are ``apply``'s bf16 output."""
    vocab = 128  # N % 16 == 0 and K % 64 == 0: the AMX-INT8 tiles where the CPU has them, else the VNNI kernel
    w, b = gaussian((vocab, DIM), 73, 0.05), gaussian((vocab,), 74, 0.1)
    hidden = t(gaussian((3, DIM), 75)).to(torch.bfloat16)
    q, s = quant_sym(w, 8)
    head = _load(ParallelLMHead(vocab, DIM, bias=True, params_dtype=torch.bfloat16, prefix="lm_head",
                                quant_config=OneSpec(QuantSpec("W8A8_DYNAMIC", layer_type="embedding"))),
                 {"weight": t(q), "weight_scale": t(s), "weight_offset": torch.zeros(vocab, 1), "bias": t(b)})
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, vocab)
    exact = int8_linear_dynamic(hidden.float(), head.weight.t(), head.weight_scale.float().reshape(-1),
                                head.bias.float())
    assert torch.equal(logits, exact)
    bf16_out = head.quant_method.apply(head, hidden, head.bias)
    assert bf16_out.dtype == torch.bfloat16 and torch.equal(logits.to(torch.bfloat16), bf16_out)
    assert not torch.equal(logits, bf16_out.float())  # the unrounded values differ from the widened bf16 ones
    head.quant_method.scheme.force_reference = True  # the reference path: float32 too, unrounded
    reference = head(hidden)
    assert reference.dtype == torch.float32 and rel(reference.numpy(), logits.numpy()) < 1e-5
    assert not torch.equal(reference, reference.to(torch.bfloat16).float())


def test_w4a16_pack_quantized_embedding_rows() -> None:
    vocab = VOCAB + 4  # zero points are packed 8 rows per int32: N % 8 == 0 (also per rank: 64 + 40 rows)
    w = gaussian((vocab, DIM), 80, 0.05) + 0.01  # shifted: asymmetric zero points are non-trivial
    q, s, zp = quant_asym(w, 4, 32)
    w_deq = t((q.astype(np.float64) - np.repeat(zp, 32, 1)) * np.repeat(s, 32, 1))
    spec = QuantSpec("W4A16", layer_type="embedding", source_format="compressed-tensors", weight_bits=4,
                     weight_strategy="group", group_size=32, weight_symmetric=False)
    ckpt = {"weight_packed": ct_pack(t(q), 4, 1), "weight_scale": t(s), "weight_shape": torch.tensor([vocab, DIM]),
            "weight_zero_point": ct_pack(t(zp), 4, 0)}
    ids = torch.tensor([[0, 5, 63], [64, 103, 70]])
    full = _load(VocabParallelEmbedding(vocab, DIM, torch.float32, prefix="embed", quant_config=OneSpec(spec)), ckpt)
    rows = full(ids)
    assert rows.shape == (2, 3, DIM) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, w_deq[ids].float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(rows, full.quant_method.dequantized_weight(full)[ids])
    total = torch.zeros_like(rows)
    for rank in range(2):  # forward's masked lookup per shard; the all-reduce sums these
        init_tensor_parallel(rank, 2)
        shard = _load(VocabParallelEmbedding(vocab, DIM, torch.float32, prefix="embed",
                                             quant_config=OneSpec(spec)), ckpt)
        assert shard.weight_packed.shape == (64, DIM // 8) and shard.weight_zero_point.shape == (8, DIM // 32)
        in_shard = (ids >= shard.vocab_start_index) & (ids < shard.vocab_end_index)
        total += shard._rows((ids - shard.vocab_start_index) * in_shard) * in_shard.unsqueeze(-1)
    init_tensor_parallel(0, 1)
    torch.testing.assert_close(total, rows, rtol=0, atol=0)


def test_unsupported_quantized_tables_are_named_errors() -> None:
    dynamic = OneSpec(QuantSpec("W8A8_DYNAMIC", layer_type="embedding"))
    with pytest.raises(NotImplementedError, match=r"quant_type='W8A8_DYNAMIC' for layer_type='embedding' "
                                                  r"\('model.embed_tokens'\).*lm_head only"):
        VocabParallelEmbedding(VOCAB, DIM, torch.float32, prefix="model.embed_tokens", quant_config=dynamic)
    with pytest.raises(NotImplementedError, match=r"quant_type='W9A9' for layer_type='embedding'"):
        ParallelLMHead(VOCAB, DIM, params_dtype=torch.float32, prefix="lm_head",
                       quant_config=OneSpec(QuantSpec("W9A9", layer_type="embedding")))
    w8a16 = OneSpec(QuantSpec("W8A16", layer_type="embedding"))
    head = ParallelLMHead(VOCAB, DIM, params_dtype=torch.float32, prefix="lm_head", quant_config=w8a16)
    with pytest.raises(NotImplementedError, match="tied word embeddings"):
        head.tie_weights(VocabParallelEmbedding(VOCAB, DIM, torch.float32, prefix="model.embed_tokens"))
    with pytest.raises(ValueError, match=r"lm_head: checkpoint shape \(99, 64\) != \(100, 64\)"):
        head.weight.weight_loader(head.weight, torch.zeros(VOCAB - 1, DIM, dtype=torch.int8))
