"""n > 1: child ids and params, FINAL_ONLY / DELTA aggregation, abort by parent id."""

from __future__ import annotations

import asyncio

import pytest

from ascent.core.output_processor import OutputProcessor, RequestOutputCollector
from ascent.core.parallel_sampling import ParentRequest
from ascent.core.sched_output import EngineCoreOutput
from ascent.outputs import RequestOutputKind
from ascent.sampling_params import SamplingParams


def test_child_ids_and_params():
    params = SamplingParams(n=3, seed=7, temperature=0.8, stop=["x"])
    parent = ParentRequest("req", params)
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_req", "1_req", "2_req"]
    assert [p.seed for _, p in infos] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 and p.stop == ["x"] for _, p in infos)
    assert params.n == 3 and params.seed == 7  # the parent's params are untouched
    assert parent.child_requests == {"0_req", "1_req", "2_req"}

    unseeded = ParentRequest("u", SamplingParams(n=2))
    assert [unseeded.get_child_info(i)[1].seed for i in range(2)] == [None, None]
    with pytest.raises(ValueError, match="3"):
        unseeded.get_child_info(3)


def _fan_out(proc: OutputProcessor, kind: int, n: int = 3, queue: RequestOutputCollector | None = None):
    parent = ParentRequest("req", SamplingParams(n=n, seed=1, output_kind=kind))
    for i in range(n):
        child_id, child_params = parent.get_child_info(i)
        proc.add_request(child_id, "p", [1, 2], child_params, parent=parent, index=i, queue=queue)
    return parent


def test_final_only_aggregates_in_index_order(tokenizer):
    proc = OutputProcessor(tokenizer)
    _fan_out(proc, RequestOutputKind.FINAL_ONLY)
    words = {0: "alpha", 1: "beta", 2: "gamma"}
    ids = {i: tokenizer.encode(w, add_special_tokens=False) for i, w in words.items()}
    step1 = [EngineCoreOutput(f"{i}_req", ids[i][:1]) for i in range(3)]
    assert proc.process_outputs(step1).request_outputs == []
    for i in (2, 0):  # children finish out of order
        out = EngineCoreOutput(f"{i}_req", ids[i][1:], finish_reason="length")
        assert proc.process_outputs([out]).request_outputs == []
    eos = tokenizer.eos_token_id
    last = EngineCoreOutput("1_req", ids[1][1:] + [eos], finish_reason="stop", stop_reason=eos)
    result = proc.process_outputs([last])
    (final,) = result.request_outputs
    assert final.request_id == "req" and final.finished and final.prompt == "p"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == ["alpha", "beta", "gamma"]
    assert [c.finish_reason for c in final.outputs] == ["length", "stop", "length"]
    assert final.outputs[1].stop_reason == eos and final.outputs[1].token_ids == ids[1] + [eos]
    assert not proc.has_unfinished_requests() and proc.parent_requests == {}


def test_delta_outputs_come_per_child(tokenizer):
    proc = OutputProcessor(tokenizer)
    _fan_out(proc, RequestOutputKind.DELTA, n=2)
    a, b = tokenizer.encode("ab", add_special_tokens=False)[:1], tokenizer.encode("cd", add_special_tokens=False)
    r1 = proc.process_outputs([EngineCoreOutput("1_req", b[:1]), EngineCoreOutput("0_req", a)])
    assert [(o.request_id, o.outputs[0].index, o.finished) for o in r1.request_outputs] == [
        ("req", 1, False),
        ("req", 0, False),
    ]
    r2 = proc.process_outputs([EngineCoreOutput("0_req", [], finish_reason="abort")])
    assert r2.request_outputs[0].outputs[0].finish_reason == "abort" and not r2.request_outputs[0].finished
    r3 = proc.process_outputs([EngineCoreOutput("1_req", b[1:], finish_reason="length")])
    assert r3.request_outputs[0].finished and r3.request_outputs[0].outputs[0].token_ids == b[1:]


def test_abort_by_parent_id(tokenizer):
    proc = OutputProcessor(tokenizer)
    _fan_out(proc, RequestOutputKind.CUMULATIVE)
    proc.process_outputs([EngineCoreOutput("1_req", [5], finish_reason="length")])
    assert sorted(proc.abort_requests(["req", "unknown"])) == ["0_req", "2_req"]
    assert not proc.has_unfinished_requests() and proc.parent_requests == {}
    late = proc.process_outputs([EngineCoreOutput("0_req", [6]), EngineCoreOutput("2_req", [7], finish_reason="stop")])
    assert late.request_outputs == [] and late.reqs_to_abort == []
    assert proc.abort_requests(["req"]) == []


def test_abort_delivers_final_output_to_queue(tokenizer):
    proc = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
    _fan_out(proc, RequestOutputKind.FINAL_ONLY, n=2, queue=queue)
    proc.process_outputs([EngineCoreOutput("0_req", tokenizer.encode("hi", add_special_tokens=False))])
    assert queue.get_nowait() is None
    assert sorted(proc.abort_requests(["req"])) == ["0_req", "1_req"]
    final = asyncio.run(queue.get())
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert final.outputs[0].text == "hi"


def test_n_greater_than_one_needs_parent(tokenizer):
    proc = OutputProcessor(tokenizer)
    with pytest.raises(ValueError, match="n=2"):
        proc.add_request("r", None, [1], SamplingParams(n=2))
    parent = ParentRequest("r", SamplingParams(n=2))
    with pytest.raises(ValueError, match="5_r"):
        proc.add_request("5_r", None, [1], SamplingParams(), parent=parent, index=0)
    proc.add_request("x", None, [1], SamplingParams())
    with pytest.raises(ValueError, match="'x'"):
        proc.add_request("x", None, [1], SamplingParams())
