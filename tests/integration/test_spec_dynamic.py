"""``dynamic: true``: per-request draft lengths follow acceptance (DynamicSpecScheduler wired into the runner).

These run with ``cost_gate: false``: with the cost gate a model-free proposer drafts first and the gate cuts its drafts
(tests/unit/test_spec_step_cost.py), and the scheduler's budget applies only without it (or to model drafters)."""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams
from tests.fixtures.scripted_proposer import BAD, GOOD, ScriptedProposer, plain_continuations, run_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
K = 4


_ScriptedProposer = ScriptedProposer


def _run(llm: LLM, prompts) -> list[list[int]]:
    return run_greedy(llm, prompts, GREEDY)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> dict[tuple[int, ...], list[int]]:
    return plain_continuations(tiny_llama_dir, GREEDY)


def _dynamic_llm(model_dir: str, plain) -> tuple[LLM, _ScriptedProposer]:
    spec = {"method": "ngram", "num_speculative_tokens": K, "dynamic": True,
            "dynamic_params": {"budget_update_interval": 2, "min_verify_tokens": 1, "cost_gate": False,
                               "goodput_arbiter": False}}  # the scheduler's budgets alone
    llm = LLM(model=model_dir, speculative_config=spec, dtype="float32", max_model_len=128, disable_log_stats=True)
    runner = llm.llm_engine.engine_core.worker.model_runner.spec
    proposer = _ScriptedProposer(runner.config, 128, plain)
    runner.proposer = proposer
    return llm, proposer


def test_always_rejected_request_drops_to_min_k(tiny_llama_dir, plain):
    llm, proposer = _dynamic_llm(tiny_llama_dir, plain)
    assert _run(llm, [BAD]) == [plain[tuple(BAD)]]
    budgets = proposer.budgets[tuple(BAD)]
    assert budgets[0] == K and budgets[-5:] == [1] * 5


def test_always_accepted_request_keeps_max_k(tiny_llama_dir, plain):
    llm, proposer = _dynamic_llm(tiny_llama_dir, plain)
    assert _run(llm, [GOOD]) == [plain[tuple(GOOD)]]
    budgets = [b for b in proposer.budgets[tuple(GOOD)] if b > 0]
    assert len(budgets) >= 3 and all(b == K for b in budgets[:-1])  # the last one may hit max_tokens only
    stats = llm.llm_engine.engine_core.scheduler.spec_stats_total
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_mixed_batch_gives_the_accepted_request_more_drafts(tiny_llama_dir, plain):
    llm, proposer = _dynamic_llm(tiny_llama_dir, plain)
    assert _run(llm, [GOOD, BAD]) == [plain[tuple(GOOD)], plain[tuple(BAD)]]
    good, bad = proposer.budgets[tuple(GOOD)], proposer.budgets[tuple(BAD)]
    assert good[3] > bad[3] and bad[-1] < K


def _scripted_llm(model_dir: str, plain, **spec_extra) -> tuple[LLM, _ScriptedProposer]:
    spec = {"method": "ngram", "num_speculative_tokens": K, **spec_extra}
    llm = LLM(model=model_dir, speculative_config=spec, dtype="float32", max_model_len=128, disable_log_stats=True)
    runner = llm.llm_engine.engine_core.worker.model_runner.spec
    proposer = _ScriptedProposer(runner.config, 128, plain)
    runner.proposer = proposer
    return llm, proposer


def test_rejected_request_drops_to_zero_drafts_and_is_reprobed(tiny_llama_dir, plain):
    llm, proposer = _scripted_llm(tiny_llama_dir, plain, dynamic=True,
                                  dynamic_params={"min_draft_survival": 0.3, "probe_interval": 4,
                                                  "cost_gate": False, "goodput_arbiter": False})
    assert _run(llm, [BAD]) == [plain[tuple(BAD)]]
    budgets = proposer.budgets[tuple(BAD)]  # propose() runs only when some request may draft; the uninformed
    # prior (1/2 per position) gives one draft first
    stats = llm.llm_engine.engine_core.scheduler.spec_stats_total
    assert budgets[0] == 1 and 2 <= len(budgets) <= 9 and set(budgets) == {1} and stats.num_accepted_tokens == 0
    assert stats.num_drafts == len(budgets)  # every non-zero budget is a (rejected) draft; idle steps draft nothing


def test_disable_by_batch_size_and_batch_size_schedule(tiny_llama_dir, plain):
    llm, proposer = _scripted_llm(tiny_llama_dir, plain, speculative_disable_by_batch_size=2)
    assert _run(llm, [GOOD, BAD]) == [plain[tuple(GOOD)], plain[tuple(BAD)]]
    assert proposer.budgets[tuple(GOOD)] == [] and proposer.budgets[tuple(BAD)] == []  # 2 running: never drafted
    assert llm.llm_engine.engine_core.scheduler.spec_stats_total.num_drafts == 0
    assert _run(llm, [GOOD]) == [plain[tuple(GOOD)]]
    assert proposer.budgets[tuple(GOOD)] and llm.llm_engine.engine_core.scheduler.spec_stats_total.num_drafts > 0

    llm, proposer = _scripted_llm(tiny_llama_dir, plain, num_speculative_tokens_per_batch_size=[[1, 1, 3], [2, 8, 1]])
    assert _run(llm, [GOOD, BAD]) == [plain[tuple(GOOD)], plain[tuple(BAD)]]
    assert set(proposer.budgets[tuple(GOOD)]) == {1}
    assert _run(llm, [GOOD]) == [plain[tuple(GOOD)]]
    assert max(proposer.budgets[tuple(GOOD)]) == 3
