"""Every hardware profile produces the cpu profile's greedy tokens (310p: fp16, within a stated tolerance).

a2/a3/a5 emulate Ascend families on this device: same dtype as the cpu reference (bf16), different slot-mapping
dtype (int32), kernel alignment and RNG placement -> identical tokens required. 310p is fp16-only and swaps in the
compatibility attention backend (FA/PA/splitfuse masks), composed SiluAndMul, KV block zeroing and host-CDF sampling:
its greedy tokens must agree with the cpu fp32 reference on the first 16 tokens of every prompt and its chosen-token
logprobs must stay within 3e-2 (bf16-class) of the reference's.
"""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams
from tests.integration.helpers import random_prompts

NEW = 16


def _run(model: str, profile: str, dtype: str, prompts, **kw):
    llm = LLM(model=model, dtype=dtype, hardware_profile=profile, max_model_len=256, disable_log_stats=True,
              max_num_batched_tokens=64, max_num_seqs=64, **kw)  # small budget: chunked prefill on every backend
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return toks, lps


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tiny_llama_dir, tiny_qwen3_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen3_dir


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 512, 3, 90, seed=31)


@pytest.mark.parametrize("profile", ["a2", "a3", "a5"])
def test_ascent_emulated_profiles_equal_cpu(model_dir, prompts, profile):
    ref, _ = _run(model_dir, "cpu", "bfloat16", prompts)
    got, _ = _run(model_dir, profile, "bfloat16", prompts)
    assert got == ref


def test_310p_matches_cpu_within_fp16_tolerance(model_dir, prompts):
    ref, ref_lp = _run(model_dir, "cpu", "float32", prompts)
    got, got_lp = _run(model_dir, "310p", "auto", prompts)
    for r, g, rl, gl in zip(ref, got, ref_lp, got_lp):
        assert g == r
        assert max(abs(a - b) for a, b in zip(rl, gl)) <= 3e-2


def test_310p_selects_the_compatibility_paths(tiny_llama_dir):
    from ascent.layers.activation_compat import SiluAndMulComposed

    llm = LLM(model=tiny_llama_dir, hardware_profile="310p", max_model_len=256, disable_log_stats=True)
    core = llm.llm_engine.engine_core
    runner = core.worker.model_runner
    assert {layer.backend.get_name() for layer in runner.attention_layers()} == {"compat310p"}
    assert any(isinstance(m, SiluAndMulComposed) for m in runner.model.modules())
    assert runner.rng_placement == "host_cdf" and core.scheduler.zero_new_blocks
    for cache in runner.kv_caches:
        cache.fill_(7.0)  # stale data in every block: zeroing + masks must make it harmless
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    # the request's block (the pool hands out block 1 first) was zeroed before its 7 computed tokens were written;
    # a block never allocated keeps the stale data
    for cache in runner.kv_caches:
        assert bool((cache[:, 1, 7:] == 0).all()) and bool((cache[:, 1, :7] != 7.0).any())
        assert bool((cache[:, 2] == 7.0).all())


def test_310p_rejects_what_the_family_cannot_run(tiny_llama_dir):
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(model=tiny_llama_dir, hardware_profile="310p", dtype="bfloat16")


def test_smollm2_profiles_agree():
    prompts = [[1, 9690, 28, 253, 1345, 314], [504, 3458, 282, 4649, 314], [19556, 905, 30]]
    ref, ref_lp = _run(None, "cpu", "float32", prompts)
    got, got_lp = _run(None, "310p", "auto", prompts)
    for r, g, rl, gl in zip(ref, got, ref_lp, got_lp):
        assert g == r
        assert max(abs(a - b) for a, b in zip(rl, gl)) <= 3e-2
    bf_ref, _ = _run(None, "cpu", "bfloat16", prompts)
    assert _run(None, "a3", "bfloat16", prompts)[0] == bf_ref


def test_310p_zeroing_respects_the_mla_cache_layout(tmp_path):
    """MLA caches index blocks on dim 0; zeroing new blocks must not touch other blocks' rows (found in review)."""
    from tests.fixtures.tiny_deepseek import build_deepseek

    model = str(build_deepseek("v2", tmp_path / "ds"))
    prompts = random_prompts(4, 512, 55, 62, seed=3)
    ref, _ = _run(model, "cpu", "float16", prompts, block_size=64)
    got, _ = _run(model, "310p", "auto", prompts, block_size=64)
    assert got == ref
