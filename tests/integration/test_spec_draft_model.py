"""Draft-model speculation end to end: a separate tiny model (same vocabulary) or the target truncated to N layers.

Greedy output with speculation == plain greedy output (also under preemption with a tiny KV budget and with prefix
caching); the target as its own draft gets every draft accepted; probabilistic drafts keep the target's sampling
distribution (two-sample chi-square on the tokens that go through verification).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from ascent import LLM, SamplingParams
from tests.integration.helpers import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rep = [11, 12, 13, 14, 15, 16] * 5
    return [rep, rep[:17] + [40, 41] + rep[:9]] + random_prompts(3, 512, 4, 30, seed=43)


def _make(model_dir: str, spec: dict | None = None, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=256, disable_log_stats=True)
    args.update(kw)
    return LLM(model=model_dir, speculative_config=spec, **args)


def _run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_stats_total


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir, tiny_qwen3_dir) -> dict[str, str]:
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}


@pytest.fixture(scope="module")
def plain(dirs) -> dict[str, list[list[int]]]:
    return {name: _run(_make(d), _prompts()) for name, d in dirs.items()}


@pytest.mark.parametrize("target,draft", [("llama", "qwen3"), ("qwen3", "llama")])
def test_separate_draft_model_keeps_greedy_output(dirs, plain, target, draft):
    llm = _make(dirs[target], {"method": "draft_model", "num_speculative_tokens": 3, "model": dirs[draft]})
    assert _run(llm, _prompts()) == plain[target]
    stats = _stats(llm)
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0


@pytest.mark.parametrize("target", ["llama", "qwen3"])
def test_target_as_its_own_draft_accepts_everything(dirs, plain, target):
    """Oracle: the target truncated to all of its layers drafts exactly its greedy continuation."""
    llm = _make(dirs[target], {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2})
    assert _run(llm, _prompts()) == plain[target]
    stats = _stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_truncated_draft_shares_target_weights(dirs, plain):
    llm = _make(dirs["llama"], {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 1})
    runner = llm.llm_engine.engine_core.worker.model_runner
    draft = runner.spec.proposer.model
    assert len(draft.model.layers) == 1
    assert draft.lm_head.weight is runner.model.lm_head.weight
    assert draft.model.layers[0].mlp.down_proj.weight is runner.model.model.layers[0].mlp.down_proj.weight
    assert _run(llm, _prompts()) == plain["llama"]


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "qwen3"},
    {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2},
])
def test_draft_model_under_preemption_and_prefix_caching(dirs, plain, spec):
    spec = dict(spec)
    if spec.get("model"):
        spec["model"] = dirs[spec["model"]]
    llm = _make(dirs["llama"], spec, num_gpu_blocks_override=8, enable_prefix_caching=True)
    assert _run(llm, _prompts()) == plain["llama"]
    assert _run(llm, _prompts()) == plain["llama"]  # second pass: prefix-cache hits
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    mgr = llm.llm_engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1
    draft_runner = llm.llm_engine.engine_core.worker.model_runner.spec.proposer.runner
    assert draft_runner.pool.num_blocks == 8  # the override sizes both pools


def test_draft_kv_shares_the_budget(dirs):
    """With a byte budget, blocks = budget // (target + draft bytes per block)."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 1}
    budget = 1 << 20
    llm = _make(dirs["llama"], spec, kv_cache_memory_bytes=budget)
    runner = llm.llm_engine.engine_core.worker.model_runner
    per_block = runner.kv_cache_bytes_per_block()
    draft_bytes = runner.spec.proposer.runner.kv_cache_bytes_per_block()
    assert 0 < draft_bytes < per_block
    assert llm.llm_engine.engine_core.num_blocks == budget // per_block


@pytest.fixture(scope="module")
def peaked_llama_dir(tmp_path_factory) -> str:
    """A tiny Llama whose lm_head is scaled up, so temperature-1 distributions are peaked (a sharper test)."""
    from safetensors.torch import load_file, save_file

    from tests.fixtures.tiny_models import build_model

    path = Path(build_model("llama", tmp_path_factory.mktemp("peaked_llama"), seed=3))
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def _token_counts(model_dir: str, spec: dict | None, num: int) -> tuple[list[Counter], object]:
    llm = _make(model_dir, spec, max_model_len=64, max_num_seqs=256, seed=7 if spec else 11)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = _run(llm, [[5, 17, 33, 9, 100, 250, 7]] * num, params)
    return [Counter(o[pos] for o in outs) for pos in range(3)], _stats(llm)


def test_probabilistic_drafts_keep_the_sampling_distribution(peaked_llama_dir):
    """Tokens 2 and 3 go through verification (token 1 comes from the prefill): two-sample chi-square, p > 1e-3."""
    num = 1500
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 1,
            "draft_sample_method": "probabilistic"}
    plain_counts, _ = _token_counts(peaked_llama_dir, None, num)
    spec_counts, stats = _token_counts(peaked_llama_dir, spec, num)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both accept and reject paths ran
    for pos in range(3):
        a, b = plain_counts[pos], spec_counts[pos]
        keys = sorted(k for k in set(a) | set(b) if a[k] + b[k] >= 10)
        table = np.array([[c[k] for k in keys] + [num - sum(c[k] for k in keys)] for c in (a, b)])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (pos, table)
