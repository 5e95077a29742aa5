"""MTP (DeepSeek-V3 style, the MTP layer stored in the tiny target checkpoint): greedy output == plain greedy."""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams
from tests.integration.helpers import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> str:
    from tests.fixtures.tiny_deepseek_mtp import build_deepseek_mtp

    return str(build_deepseek_mtp(tmp_path_factory.mktemp("tiny_dsv3_mtp")))


def _run(model_dir: str, spec: dict | None, **kw):
    llm = LLM(model=model_dir, speculative_config=spec, dtype="float32", max_model_len=128, disable_log_stats=True,
              **kw)
    prompts = [[7, 8, 9, 10] * 5] + random_prompts(3, 512, 4, 24, seed=53)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_mtp_keeps_greedy_output(mtp_dir):
    plain, _ = _run(mtp_dir, None)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    out, llm = _run(mtp_dir, spec)
    assert out == plain
    stats = llm.llm_engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    layer = llm.llm_engine.engine_core.worker.model_runner.spec.proposer.layer
    assert type(layer.block.mlp).__name__ == "DeepseekMoE"  # layer L of this config is a MoE layer
    out, llm = _run(mtp_dir, spec, num_gpu_blocks_override=8, enable_prefix_caching=True)
    assert out == plain and llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0


def test_mtp_needs_the_mtp_layer(tmp_path):
    from tests.fixtures.tiny_deepseek import build_deepseek

    plain_dir = str(build_deepseek("v3", tmp_path / "no_mtp"))
    with pytest.raises(ValueError, match="MTP layer"):
        _run(plain_dir, {"method": "mtp", "num_speculative_tokens": 2})
