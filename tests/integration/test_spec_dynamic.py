"""``dynamic: true``: per-request draft lengths follow acceptance (DynamicSpecScheduler wired into the runner)."""

from __future__ import annotations

import numpy as np
import pytest

from ascent import LLM, SamplingParams
from ascent.spec_decode.base import Proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
GOOD, BAD = [31, 32, 33, 34, 35, 36, 37], [91, 92, 93, 94, 95]
K = 4


class _ScriptedProposer(Proposer):
    """Drafts the true greedy continuation for GOOD, tokens that are never right for BAD (test-only)."""

    def __init__(self, config, max_model_len, truth: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(config, max_model_len)
        self.truth = truth
        self.budgets: dict[tuple[int, ...], list[int]] = {p: [] for p in truth}

    def propose(self, req_ids, token_ids, max_num_tokens):
        out = np.full((len(req_ids), self.k), -1, dtype=np.int64)
        for i, toks in enumerate(token_ids):
            prompt = next(p for p in self.truth if tuple(toks[: len(p)]) == p)
            self.budgets[prompt].append(max_num_tokens[i])
            done = len(toks) - len(prompt)
            cont = self.truth[prompt][done: done + max_num_tokens[i]]
            if prompt == tuple(BAD):
                cont = [(t + 1) % 512 for t in cont]
            out[i, : len(cont)] = cont
        return out


def _run(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> dict[tuple[int, ...], list[int]]:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, disable_log_stats=True)
    return dict(zip((tuple(GOOD), tuple(BAD)), _run(llm, [GOOD, BAD])))


def _dynamic_llm(model_dir: str, plain) -> tuple[LLM, _ScriptedProposer]:
    spec = {"method": "ngram", "num_speculative_tokens": K, "dynamic": True,
            "dynamic_params": {"budget_update_interval": 2, "min_verify_tokens": 1}}
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
                                  dynamic_params={"min_draft_survival": 0.3, "probe_interval": 4})
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
