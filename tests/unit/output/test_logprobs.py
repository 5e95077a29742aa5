"""Logprobs conversion, cumulative logprob and prompt logprobs in the output processor."""

from __future__ import annotations

import math

from ascent.core.output_processor import OutputProcessor
from ascent.core.sched_output import EngineCoreOutput, LogprobsEntry
from ascent.outputs import Logprob, RequestOutputKind
from ascent.sampling_params import SamplingParams

# (sampled, logprob, rank) followed by top-2 (id, logprob); the second position samples the top-1 token.
STEPS = [
    (LogprobsEntry([40, 41, 42], [-2.5, -0.1, -1.9], rank=3)),
    (LogprobsEntry([41, 41, 50], [-0.2, -0.2, -1.7], rank=1)),
    (LogprobsEntry([300, 2, 60], [-4.0, -0.5, -0.9], rank=7)),
]


def expected_dict(tokenizer, entry: LogprobsEntry, decoded: bool = True) -> dict[int, Logprob]:
    """Reference built by hand: sampled token with its rank, then the top-k tokens with ranks 1..k."""
    out = {entry.token_ids[0]: (entry.logprobs[0], entry.rank)}
    for k, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
        out.setdefault(tid, (lp, k))
    return {
        tid: Logprob(lp, rank, tokenizer.decode([tid]) if decoded else None) for tid, (lp, rank) in out.items()
    }


def run_steps(proc: OutputProcessor, request_id: str = "r") -> list:
    outputs = []
    for i, entry in enumerate(STEPS):
        reason = "length" if i == len(STEPS) - 1 else None
        out = EngineCoreOutput(request_id, [entry.token_ids[0]], finish_reason=reason, new_logprobs=[entry])
        outputs.extend(proc.process_outputs([out]).request_outputs)
    return outputs


def test_sample_logprobs_and_cumulative(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(logprobs=2))
    outputs = run_steps(proc)
    final = outputs[-1].outputs[0]
    assert final.logprobs == [expected_dict(tokenizer, e) for e in STEPS]
    assert list(final.logprobs[1]) == [41, 50]  # sampled first, duplicate top-1 folded in
    assert list(final.logprobs[2]) == [300, 2, 60]
    assert final.logprobs[2][2].decoded_token == tokenizer.decode([2], skip_special_tokens=False)
    assert math.isclose(final.cumulative_logprob, math.fsum(e.logprobs[0] for e in STEPS))
    assert [len(o.outputs[0].logprobs) for o in outputs] == [1, 2, 3]
    assert final.token_ids == [e.token_ids[0] for e in STEPS]


def test_delta_logprobs_are_per_step(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(logprobs=2, output_kind=RequestOutputKind.DELTA))
    outputs = run_steps(proc)
    assert [o.outputs[0].logprobs for o in outputs] == [[expected_dict(tokenizer, e)] for e in STEPS]
    assert [o.outputs[0].token_ids for o in outputs] == [[e.token_ids[0]] for e in STEPS]
    assert math.isclose(outputs[0].outputs[0].cumulative_logprob, -2.5)


def test_logprobs_not_requested_and_not_detokenized(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("plain", None, [1], SamplingParams())
    completion = run_steps(proc, "plain")[-1].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None

    proc.add_request("raw", None, [1], SamplingParams(logprobs=2, detokenize=False))
    completion = run_steps(proc, "raw")[-1].outputs[0]
    assert completion.text == ""
    assert completion.logprobs == [expected_dict(tokenizer, e, decoded=False) for e in STEPS]


def prompt_entries(prompt: list[int]) -> list[LogprobsEntry]:
    return [LogprobsEntry([tok, 7], [-1.0 - i, -0.3], rank=2 + i) for i, tok in enumerate(prompt[1:])]


def test_prompt_logprobs_first_entry_none(tokenizer):
    prompt = [1, 100, 101, 102, 103]
    entries = prompt_entries(prompt)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", None, prompt, SamplingParams(prompt_logprobs=1, output_kind=kind))
        # a chunked prefill: the first chunk carries prompt logprobs but no sampled token
        first = proc.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=entries[:2])])
        assert first.request_outputs == []
        outs = proc.process_outputs([EngineCoreOutput("r", [5], new_prompt_logprobs=entries[2:])]).request_outputs
        outs += proc.process_outputs([EngineCoreOutput("r", [6], finish_reason="length")]).request_outputs
        expected = [None] + [expected_dict(tokenizer, e) for e in entries]
        assert outs[0].prompt_logprobs == expected and len(expected) == len(prompt)
        assert outs[1].prompt_logprobs == ([] if kind == RequestOutputKind.DELTA else expected)


def test_prompt_logprobs_absent_when_not_requested(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2], SamplingParams())
    out = proc.process_outputs([EngineCoreOutput("r", [5], "length", new_prompt_logprobs=prompt_entries([1, 2]))])
    assert out.request_outputs[0].prompt_logprobs is None
