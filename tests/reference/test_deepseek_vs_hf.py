"""DeepSeek-V2/V3 (MLA + MoE) vs HF transformers' non-absorbed reference.

1. One MLA layer (q-LoRA and plain q_proj, interleaved and NeoX RoPE, YaRN mscale) run paged over several engine-like
   steps (chunked prefill on a cached prefix, absorbed decodes, padding rows) vs HF's attention module on the whole
   sequence.
2. Whole tiny models, paged and batched, vs HF's full-sequence logits.
3. The engine (``LLM``): greedy tokens equal to HF's cached greedy loop, teacher-forced logprobs within 1e-4
   relative; prefix caching on == off; chunked prefill (max_num_batched_tokens=7) == off.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ascent import LLM, SamplingParams
from ascent.attention.backend import CommonAttentionMetadata
from ascent.attention.backends.mla import MLABackend
from ascent.attention.mla_layer import MLAAttention, build_mla_rope
from ascent.forward_context import set_forward_context
from ascent.loader.base import get_model
from tests.fixtures.tiny_deepseek import build_deepseek, deepseek_config
from tests.integration.helpers import hf_greedy, hf_logprobs, random_prompts, token_ids

BLOCK_SIZE = 4
NUM_BLOCKS = 40


class PagedHarness:
    """Block allocation, slot mapping and MLA metadata for a sequence of steps; caches start NaN (stray reads
    poison the result)."""

    def __init__(self, modules: list[torch.nn.Module], workspace_tokens: int | None = None, seed: int = 0) -> None:
        for layer in modules:
            shape = layer.backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.full(shape, float("nan"))
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))]
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.builder = MLABackend.get_builder_cls()(max_model_len=64, max_num_seqs=4,
                                                   workspace_tokens=workspace_tokens)

    def _slots(self, req: str, start: int, n: int) -> list[int]:
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) * BLOCK_SIZE < start + n:
            blocks.append(self.free.pop())
        return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]

    def prepare(self, chunks: list[tuple[str, int]], pad: int) -> tuple[object, torch.Tensor, list[int]]:
        """chunks: (request, number of new tokens) -> (metadata, positions int64 [T], query_start_loc)."""
        positions, slots, qsl, seq_lens, computed = [], [], [0], [], []
        for req, n in chunks:
            start = self.computed.get(req, 0)
            positions += range(start, start + n)
            slots += self._slots(req, start, n)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            computed.append(start)
            self.computed[req] = start + n
        table = np.zeros((len(chunks), max(len(self.blocks[r]) for r, _ in chunks) + 1), dtype=np.int32)
        for i, (req, _) in enumerate(chunks):
            table[i, : len(self.blocks[req])] = self.blocks[req]
        np32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np32(qsl)), seq_lens=torch.from_numpy(np32(seq_lens)),
            num_computed_tokens=torch.from_numpy(np32(computed)), block_table=torch.from_numpy(table),
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64), query_start_loc_np=np32(qsl),
            seq_lens_np=np32(seq_lens), num_computed_tokens_np=np32(computed), num_reqs=len(chunks),
            num_actual_tokens=qsl[-1], max_query_len=int(max(np.diff(qsl))), max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
        )
        return self.builder.build(common), torch.tensor(positions + [0] * pad, dtype=torch.int64), qsl


SCHEDULE = [  # (request, token slice) per step, then padding rows; A: 18 tokens, B: 14, C: 9
    ([("A", slice(0, 6)), ("B", slice(0, 4))], 0),
    ([("B", slice(4, 9)), ("A", slice(6, 13))], 2),
    ([("A", slice(13, 14)), ("C", slice(0, 7)), ("B", slice(9, 10))], 0),
    ([("B", slice(10, 11)), ("C", slice(7, 8)), ("A", slice(14, 15))], 3),
    ([("A", slice(15, 17)), ("B", slice(11, 12))], 0),
    ([("C", slice(8, 9)), ("B", slice(12, 13)), ("A", slice(17, 18))], 1),
    ([("B", slice(13, 14))], 0),
]
LENGTHS = {"A": 18, "B": 14, "C": 9}

LAYER_VARIANTS = {
    "v2-q-lora": ("v2", {}),
    "v2-no-q-lora-yarn": ("v2", dict(q_lora_rank=None, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, mscale=0.9,
        mscale_all_dim=1.0))),
    "v3-interleave-yarn": ("v3", {}),
    "v3-neox-bias": ("v3", dict(rope_interleave=False, attention_bias=True, v_head_dim=12)),
}


def _hf_attention(kind: str, overrides: dict) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    config = deepseek_config(kind, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
    return model.model.layers[0].self_attn, model.model.rotary_emb, config


def _ours(hf_attn: torch.nn.Module, config: object, prefix: str) -> MLAAttention:
    layer = MLAAttention(config, build_mla_rope(config, torch.float32), torch.float32, prefix=prefix)
    params = dict(layer.named_parameters())
    for name, tensor in hf_attn.state_dict().items():
        params[name].weight_loader(params[name], tensor)
    assert set(params) == set(hf_attn.state_dict())
    layer.process_weights_after_loading()
    return layer


def _hf_full(hf_attn: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    pos = torch.arange(n).unsqueeze(0)
    mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
    with torch.no_grad():
        return hf_attn(x.unsqueeze(0), position_embeddings=rotary(x.unsqueeze(0), pos), attention_mask=mask)[0][0]


@pytest.mark.parametrize("workspace", [None, 4])
@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
def test_mla_layer_paged_matches_hf(variant: str, workspace: int | None) -> None:
    kind, overrides = LAYER_VARIANTS[variant]
    hf_attn, rotary, config = _hf_attention(kind, overrides)
    layer = _ours(hf_attn, config, "model.layers.0.self_attn")
    assert layer.layer_name == "model.layers.0.self_attn.attn" and layer.head_size == 40 and layer.num_kv_heads == 1
    torch.manual_seed(1)
    xs = {r: torch.randn(n, config.hidden_size) for r, n in LENGTHS.items()}
    ref = {r: _hf_full(hf_attn, rotary, x) for r, x in xs.items()}
    harness = PagedHarness([layer], workspace_tokens=workspace)
    for chunks, pad in SCHEDULE:
        md, positions, qsl = harness.prepare([(r, sl.stop - sl.start) for r, sl in chunks], pad)
        x = torch.cat([xs[r][sl] for r, sl in chunks] + [torch.randn(pad, config.hidden_size)])
        with torch.no_grad(), set_forward_context({layer.layer_name: md}):
            out = layer(positions, x)
        for i, (r, sl) in enumerate(chunks):
            expected = ref[r][sl]
            err = float((out[qsl[i] : qsl[i + 1]] - expected).abs().max())
            assert err <= 1e-5 * max(1.0, float(expected.abs().max())), (variant, r, sl, err)
    with torch.no_grad(), set_forward_context(None):
        dummy = layer(torch.arange(LENGTHS["A"]), xs["A"])
    assert (dummy - ref["A"]).abs().max() <= 1e-5 * max(1.0, float(ref["A"].abs().max()))


# ----------------------------------------------------------------------------------------------- whole models
@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_deepseek(request.param, tmp_path_factory.mktemp(f"tiny_deepseek_{request.param}"), seed=2))


@pytest.fixture(scope="module")
def hf_model(deepseek_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()


def test_loader_builds_mla_moe_model(deepseek_dir: str) -> None:
    model = get_model(deepseek_dir, AutoConfig.from_pretrained(deepseek_dir), torch.float32, torch.device("cpu"))
    from ascent.layers.fused_moe import FusedMoE

    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(mla) == 2 and len(moe) == 1
    v3 = "v3" in deepseek_dir
    assert (moe[0].e_score_correction_bias is not None) == v3
    assert type(moe[0].router).__name__ == "GroupedTopKRouter" and moe[0].router.group_select_mode == int(v3)
    if v3:
        assert moe[0].e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("workspace", [None, 4])
def test_paged_model_logits_match_hf(deepseek_dir: str, hf_model: torch.nn.Module, workspace: int | None) -> None:
    torch.manual_seed(0)
    seqs = {r: torch.randint(3, 512, (n,)).tolist() for r, n in LENGTHS.items()}
    with torch.no_grad():
        ref = {r: hf_model(torch.tensor([t])).logits[0] for r, t in seqs.items()}
    model = get_model(deepseek_dir, AutoConfig.from_pretrained(deepseek_dir), torch.float32, torch.device("cpu"))
    harness = PagedHarness([m for m in model.modules() if isinstance(m, MLAAttention)], workspace_tokens=workspace)
    for chunks, pad in SCHEDULE:
        md, positions, qsl = harness.prepare([(r, sl.stop - sl.start) for r, sl in chunks], pad)
        ids = torch.tensor(sum((seqs[r][sl] for r, sl in chunks), []) + [0] * pad, dtype=torch.int64)
        with torch.no_grad(), set_forward_context(md):
            logits = model.compute_logits(model(ids, positions)[: qsl[-1]])
        for i, (r, sl) in enumerate(chunks):
            expected = ref[r][sl]
            err = float((logits[qsl[i] : qsl[i + 1]] - expected).abs().max())
            assert err <= 1e-4 * float(expected.abs().max()) + 1e-5, (r, sl, err)


# ----------------------------------------------------------------------------------------------- engine
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(37)]
    return random_prompts(3, 512, 3, 30, seed=4) + [shared + [rng.randrange(3, 512) for _ in range(k)] for k in (2, 9)]


def _llm(model_dir: str, **kw: object) -> LLM:
    args: dict = dict(dtype="float32", max_model_len=128, max_num_seqs=8, disable_log_stats=True)
    args.update(kw)
    return LLM(model=model_dir, **args)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference_run(deepseek_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = _prompts()
    return prompts, token_ids(_run(_llm(deepseek_dir, enable_prefix_caching=False), prompts))


def test_engine_greedy_and_logprobs_match_hf(deepseek_dir: str, hf_model: torch.nn.Module, reference_run) -> None:
    prompts, ours = reference_run
    assert ours == hf_greedy(hf_model, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = _run(_llm(deepseek_dir, enable_prefix_caching=False), prompts[:3], params)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt, list(comp.token_ids))
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[step, tid].item()) <= 1e-4 * max(1.0, abs(ref[step, tid].item()))


def test_prefix_caching_on_equals_off(deepseek_dir: str, reference_run) -> None:
    prompts, expected = reference_run
    llm = _llm(deepseek_dir, enable_prefix_caching=True)
    first, again = _run(llm, prompts), _run(llm, prompts)
    assert token_ids(first) == expected and token_ids(again) == expected
    assert all(out.num_cached_tokens == (len(p) - 1) // 16 * 16 for p, out in zip(prompts, again))
    assert any(out.num_cached_tokens > 0 for out in again)


def test_chunked_prefill_equals_unchunked(deepseek_dir: str, reference_run) -> None:
    prompts, expected = reference_run
    llm = _llm(deepseek_dir, max_num_batched_tokens=7, max_num_seqs=7, enable_prefix_caching=True)
    assert token_ids(_run(llm, prompts)) == expected
