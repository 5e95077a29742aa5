"""Sampler behaviour: greedy = argmax, seeded rows independent of the batch, RNG placement helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rng import RNG_PLACEMENTS, check_placement, make_generator, sample_inverse_cdf
from ascent.sample.sampler import Sampler
from ascent.sampling_params import SamplingParams
from tests.unit.sample.reference import processed_logits

torch.set_num_threads(1)
CPU = torch.device("cpu")
VOCAB = 32
STEPS = 12


def _metadata(params, generators, vocab=VOCAB, prompts=None, outputs=None) -> SamplingMetadata:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, prompts, outputs, generators, vocab, CPU)


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    gen = np.random.default_rng(11)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=0.0, logit_bias={5: 3.0}, allowed_token_ids=[5, 6, 7, 8]),
    ]
    prompts = [gen.integers(0, VOCAB, 6).tolist() for _ in params]
    outputs = [gen.integers(0, VOCAB, 4).tolist() for _ in params]
    logits = gen.normal(0.0, 1.5, size=(len(params), VOCAB)).astype(np.float32)
    md = _metadata(params, {}, prompts=prompts, outputs=outputs)
    for placement in RNG_PLACEMENTS:
        out = Sampler(placement)(torch.tensor(logits), md).sampled_token_ids
        assert out.shape == (len(params), 1) and out.dtype == torch.int64
        for row in (0, 1, 3):
            ref = processed_logits(logits[row], prompts[row], outputs[row], params[row])
            assert out[row, 0].item() == int(np.argmax(ref))


@pytest.mark.parametrize("extra", [{}, {"logit_bias": {3: 5.0}}, {"min_tokens": 2, "stop_token_ids": [3]},
                                   {"presence_penalty": 1.0}, {"allowed_token_ids": [1, 2]}])
def test_all_greedy_batches_leave_the_logits_unmodified(extra) -> None:
    """All-greedy rows without logits processors read the logits in place (no fp32 copy); with any processor the
    copy is processed; either way the caller's logits are not modified and the token is the processed argmax."""
    gen = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.0, logprobs=1, **extra), SamplingParams(temperature=0.0)]
    prompts = [[3, 4], [5]]
    logits = torch.tensor(gen.normal(0.0, 1.0, size=(2, VOCAB)).astype(np.float32))
    logits[:, 3] = 4.0  # the raw argmax, unless a processor removes it
    before = logits.clone()
    out = Sampler()(logits, _metadata(params, {}, prompts=prompts))
    assert torch.equal(logits, before)
    for row in range(2):
        ref = processed_logits(before[row].numpy(), prompts[row], [], params[row])
        assert out.sampled_token_ids[row, 0].item() == int(np.argmax(ref))
    raw = torch.log_softmax(before, dim=-1)  # logprobs are the raw distribution's
    assert torch.allclose(out.logprobs_tensors.logprobs[:, 0], raw.gather(1, out.sampled_token_ids).squeeze(1),
                          atol=1e-5)


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
def test_random_rows_without_processors_leave_the_logits_unmodified(placement: str) -> None:
    """Random rows without logits processors read the caller's logits (the temperature's division writes a new
    tensor, on which min-p / top-k / top-p then work in place): the logits stay as they were and the tokens equal
    those drawn from a copy with the same seeds."""
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=5, min_p=0.05), SamplingParams(temperature=0.5, top_p=0.8)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    before = logits.clone()

    def draw(x: torch.Tensor) -> list[int]:
        gens = {row: make_generator(10 + row, placement, CPU) for row in (0, 2, 3)}
        return Sampler(placement)(x, _metadata(params, gens)).sampled_token_ids.view(-1).tolist()

    tokens = draw(logits)
    assert torch.equal(logits, before)
    assert tokens == draw(before.clone())
    assert tokens[1] == int(before[1].argmax())


def _seeded_run(placement: str, seed: int, layout: list[str], step_logits: torch.Tensor) -> list[int]:
    """Run STEPS steps of a batch; ``layout`` names each row ("me", "greedy", "free", "other_seed")."""
    me = layout.index("me")
    params, gens = [], {}
    for row, kind in enumerate(layout):
        params.append(SamplingParams(temperature=0.0 if kind == "greedy" else 0.9, top_p=0.95))
        if kind in ("me", "other_seed"):
            gens[row] = make_generator(seed if kind == "me" else 99, placement, CPU)
    md = _metadata(params, gens)
    sampler = Sampler(placement, generator=torch.Generator().manual_seed(len(layout)))
    noise = torch.Generator().manual_seed(1000 + len(layout))
    tokens = []
    for step in range(STEPS):
        logits = torch.randn(len(layout), VOCAB, generator=noise)
        logits[me] = step_logits[step]
        tokens.append(int(sampler(logits, md).sampled_token_ids[me, 0]))
    return tokens


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
def test_seeded_row_is_batch_composition_independent(placement: str) -> None:
    step_logits = torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(5)) * 0.5
    alone = _seeded_run(placement, 1234, ["me"], step_logits)
    layouts = [["free", "other_seed", "me"], ["greedy", "me", "free", "free"], ["other_seed", "free", "me", "greedy"]]
    for layout in layouts:
        assert _seeded_run(placement, 1234, layout, step_logits) == alone, layout
    assert _seeded_run(placement, 4321, ["me"], step_logits) != alone


def test_inverse_cdf_boundaries() -> None:
    tiny = torch.finfo(torch.float32).tiny
    weights = torch.tensor([[0.0, 2.0, 3.0, 5.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0], [1.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([0.2, 0.999, tiny, 1.0], dtype=torch.float64)
    assert sample_inverse_cdf(weights, u).tolist() == [2, 0, 3, 1]


def test_placement_validation_and_generator_device() -> None:
    with pytest.raises(ValueError, match="gpu_rng"):
        check_placement("gpu_rng")
    with pytest.raises(ValueError, match="gpu_rng"):
        Sampler("gpu_rng")
    for placement in RNG_PLACEMENTS:
        gen = make_generator(7, placement, CPU)
        assert gen.device.type == "cpu" and gen.initial_seed() == 7


def test_row_count_mismatch_is_rejected() -> None:
    md = _metadata([SamplingParams()], {})
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(torch.zeros(2, VOCAB), md)


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
def test_engine_generator_drives_unseeded_rows(placement: str) -> None:
    params = [SamplingParams(temperature=1.0) for _ in range(64)]
    md = _metadata(params, {})
    logits = torch.zeros(64, VOCAB)
    runs = [Sampler(placement, torch.Generator().manual_seed(s))(logits, md).sampled_token_ids for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_empty_batch_and_half_precision_input() -> None:
    empty = Sampler()(torch.zeros(0, VOCAB), _metadata([], {}))
    assert empty.sampled_token_ids.shape == (0, 1)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    md = _metadata([SamplingParams(temperature=0.0, logprobs=1)] * 3, {})
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids[:, 0], logits.float().argmax(dim=-1))
    assert out.logprobs_tensors is not None and out.logprobs_tensors.logprobs.dtype == torch.float32


def test_non_contiguous_logits_with_penalties() -> None:
    base = torch.randn(VOCAB, 2, generator=torch.Generator().manual_seed(8))
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=1.0)] * 2
    outputs = [[int(base[:, 0].argmax())], [int(base[:, 1].argmax())]]
    md = _metadata(params, {}, prompts=[[], []], outputs=outputs)
    tokens = Sampler()(base.t(), md).sampled_token_ids[:, 0].tolist()
    for row in range(2):
        ref = processed_logits(base[:, row].numpy(), [], outputs[row], params[row])
        assert tokens[row] == int(np.argmax(ref))
