"""Logprobs: raw log-softmax values, counted 1-based ranks, exact top-k id sets, full-vocabulary mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.core.sched_output import LogprobsEntry
from ascent.sample.logprobs import compute_logprobs_tensors
from ascent.sample.metadata import SamplingMetadata
from ascent.sample.sampler import Sampler
from ascent.sampling_params import SamplingParams

torch.set_num_threads(1)
ROWS, VOCAB = 6, 24


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(ROWS, VOCAB)).astype(np.float32)


@pytest.mark.parametrize("k", [0, 1, 5, VOCAB])
def test_values_ranks_and_top_k(k: int) -> None:
    logits = _logits(1)
    targets = np.random.default_rng(2).integers(0, VOCAB, size=ROWS)
    out = compute_logprobs_tensors(torch.tensor(logits), torch.tensor(targets), k)
    ref = _np_log_softmax(logits)
    assert out.token_ids.shape == (ROWS, 1 + k) and out.logprobs.shape == (ROWS, 1 + k)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    np.testing.assert_array_equal(out.token_ids[:, 0].numpy(), targets)
    ids = out.token_ids.numpy()
    np.testing.assert_allclose(out.logprobs.numpy(), np.take_along_axis(ref, ids, axis=1), atol=1e-5)
    for row in range(ROWS):
        assert out.ranks[row].item() == int((ref[row] >= ref[row, targets[row]]).sum())
        assert set(ids[row, 1:].tolist()) == set(np.argsort(-ref[row])[:k].tolist())
        assert np.all(np.diff(out.logprobs[row, 1:].numpy()) <= 0)


def test_full_vocabulary_and_entries() -> None:
    logits = _logits(3)
    out = compute_logprobs_tensors(torch.tensor(logits), torch.zeros(ROWS, 1, dtype=torch.int64), -1)
    assert out.token_ids.shape == (ROWS, VOCAB + 1)
    for row in range(ROWS):
        assert sorted(out.token_ids[row, 1:].tolist()) == list(range(VOCAB))
    entries = out.to_entries()
    assert len(entries) == ROWS and all(isinstance(e, LogprobsEntry) for e in entries)
    assert entries[2].token_ids == out.token_ids[2].tolist() and entries[2].rank == int(out.ranks[2])
    assert entries[2].logprobs == out.logprobs[2].tolist()


def test_negative_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="-2"):
        compute_logprobs_tensors(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), -2)


def test_sampler_logprobs_use_raw_logits_and_sampled_token() -> None:
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5, logit_bias={0: 5.0}),
        SamplingParams(temperature=0.5, top_k=3, logprobs=4, frequency_penalty=1.0),
        SamplingParams(temperature=1.0),
    ] + [SamplingParams(temperature=0.0) for _ in range(ROWS - 3)]
    outputs = [[1, 2], [3, 3], [], [], [], []]
    md = SamplingMetadata.from_requests(params, [[5, 6]] * ROWS, outputs, {}, VOCAB, torch.device("cpu"))
    raw = torch.tensor(logits)
    out = Sampler("host")(raw, md)
    assert torch.equal(raw, torch.tensor(logits))
    lp = out.logprobs_tensors
    assert lp is not None and lp.token_ids.shape == (ROWS, 5)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids[:, 0])
    ref = _np_log_softmax(logits)
    np.testing.assert_allclose(lp.logprobs.numpy(), np.take_along_axis(ref, lp.token_ids.numpy(), axis=1), atol=1e-5)


def test_prompt_logprobs_score_the_next_prompt_token() -> None:
    logits = _logits(5)
    prompt = [3, 9, 1, 0, 22, 7, 11]
    out = compute_logprobs_tensors(torch.tensor(logits), torch.tensor(prompt[1:]), 1)
    ref = _np_log_softmax(logits)
    np.testing.assert_allclose(out.logprobs[:, 0].numpy(), ref[np.arange(ROWS), prompt[1:]], atol=1e-5)
    np.testing.assert_array_equal(out.token_ids[:, 1].numpy(), ref.argmax(axis=1))
