"""RequestOutputCollector merging, streaming through queues, metrics timestamps and iteration stats."""

from __future__ import annotations

import asyncio
import time

import pytest

from ascent.core.output_processor import OutputProcessor, RequestOutputCollector
from ascent.core.sched_output import EngineCoreOutput
from ascent.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from ascent.sampling_params import SamplingParams


def _out(text: str, ids: list[int], finished: bool = False, index: int = 0) -> RequestOutput:
    completion = CompletionOutput(index, text, ids, None, None, "length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


def test_delta_outputs_merge_when_consumer_is_slow():
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    queue.put(_out("He", [1]))
    queue.put(_out("llo", [2, 3]))
    queue.put(_out("!", [4], finished=True))
    merged = queue.get_nowait()
    assert merged.outputs[0].text == "Hello!" and merged.outputs[0].token_ids == [1, 2, 3, 4]
    assert merged.finished and merged.outputs[0].finish_reason == "length"
    assert queue.get_nowait() is None


def test_cumulative_outputs_replace_per_index():
    queue = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    queue.put(_out("a", [1], index=0))
    queue.put(_out("b", [2], index=1))
    queue.put(_out("ab", [1, 3], index=0))
    merged = queue.get_nowait()
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [(0, "ab", [1, 3]), (1, "b", [2])]


def test_async_get_waits_and_exceptions_propagate():
    async def scenario() -> tuple[str, str]:
        queue = RequestOutputCollector(RequestOutputKind.DELTA)

        async def producer() -> None:
            await asyncio.sleep(0.01)
            queue.put(_out("x", [9]))

        task = asyncio.create_task(producer())
        got = await asyncio.wait_for(queue.get(), timeout=5)
        await task
        queue.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await queue.get()
        return got.outputs[0].text, "ok"

    assert asyncio.run(scenario()) == ("x", "ok")


def test_streaming_through_queue_equals_final_text(tokenizer):
    text = "Hello world! This is a tiny tokenizer."
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    proc.add_request("r", text, [1], SamplingParams(output_kind=RequestOutputKind.DELTA), queue=queue)
    pieces = []
    for i, tid in enumerate(ids):
        reason = "length" if i == len(ids) - 1 else None
        result = proc.process_outputs([EngineCoreOutput("r", [tid], finish_reason=reason)])
        assert result.request_outputs == []  # delivered to the queue instead
        if i % 3 == 0:  # a slow consumer drains only sometimes
            pieces.append(queue.get_nowait())
    pieces.append(queue.get_nowait())
    assert "".join(p.outputs[0].text for p in pieces if p) == text
    assert pieces[-1].finished


def test_metrics_timestamps_and_cached_tokens(tokenizer):
    proc = OutputProcessor(tokenizer)
    arrival = time.time() - 1.0
    proc.add_request("r", None, [1, 2, 3], SamplingParams(), arrival_time=arrival)
    first = proc.process_outputs([EngineCoreOutput("r", [10], num_cached_tokens=2)]).request_outputs[0]
    last = proc.process_outputs([EngineCoreOutput("r", [11, 12], finish_reason="length", num_cached_tokens=2)])
    final = last.request_outputs[0]
    assert first.metrics.arrival_time == arrival and first.metrics.finished_time is None
    m = final.metrics
    assert arrival < m.first_token_time <= m.last_token_time <= m.finished_time <= time.time()
    assert m.first_token_time == first.metrics.first_token_time
    assert final.num_cached_tokens == 2 and final.outputs[0].token_ids == [10, 11, 12]


def test_iteration_stats_with_log_stats(tokenizer):
    proc = OutputProcessor(tokenizer, log_stats=True)
    proc.add_request("a", None, [1, 2, 3], SamplingParams(), arrival_time=time.time() - 0.5)
    proc.add_request("b", None, [1, 2], SamplingParams())
    s1 = proc.process_outputs([EngineCoreOutput("a", [10]), EngineCoreOutput("b", [10, 11])]).iteration_stats
    assert (s1.num_prompt_tokens, s1.num_generation_tokens) == (5, 3)
    assert len(s1.time_to_first_tokens) == 2 and max(s1.time_to_first_tokens) >= 0.5
    s2 = proc.process_outputs([EngineCoreOutput("a", [12, 13], finish_reason="length")]).iteration_stats
    assert (s2.num_prompt_tokens, s2.num_generation_tokens) == (0, 2) and len(s2.inter_token_latencies) == 1
    (done,) = s2.finished_requests
    assert done.finish_reason == "length" and done.num_generation_tokens == 3 and done.num_prompt_tokens == 3
    assert done.e2e_latency >= 0.5
    assert OutputProcessor(tokenizer).process_outputs([]).iteration_stats is None
