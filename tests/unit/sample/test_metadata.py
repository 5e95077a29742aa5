"""SamplingMetadata.from_requests: optional fields, masks, padding and validation."""

from __future__ import annotations

import pytest
import torch

from ascent.sample.metadata import SamplingMetadata, is_plain_greedy
from ascent.sample.sampler import Sampler, has_logits_processors
from ascent.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _build(params, prompts=None, outputs=None, generators=None, vocab=10) -> SamplingMetadata:
    prompts = prompts if prompts is not None else [[1]] * len(params)
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, prompts, outputs, generators or {}, vocab, CPU)


def test_plain_batch_builds_no_optional_tensors() -> None:
    md = _build([SamplingParams(), SamplingParams(temperature=0.5)])
    assert md.all_random and not md.all_greedy
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None and md.presence_penalties is None
    assert md.allowed_token_ids_mask is None and md.min_tokens == {} and md.max_num_logprobs is None
    assert md.temperature.dtype == torch.float32 and md.temperature.tolist() == [1.0, 0.5]


def test_mixed_batch_fields() -> None:
    params = [
        SamplingParams(temperature=0.0, seed=5, logprobs=3),
        SamplingParams(top_k=4, top_p=0.9, min_p=0.1, seed=6, logprobs=1),
        SamplingParams(repetition_penalty=1.2, allowed_token_ids=[2, 3]),
    ]
    gens = {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}
    md = _build(params, prompts=[[1, 2, 3], [], [4]], generators=gens)
    assert not md.all_random and not md.all_greedy
    assert md.temperature.tolist() == [0.0, 1.0, 1.0]
    assert md.top_k is not None and md.top_k.dtype == torch.int64 and md.top_k.tolist() == [0, 4, 0]
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert set(md.generators) == {1}
    assert md.max_num_logprobs == 3
    assert not md.no_penalties and md.repetition_penalties is not None
    assert md.prompt_token_ids is not None and md.prompt_token_ids.tolist() == [[1, 2, 3], [10, 10, 10], [4, 10, 10]]
    mask = md.allowed_token_ids_mask
    assert mask is not None and mask.shape == (3, 10)
    assert not mask[:2].any() and set(torch.nonzero(~mask[2]).flatten().tolist()) == {2, 3}


def test_full_vocab_logprobs_wins_and_all_greedy() -> None:
    md = _build([SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.0, logprobs=-1)])
    assert md.max_num_logprobs == -1 and md.all_greedy and not md.all_random


def test_min_tokens_rows_and_stop_sets() -> None:
    a = SamplingParams(min_tokens=3, stop_token_ids=[4])
    a.update_from_generation_config({9})
    b = SamplingParams(min_tokens=1, stop_token_ids=[4])
    c = SamplingParams(min_tokens=2, ignore_eos=True)
    c.update_from_generation_config({9})
    md = _build([a, b, c], outputs=[[1, 1], [1], []])
    # ignore_eos keeps generating past EOS, but min_tokens still holds EOS back (vLLM's all_stop_token_ids)
    assert md.min_tokens == {0: {4, 9}, 2: {9}}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[[1], [2]]), "prompt_token_ids"),
        (dict(outputs=[]), "output_token_ids"),
        (dict(generators={3: torch.Generator()}), r"\[3\]"),
    ],
)
def test_shape_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _build([SamplingParams()], **kwargs)


def test_out_of_vocab_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias.*12"):
        _build([SamplingParams(logit_bias={12: 1.0})])
    with pytest.raises(ValueError, match="allowed_token_ids.*11"):
        _build([SamplingParams(allowed_token_ids=[1, 11])])


@pytest.mark.parametrize("kwargs,plain", [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "seed": 3, "top_k": 5, "top_p": 0.5, "min_p": 0.2}, True),  # truncation: argmax unchanged
    ({"temperature": 0.7}, False),
    ({"temperature": 0.0, "logprobs": 0}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
    ({"temperature": 0.0, "frequency_penalty": -0.5}, False),
    ({"temperature": 0.0, "repetition_penalty": 1.1}, False),
    ({"temperature": 0.0, "logit_bias": {3: 5.0}}, False),
    ({"temperature": 0.0, "allowed_token_ids": [1, 2]}, False),
    ({"temperature": 0.0, "min_tokens": 2, "stop_token_ids": [3]}, False),
])
def test_plain_greedy_rows_are_exactly_the_sampler_argmax(kwargs, plain) -> None:
    """``is_plain_greedy`` (the model runner's shortcut past the metadata) holds exactly when the sampler would
    return the argmax of the raw logits and nothing else: greedy, no logits processor, no logprobs."""
    params = SamplingParams(**kwargs)
    assert is_plain_greedy(params) is plain
    md = _build([params], outputs=[[4]], generators={0: torch.Generator().manual_seed(1)}, vocab=10)
    assert (md.all_greedy and not has_logits_processors(md) and md.max_num_logprobs is None) is plain
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, md)
    if plain:
        assert out.sampled_token_ids.item() == int(logits.argmax()) and out.logprobs_tensors is None
