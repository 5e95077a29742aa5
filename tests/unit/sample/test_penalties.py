"""Penalties, logit bias, min_tokens and allowed_token_ids against direct numpy implementations of the formulas."""

from __future__ import annotations

import numpy as np
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.penalties import apply_logit_bias, apply_penalties, pad_token_lists
from ascent.sample.sampler import apply_logits_processors
from ascent.sampling_params import SamplingParams
from tests.unit.sample.reference import processed_logits

torch.set_num_threads(1)
VOCAB = 20


def _np_penalties(x: np.ndarray, prompt: list[int], output: list[int], a: float, f: float, r: float) -> np.ndarray:
    x = x.astype(np.float64).copy()
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=VOCAB)[:VOCAB]
    seen = counts > 0
    seen[np.array(prompt, dtype=np.int64)] = True
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - f * counts - a * (counts > 0)


def _random_histories(gen: np.random.Generator, rows: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [gen.integers(0, VOCAB, size=gen.integers(0, 12)).tolist() for _ in range(rows)]
    outputs = [gen.integers(0, VOCAB, size=gen.integers(0, 15)).tolist() for _ in range(rows)]
    return prompts, outputs


def test_apply_penalties_matches_numpy_formulas() -> None:
    gen = np.random.default_rng(0)
    rows = 8
    logits = gen.normal(0.0, 3.0, size=(rows, VOCAB))
    prompts, outputs = _random_histories(gen, rows)
    outputs[0] = []
    pres, freq = gen.uniform(-2, 2, rows), gen.uniform(-2, 2, rows)
    rep = gen.uniform(0.5, 2.0, rows)
    rep[1] = 1.0
    out = apply_penalties(
        torch.tensor(logits, dtype=torch.float32),
        pad_token_lists(prompts, VOCAB, torch.device("cpu")),
        outputs,
        torch.tensor(pres, dtype=torch.float32),
        torch.tensor(freq, dtype=torch.float32),
        torch.tensor(rep, dtype=torch.float32),
    )
    for row in range(rows):
        ref = _np_penalties(logits[row], prompts[row], outputs[row], pres[row], freq[row], rep[row])
        np.testing.assert_allclose(out[row].numpy(), ref, rtol=1e-5, atol=1e-5)


def test_placeholder_output_ids_are_ignored() -> None:
    logits = np.linspace(-2.0, 2.0, VOCAB)
    out = apply_penalties(
        torch.tensor(np.stack([logits, logits]), dtype=torch.float32),
        None,
        [[3, -1, 15, 3], [-1]],
        torch.full((2,), 0.5),
        torch.full((2,), 0.25),
        torch.full((2,), 2.0),
    )
    ref = _np_penalties(logits, [], [3, 15, 3], 0.5, 0.25, 2.0)
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[1].numpy(), logits.astype(np.float32))


def test_logit_bias_adds_to_listed_tokens() -> None:
    logits = torch.zeros(3, VOCAB)
    apply_logit_bias(logits, [{1: 2.5, 7: -1.0}, None, {19: 100.0}])
    expected = np.zeros((3, VOCAB), dtype=np.float32)
    expected[0, 1], expected[0, 7], expected[2, 19] = 2.5, -1.0, 100.0
    np.testing.assert_array_equal(logits.numpy(), expected)


def test_all_processors_match_reference_for_a_mixed_batch() -> None:
    gen = np.random.default_rng(3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, logit_bias={2: 1.5, 5: -3.0}),
        SamplingParams(allowed_token_ids=[1, 3, 5, 7], min_tokens=4, stop_token_ids=[3]),
        SamplingParams(min_tokens=2, repetition_penalty=0.8),
        SamplingParams(),
    ]
    for p in params:
        p.update_from_generation_config({0, 19})
    prompts, outputs = _random_histories(gen, len(params))
    outputs[2], outputs[3] = [4], [6, 6, 6]
    logits = gen.normal(0.0, 2.0, size=(len(params), VOCAB))
    md = SamplingMetadata.from_requests(params, prompts, outputs, {}, VOCAB, torch.device("cpu"))
    out = apply_logits_processors(torch.tensor(logits, dtype=torch.float32), md)
    for row, p in enumerate(params):
        ref = processed_logits(logits[row], prompts[row], outputs[row], p)
        np.testing.assert_array_equal(np.isinf(out[row].numpy()), np.isinf(ref))
        finite = np.isfinite(ref)
        np.testing.assert_allclose(out[row].numpy()[finite], ref[finite], rtol=1e-5, atol=1e-5)
    assert np.isinf(out[2].numpy()[[0, 2, 3, 19]]).all()
