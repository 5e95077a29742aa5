"""Paged, chunked, batched forwards of our Llama/Qwen3 vs HF transformers' full-sequence forward.

Two or three requests run as one flattened batch per step: a first prefill chunk, a second chunk on top of the cached
prefix, a fresh full prefill mixed with decodes, a multi-token chunk mixed with decodes, plain decodes in varying
order, padding rows (slot -1). Every logit row is compared with HF's logits at the same position.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ascent.attention.backend import CommonAttentionMetadata
from ascent.attention.backends.sdpa import SDPABackend
from ascent.attention.layer import Attention
from ascent.forward_context import set_forward_context
from ascent.loader.base import get_model
from tests.fixtures.tiny_models import build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class PagedHarness:
    """Minimal stand-in for the model runner: block allocation, slot mapping, metadata, forward, logits."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.model = model
        dtype = next(model.parameters()).dtype
        for layer in (m for m in model.modules() if isinstance(m, Attention)):
            shape = SDPABackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.full(shape, float("nan"), dtype=dtype)  # unwritten slots poison any read
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))]
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.builder = SDPABackend.get_builder_cls()()

    def _slots(self, req: str, start: int, n: int) -> list[int]:
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) * BLOCK_SIZE < start + n:
            blocks.append(self.free.pop())
        return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]

    def step(self, chunks: list[tuple[str, list[int]]], pad: int = 0) -> dict[str, torch.Tensor]:
        ids, positions, slots, qsl, seq_lens, computed = [], [], [], [0], [], []
        for req, tokens in chunks:
            start = self.computed.get(req, 0)
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += self._slots(req, start, len(tokens))
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            computed.append(start)
        num_actual = len(ids)
        ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        width = max(len(self.blocks[r]) for r, _ in chunks) + 1
        table = np.zeros((len(chunks), width), dtype=np.int32)
        for i, (req, _) in enumerate(chunks):
            table[i, : len(self.blocks[req])] = self.blocks[req]
        np32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np32(qsl)), seq_lens=torch.from_numpy(np32(seq_lens)),
            num_computed_tokens=torch.from_numpy(np32(computed)), block_table=torch.from_numpy(table),
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_np=np32(qsl),
            seq_lens_np=np32(seq_lens), num_computed_tokens_np=np32(computed), num_reqs=len(chunks),
            num_actual_tokens=num_actual, max_query_len=max(np.diff(qsl)), max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
        )
        with torch.no_grad(), set_forward_context(self.builder.build(common)):
            hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
            assert hidden.shape[0] == num_actual + pad
            logits = self.model.compute_logits(hidden[:num_actual])
        assert logits.dtype == torch.float32
        out = {}
        for i, (req, tokens) in enumerate(chunks):
            out[req] = logits[qsl[i] : qsl[i + 1]]
            self.computed[req] = computed[i] + len(tokens)
        return out


def _schedule() -> list[tuple[list[tuple[str, slice]], int]]:
    """Steps as (list of (request, token slice), padding rows); A: 18 tokens, B: 14, C: 9."""
    s = slice
    return [
        ([("A", s(0, 6)), ("B", s(0, 4))], 0),
        ([("B", s(4, 9)), ("A", s(6, 13))], 2),
        ([("A", s(13, 14)), ("C", s(0, 7)), ("B", s(9, 10))], 0),
        ([("B", s(10, 11)), ("C", s(7, 8)), ("A", s(14, 15))], 3),
        ([("A", s(15, 17)), ("B", s(11, 12))], 0),
        ([("C", s(8, 9)), ("B", s(12, 13)), ("A", s(17, 18))], 1),
        ([("B", s(13, 14))], 0),
    ]


def _max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_and_compare(model_dir: str, dtype: torch.dtype, rel_tol: float, abs_tol: float) -> None:
    torch.manual_seed(0)
    lengths = {"A": 18, "B": 14, "C": 9}
    seqs = {r: torch.randint(3, 512, (n,)).tolist() for r, n in lengths.items()}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        ref = {r: hf(torch.tensor([t])).logits[0].float() for r, t in seqs.items()}
    config = AutoConfig.from_pretrained(model_dir)
    model = get_model(model_dir, config, dtype, torch.device("cpu"))
    harness = PagedHarness(model)
    checked = {r: 0 for r in seqs}
    for chunks, pad in _schedule():
        out = harness.step([(r, seqs[r][sl]) for r, sl in chunks], pad=pad)
        for r, sl in chunks:
            expected = ref[r][sl]
            diff = (out[r] - expected).abs().max()
            bound = rel_tol * expected.abs().max() + abs_tol
            assert diff <= bound, (r, sl, float(diff), _max_rel_err(out[r], expected))
            checked[r] += sl.stop - sl.start
    assert checked == lengths


@pytest.fixture(params=["llama", "qwen3", "qwen2"])
def tiny_dir(request, tiny_llama_dir: str, tiny_qwen3_dir: str, tiny_qwen2_dir: str) -> str:
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen2": tiny_qwen2_dir}[request.param]


def test_fp32_matches_hf(tiny_dir: str) -> None:
    run_and_compare(tiny_dir, torch.float32, 1e-4, 1e-5)


def test_bf16_matches_hf(tiny_dir: str) -> None:
    run_and_compare(tiny_dir, torch.bfloat16, 2e-2, 0.0)


VARIANTS = {
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                            low_freq_factor=1.0, high_freq_factor=4.0,
                                                            original_max_position_embeddings=64))),
    "llama-linear-rope-bias": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0),
                                             attention_bias=True, mlp_bias=True)),
    "qwen3-yarn-rope": ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                                          original_max_position_embeddings=64))),
    "qwen3-tied-embeddings": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-sliding-window": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen2-sliding-window-tied": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                                tie_word_embeddings=True)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_fp32(variant: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    kind, overrides = VARIANTS[variant]
    model_dir = str(build_model(kind, tmp_path_factory.mktemp(variant), seed=3, **overrides))
    config = AutoConfig.from_pretrained(model_dir)
    if variant == "qwen3-tied-embeddings":
        from ascent.loader.hf import iterate_safetensors_weights

        assert config.tie_word_embeddings
        assert not any(name.startswith("lm_head") for name, _ in iterate_safetensors_weights(model_dir))
    if variant in ("qwen3-sliding-window", "qwen2-sliding-window-tied"):
        assert config.layer_types == ["full_attention", "sliding_attention"]
    run_and_compare(model_dir, torch.float32, 1e-4, 1e-5)


@pytest.mark.parametrize("rope_scaling", [
    {"type": "yarn", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
])
def test_top_level_original_max_position_embeddings(rope_scaling: dict,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Phi-3-style config keeps the pretraining length at the top level, beside a legacy ``rope_scaling``;
    transformers (standardize_rope_params) and vLLM use it over the default the rope dict gets at config load."""
    from ascent.loader.model_info import derive_max_model_len

    model_dir = build_model("qwen3", tmp_path_factory.mktemp("top-level-original-max"), seed=3)
    config_path = Path(model_dir) / "config.json"
    fields = json.loads(config_path.read_text())
    fields.pop("rope_parameters", None)
    fields.update(rope_scaling=rope_scaling, rope_theta=10000.0, max_position_embeddings=64,
                  original_max_position_embeddings=16)
    config_path.write_text(json.dumps(fields))
    if rope_scaling.get("type") == "yarn":  # vLLM: a yarn model's length is the original one times the factor
        assert derive_max_model_len(AutoConfig.from_pretrained(model_dir), None) == 64
    run_and_compare(str(model_dir), torch.float32, 1e-4, 1e-5)
