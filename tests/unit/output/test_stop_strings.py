"""Stop strings in the output processor: truncation, finish/stop reasons, aborts and DELTA hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.core.output_processor import OutputProcessor
from ascent.outputs import RequestOutputKind
from ascent.sampling_params import SamplingParams
from tests.unit.output.helpers import drive

TEXTS = [
    "Hello world! This is a tiny tokenizer for tests of an inference engine.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "héllo 日本 😀 wörld, then more text with café and 中文.",
]


def tokens_until(tokenizer, ids: list[int], stop: str) -> int:
    """Reference: the number of tokens after which the decoded text first contains ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


def test_stop_string_across_token_boundaries(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "d! Th"
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it must span several tokens
    k = tokens_until(tokenizer, ids, stop)
    for include in (False, True):
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", text, [1, 2], SamplingParams(stop=[stop], include_stop_str_in_output=include))
        outputs, results = drive(proc, "r", ids)
        final = outputs[-1]
        completion = final.outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert final.finished and completion.text == text[:cut]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        assert completion.token_ids == ids[:k]
        assert results[-1].reqs_to_abort == ["r"]
        assert all(not r.reqs_to_abort for r in results[:-1])
        assert not proc.has_unfinished_requests() and proc.get_num_unfinished_requests() == 0


def test_tokens_after_the_stop_in_a_multi_token_step_are_dropped(tokenizer):
    """A speculative step returns several tokens at once: those after the token that completes the stop string are
    not part of the output (token ids, logprobs, cumulative logprob)."""
    from ascent.core.sched_output import EngineCoreOutput, LogprobsEntry

    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "d! Th"
    k = tokens_until(tokenizer, ids, stop)
    for include in (False, True):
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", text, [1, 2], SamplingParams(stop=[stop], include_stop_str_in_output=include,
                                                           logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY))
        step = ids[: k + 4]  # one step carries the stop and 4 tokens past it
        entries = [LogprobsEntry([t], [-0.5 - j], 1) for j, t in enumerate(step)]
        result = proc.process_outputs([EngineCoreOutput("r", step, new_logprobs=entries)])
        completion = result.request_outputs[0].outputs[0]
        assert completion.token_ids == ids[:k] and len(completion.logprobs) == k
        assert completion.cumulative_logprob == pytest.approx(sum(-0.5 - j for j in range(k)))
        assert completion.finish_reason == "stop"


def test_no_abort_when_core_finished_in_same_step(tokenizer):
    text = "Hello world!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["!"]))
    outputs, results = drive(proc, "r", ids, final_reason="length")
    assert outputs[-1].outputs[0].text == "Hello world"
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[0].stop_reason == "!"
    assert all(not r.reqs_to_abort for r in results)


def test_no_match_keeps_full_text_and_core_reason(tokenizer):
    text = TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["zzz", "qq"]))
    outputs, _ = drive(proc, "r", ids)
    completion = outputs[-1].outputs[0]
    assert completion.text == tokenizer.decode(ids) == text
    assert completion.finish_reason == "length" and completion.stop_reason is None


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["blocks", "keys", "values"]))
    outputs, _ = drive(proc, "r", ids, sizes=[len(ids)])  # one step: all three present in the new text
    assert outputs[-1].outputs[0].text == text[: text.index("keys")]
    assert outputs[-1].outputs[0].stop_reason == "keys"


def test_min_tokens_suppresses_early_stop(tokenizer):
    first = tokenizer.encode("world", add_special_tokens=False)
    ids = first + tokenizer.encode(" world again", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["world"], min_tokens=len(first), max_tokens=50))
    outputs, _ = drive(proc, "r", ids)
    assert outputs[-1].outputs[0].text == "world "
    assert outputs[-1].outputs[0].stop_reason == "world"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_delta_stream_never_leaks_and_matches_cumulative(tokenizer, data):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 6))]
    include = data.draw(st.booleans())
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    expected = text[: text.index(stop) + (len(stop) if include else 0)]

    finals = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        proc = OutputProcessor(tokenizer)
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include, output_kind=kind)
        proc.add_request("r", None, [1], params)
        outputs, _ = drive(proc, "r", ids, sizes)
        texts = [o.outputs[0].text for o in outputs]
        if kind == RequestOutputKind.DELTA:
            for i in range(len(texts)):
                assert expected.startswith("".join(texts[: i + 1]))
            finals[kind] = "".join(texts)
        else:
            assert all(expected.startswith(t) for t in texts)
            finals[kind] = texts[-1]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
        assert outputs[-1].outputs[0].stop_reason == stop
    assert finals[RequestOutputKind.DELTA] == finals[RequestOutputKind.CUMULATIVE] == expected


def test_delta_holds_back_possible_stop_prefix(tokenizer):
    text = "Hello world! This is"
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["worlds!"], output_kind=RequestOutputKind.DELTA))
    outputs, _ = drive(proc, "r", ids)
    emitted = ""
    for out, k in zip(outputs[:-1], range(1, len(ids))):
        emitted += out.outputs[0].text
        assert len(emitted) == max(len(tokenizer.decode(ids[:k])) - len("worlds!") + 1, 0)
    emitted += outputs[-1].outputs[0].text
    assert emitted == text and outputs[-1].outputs[0].finish_reason == "length"


def test_stop_string_completing_first_wins_ties_by_list_order(tokenizer):
    """vLLM's check_stop_strings: the stop string that ends first in the new text; equal ends go to list order."""
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stops, winner in ((["is a", "This"], "This"), (["his", "This"], "his"), (["This", "his"], "This")):
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", None, [1], SamplingParams(stop=stops))
        outputs, _ = drive(proc, "r", ids, sizes=[len(ids)])
        assert outputs[-1].outputs[0].stop_reason == winner
        assert outputs[-1].outputs[0].text == text[: text.index(winner)]


def test_stop_strings_require_detokenize(tokenizer):
    with pytest.raises(ValueError, match="detokenize"):  # at construction, as vLLM's SamplingParams
        SamplingParams(stop=["a"], detokenize=False)
    params = SamplingParams(detokenize=False)
    params.stop = ["a"]  # set after validation: the output processor still refuses it, leaving nothing behind
    proc = OutputProcessor(tokenizer)
    with pytest.raises(ValueError, match="stop"):
        proc.add_request("r", None, [1], params)
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_core_stop_token_text_follows_include_flag(tokenizer, include):
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    stop_token = ids[-1]
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop_token_ids=[stop_token], include_stop_str_in_output=include)
    proc.add_request("r", None, [1], params)
    outputs, results = drive(proc, "r", ids, final_reason="stop", final_stop_reason=stop_token)
    completion = outputs[-1].outputs[0]
    assert completion.stop_reason == stop_token
    assert completion.text == tokenizer.decode(ids if include else ids[:-1])
    assert completion.token_ids == ids and completion.finish_reason == "stop"
    assert all(not r.reqs_to_abort for r in results)
