"""EAGLE-1 / EAGLE-3 and Medusa heads (random weights in the published layouts): greedy output == plain greedy output,
also under preemption with prefix caching; acceptance metrics are reported; layout details load as published."""

from __future__ import annotations

import pytest
import torch

from ascent import LLM, SamplingParams
from tests.fixtures.eagle_heads import build_eagle1_head, build_eagle3_head, build_medusa_heads
from tests.integration.helpers import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rep = [21, 22, 23, 24] * 6
    return [rep, rep[:9] + [50, 51] + rep[:7]] + random_prompts(3, 512, 4, 30, seed=47)


def _make(model_dir: str, spec: dict | None = None, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=256, disable_log_stats=True)
    args.update(kw)
    return LLM(model=model_dir, speculative_config=spec, **args)


def _run(llm: LLM, prompts=None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts or _prompts()], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle": str(build_eagle1_head(root / "eagle1", tiny_llama_dir)),
        "eagle_embed": str(build_eagle1_head(root / "eagle1e", tiny_llama_dir, seed=1, with_embed=True)),
        "eagle3": str(build_eagle3_head(root / "eagle3", tiny_llama_dir, [0, 1, 2], draft_vocab_size=200)),
        "medusa": str(build_medusa_heads(root / "medusa", tiny_llama_dir, num_heads=3)),
        "medusa_vllm": str(build_medusa_heads(root / "medusa_v", tiny_llama_dir, num_heads=2, num_layers=2,
                                              layout="vllm")),
    }


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> list[list[int]]:
    return _run(_make(tiny_llama_dir))


CASES = [("eagle", "eagle", 3), ("eagle", "eagle_embed", 2), ("eagle3", "eagle3", 3), ("medusa", "medusa", 3),
         ("medusa", "medusa_vllm", 2)]


@pytest.mark.parametrize("method,head,k", CASES)
def test_head_keeps_greedy_output(tiny_llama_dir, heads, plain, method, head, k):
    llm = _make(tiny_llama_dir, {"method": method, "num_speculative_tokens": k, "model": heads[head]})
    assert _run(llm) == plain
    stats = llm.llm_engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert len(stats.accepted_per_pos) == k and stats.num_accepted_tokens == sum(stats.accepted_per_pos)


@pytest.mark.parametrize("method,head", [("eagle", "eagle"), ("eagle3", "eagle3")])
def test_head_under_preemption_and_prefix_caching(tiny_llama_dir, heads, plain, method, head):
    llm = _make(tiny_llama_dir, {"method": method, "num_speculative_tokens": 3, "model": heads[head]},
                num_gpu_blocks_override=8, enable_prefix_caching=True)
    assert _run(llm) == plain
    assert _run(llm) == plain
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0


def test_eagle3_layout(tiny_llama_dir, heads):
    """Aux layers are captured on the target; drafts stay inside the draft vocabulary (d2t mapping)."""
    llm = _make(tiny_llama_dir, {"method": "eagle3", "num_speculative_tokens": 3, "model": heads["eagle3"]})
    runner = llm.llm_engine.engine_core.worker.model_runner
    proposer = runner.spec.proposer
    assert runner.model.model.capture_layers == (0, 1, 2)
    head = proposer.head
    assert head.lm_head.weight.shape[0] == 200 and head.fc.weight.shape[1] == 3 * 64
    allowed = set((torch.arange(200) + head.d2t.cpu()).tolist())
    drafts = []
    original = proposer.propose

    def recording(req_ids, token_ids, max_num_tokens):
        out = original(req_ids, token_ids, max_num_tokens)
        drafts.extend(t for t in out.reshape(-1).tolist() if t >= 0)
        return out

    proposer.propose = recording
    _run(llm)
    assert drafts and set(drafts) <= allowed


def test_eagle1_shares_target_embedding_unless_shipped(tiny_llama_dir, heads):
    shared = _make(tiny_llama_dir, {"method": "eagle", "num_speculative_tokens": 2, "model": heads["eagle"]})
    runner = shared.llm_engine.engine_core.worker.model_runner
    assert runner.spec.proposer.head.embed_tokens is runner.model.model.embed_tokens
    own = _make(tiny_llama_dir, {"method": "eagle", "num_speculative_tokens": 2, "model": heads["eagle_embed"]})
    runner = own.llm_engine.engine_core.worker.model_runner
    assert runner.spec.proposer.head.embed_tokens is not runner.model.model.embed_tokens


def test_eagle3_bad_aux_layers_is_a_value_error(tiny_llama_dir, heads):
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "model": heads["eagle3"],
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}}
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        _make(tiny_llama_dir, spec)


def test_medusa_rejects_more_tokens_than_heads(tiny_llama_dir, heads):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _make(tiny_llama_dir, {"method": "medusa", "num_speculative_tokens": 4, "model": heads["medusa"]})
