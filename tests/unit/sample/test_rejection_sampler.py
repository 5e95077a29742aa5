"""Rejection sampler behaviour: layout, greedy exactness, per-position logits processing, contracts, seeding.

References are independent: greedy chains are recomputed per request with numpy argmax over
``tests/unit/sample/reference.py`` (float64 processing written from the formulas) with each position's history =
output tokens + the drafts before it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from ascent.sample.rng import RNG_PLACEMENTS, make_generator
from ascent.sample.sampler import Sampler
from ascent.sample.spec_metadata import expand_sampling_metadata
from ascent.sampling_params import SamplingParams
from tests.unit.sample.reference import processed_logits

torch.set_num_threads(1)
CPU = torch.device("cpu")
VOCAB = 16
METHODS = ("standard", "block")


def _md(params: list[SamplingParams], prompts=None, outputs=None, generators=None, vocab: int = VOCAB):
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, prompts, outputs, generators or {}, vocab, CPU)


def _draft_probs(spec: SpecDecodeMetadata, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(spec.total_draft_tokens, vocab, generator=gen), dim=-1)


def _greedy_reference(spec, logits, params, prompts, outputs) -> list[list[int]]:
    """Per request: accept drafts while they equal the argmax of the reference-processed row, then emit the argmax."""
    result = []
    for i, drafts in enumerate(spec.draft_token_ids):
        start = int(spec.row_starts[i])
        emitted = []
        for j in range(len(drafts) + 1):
            row = processed_logits(logits[start + j], prompts[i], outputs[i] + drafts[:j], params[i])
            best = int(np.argmax(row))
            if j == len(drafts) or drafts[j] != best:
                emitted.append(best)
                break
            emitted.append(drafts[j])
        result.append(emitted)
    return result


def test_layout_indices_and_histories() -> None:
    spec = SpecDecodeMetadata([[5, 6], [], [7]])
    assert spec.num_draft_tokens.tolist() == [2, 0, 1]
    assert spec.cu_num_draft_tokens.tolist() == [2, 2, 3]
    assert spec.max_spec_len == 2 and spec.total_draft_tokens == 3 and spec.total_rows == 6
    assert spec.row_starts.tolist() == [0, 3, 4]
    assert spec.target_logits_indices.tolist() == [0, 1, 4]
    assert spec.bonus_logits_indices.tolist() == [2, 3, 5]
    assert spec.request_of_row.tolist() == [0, 0, 0, 1, 2, 2]
    assert spec.position_of_row.tolist() == [0, 1, 2, 0, 0, 1]
    assert spec.position_of_draft.tolist() == [0, 1, 0]
    assert spec.position_histories([[1], [2], []]) == [[1], [1, 5], [1, 5, 6], [2], [], [7]]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_greedy_matches_argmax_chain(method: str, with_probs: bool) -> None:
    gen = np.random.default_rng(3)
    logits = gen.normal(0.0, 2.0, size=(40, VOCAB)).astype(np.float32)
    best = logits.argmax(axis=1).tolist()
    spec_rows = [
        [best[0], best[1], best[2]],  # all accepted -> bonus
        [best[4], (best[5] + 1) % VOCAB, best[6]],  # mismatch at 1
        [(best[8] + 3) % VOCAB],  # mismatch at 0
        [],  # no drafts -> plain argmax
        [-1, best[12]],  # placeholder rejected
        [best[14], best[15], best[16], (best[17] + 2) % VOCAB],  # mismatch at the last draft
    ]
    spec = SpecDecodeMetadata(spec_rows)
    params = [SamplingParams(temperature=0.0)] * spec.num_requests
    empty = [[] for _ in params]
    rows = torch.tensor(logits[: spec.total_rows])
    probs = _draft_probs(spec, 1) if with_probs else None
    out = RejectionSampler(method)(spec, probs, rows, _md(params), deterministic_proposer=True)
    assert out == _greedy_reference(spec, logits[: spec.total_rows], params, empty, empty)
    assert out[0] == spec_rows[0] + [best[3]] and out[3] == [best[10]] and out[4] == [best[11]]
    # One random request in the batch: the greedy rows take the tensor path of a mixed batch, with the same result.
    mixed = SpecDecodeMetadata(spec_rows + [[best[30]]])
    mixed_params = params + [SamplingParams(temperature=1.0, seed=0)]
    gens = {len(spec_rows): make_generator(0, "device", CPU)}
    probs = _draft_probs(mixed, 1) if with_probs else None
    got = RejectionSampler(method)(mixed, probs, torch.tensor(logits[: mixed.total_rows]),
                                   _md(mixed_params, generators=gens), deterministic_proposer=True)
    assert got[: len(spec_rows)] == out


def test_greedy_applies_processors_per_position() -> None:
    """A frequency penalty makes the argmax depend on the drafts before each position."""
    logits = np.full((8, VOCAB), -1.0, dtype=np.float32)
    logits[:, 3], logits[:, 5], logits[:, 9] = 2.0, 1.5, 1.2
    p_freq = SamplingParams(temperature=0.0, frequency_penalty=0.9, logit_bias={9: 0.2})
    p_rep = SamplingParams(temperature=0.0, repetition_penalty=1.8, allowed_token_ids=[3, 5, 9, 11])
    params, prompts, outputs = [p_freq, p_rep], [[1, 2], [3, 5]], [[7], [9]]
    chain = _greedy_reference(SpecDecodeMetadata([[], []]), logits, params, prompts, outputs)
    drafts0 = []
    for j in range(3):
        row = processed_logits(logits[j], prompts[0], outputs[0] + drafts0, p_freq)
        drafts0.append(int(np.argmax(row)))
    assert len(set(drafts0)) > 1 and chain[0] == [3]  # the history changes the argmax
    spec = SpecDecodeMetadata([drafts0, [9, 9]])
    out = RejectionSampler()(spec, None, torch.tensor(logits[:7]), _md(params, prompts, outputs), True)
    assert out == _greedy_reference(spec, logits[:7], params, prompts, outputs)
    assert out[0][:3] == drafts0


def test_min_tokens_masks_only_positions_below_the_minimum() -> None:
    eos = 4
    p = SamplingParams(temperature=0.0, min_tokens=3)
    p.update_from_generation_config({eos})
    logits = np.zeros((4, VOCAB), dtype=np.float32)
    logits[:, eos], logits[:, 6] = 5.0, 1.0
    outputs = [[8]]
    md = _md([p], outputs=outputs)
    spec = SpecDecodeMetadata([[6, 6, 6]], min_tokens=[3])
    out = RejectionSampler()(spec, None, torch.tensor(logits), md, True)
    assert out == [[6, 6, eos]]
    assert out == _greedy_reference(spec, logits, [p], [[]], outputs)
    with pytest.raises(ValueError, match="min_tokens"):
        RejectionSampler()(SpecDecodeMetadata([[6, 6, 6]]), None, torch.tensor(logits), md, True)
    expanded = expand_sampling_metadata(md, spec)
    assert sorted(expanded.min_tokens) == [0, 1]


def test_no_drafts_draws_what_the_plain_sampler_draws() -> None:
    """k = 0 everywhere: identical processing and identical RNG use as ``Sampler`` (seeded and unseeded rows)."""
    gen = np.random.default_rng(5)
    params = [
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.2),
        SamplingParams(temperature=1.1, min_p=0.05, presence_penalty=0.5, logit_bias={2: 1.0}),
        SamplingParams(temperature=0.6, frequency_penalty=0.3),
    ] * 4
    prompts = [gen.integers(0, VOCAB, 5).tolist() for _ in params]
    outputs = [gen.integers(0, VOCAB, 3).tolist() for _ in params]
    logits = torch.tensor(gen.normal(0.0, 1.5, size=(len(params), VOCAB)).astype(np.float32))
    spec = SpecDecodeMetadata([[] for _ in params])
    for placement in RNG_PLACEMENTS:
        for method in METHODS:
            gens_a = {r: make_generator(100 + r, placement, CPU) for r in (0, 3, 7)}
            gens_b = {r: make_generator(100 + r, placement, CPU) for r in (0, 3, 7)}
            plain = Sampler(placement, torch.Generator().manual_seed(9))(
                logits, _md(params, prompts, outputs, gens_a)
            ).sampled_token_ids[:, 0].tolist()
            spec_out = RejectionSampler(method, placement, torch.Generator().manual_seed(9))(
                spec, torch.empty(0, VOCAB), logits, _md(params, prompts, outputs, gens_b), False
            )
            assert spec_out == [[t] for t in plain]


@pytest.mark.parametrize("method", METHODS)
def test_identical_draft_and_target_accepts_everything(method: str) -> None:
    gen = torch.Generator().manual_seed(2)
    spec = SpecDecodeMetadata([[1, 2, 3], [4, 5]] * 50)
    logits = torch.randn(spec.total_rows, VOCAB, generator=gen)
    probs = torch.softmax(logits[torch.from_numpy(spec.target_logits_indices)], dim=-1)
    params = [SamplingParams(temperature=1.0)] * spec.num_requests
    out = RejectionSampler(method, generator=torch.Generator().manual_seed(0))(spec, probs, logits, _md(params), False)
    assert all(o[:-1] == d for o, d in zip(out, spec.draft_token_ids))


@pytest.mark.parametrize("method", METHODS)
def test_output_shape_and_support(method: str) -> None:
    """Each output is an accepted prefix + one token that is never outside the top-k support; the caller's target
    logits are left as they were."""
    gen = torch.Generator().manual_seed(4)
    spec = SpecDecodeMetadata([[1, 2, 3], [], [4], [-1, 2]] * 25)
    logits = torch.randn(spec.total_rows, VOCAB, generator=gen)
    params = [SamplingParams(temperature=0.9, top_k=3)] * spec.num_requests
    before = logits.clone()
    out = RejectionSampler(method)(spec, _draft_probs(spec, 8), logits, _md(params), False)
    assert torch.equal(logits, before)  # no processors: the target logits are read, never written
    top3 = logits.topk(3, dim=-1).indices
    for i, (o, d) in enumerate(zip(out, spec.draft_token_ids)):
        assert 1 <= len(o) <= len(d) + 1 and o[:-1] == d[: len(o) - 1]
        assert o[-1] in top3[int(spec.row_starts[i]) + len(o) - 1].tolist()
        assert -1 not in o


def test_contract_errors() -> None:
    spec = SpecDecodeMetadata([[1, 2], [3]])
    logits = torch.zeros(spec.total_rows, VOCAB)
    md = _md([SamplingParams(temperature=0.0)] * 2)
    probs = _draft_probs(spec, 0)
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match="deterministic"):
        sampler(spec, None, logits, md, deterministic_proposer=False)
    with pytest.raises(ValueError, match="rows"):
        sampler(spec, probs, logits[:-1], md, False)
    with pytest.raises(ValueError, match="draft_probs has shape"):
        sampler(spec, probs[:-1], logits, md, False)
    with pytest.raises(ValueError, match="one per request"):
        sampler(spec, probs, logits, _md([SamplingParams()]), False)
    for bad in (VOCAB, -2):
        with pytest.raises(ValueError, match=f"draft token id {bad} "):
            sampler(SpecDecodeMetadata([[bad], [3]]), probs[:2], logits[:4], md, False)
    with pytest.raises(ValueError, match="magic"):
        RejectionSampler(method="magic")
    with pytest.raises(ValueError, match="nowhere"):
        RejectionSampler(rng_placement="nowhere")
    with pytest.raises(ValueError, match="min_tokens has 1"):
        SpecDecodeMetadata([[1], [2]], min_tokens=[3])
    assert RejectionSampler()(SpecDecodeMetadata([]), None, torch.zeros(0, VOCAB), _md([]), True) == []


def _seeded_steps(method: str, placement: str, layout: list[str], steps: int = 6) -> list[list[int]]:
    """Outputs of the "me" request over ``steps`` verification steps of a batch laid out as ``layout``."""
    kinds = {"me": (0.9, 3), "greedy": (0.0, 2), "free": (1.0, 1), "other": (0.8, 4), "empty": (1.2, 0)}
    params = [SamplingParams(temperature=kinds[k][0], top_p=0.95) for k in layout]
    gens = {r: make_generator(7 if k == "me" else 50 + r, placement, CPU) for r, k in enumerate(layout)
            if k in ("me", "other")}
    md = _md(params, generators=gens)
    sampler = RejectionSampler(method, placement, torch.Generator().manual_seed(len(layout)))
    me, out = layout.index("me"), []
    for step in range(steps):
        noise = torch.Generator().manual_seed(1000 + step)
        mine = torch.randn(kinds["me"][1] + 1, VOCAB, generator=noise)
        my_probs = torch.softmax(torch.randn(kinds["me"][1], VOCAB, generator=noise), dim=-1)
        drafts = [[(step + (0 if k == "me" else r) + j) % VOCAB for j in range(kinds[k][1])]
                  for r, k in enumerate(layout)]
        spec = SpecDecodeMetadata(drafts)
        logits = torch.randn(spec.total_rows, VOCAB, generator=torch.Generator().manual_seed(len(layout) + step))
        probs = _draft_probs(spec, step)
        start, dstart = int(spec.row_starts[me]), int(spec.draft_starts[me])
        logits[start:start + kinds["me"][1] + 1] = mine
        probs[dstart:dstart + kinds["me"][1]] = my_probs
        out.append(sampler(spec, probs, logits, md, False)[me])
    return out


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
@pytest.mark.parametrize("method", METHODS)
def test_seeded_request_is_independent_of_the_batch(method: str, placement: str) -> None:
    alone = _seeded_steps(method, placement, ["me"])
    crowded = _seeded_steps(method, placement, ["free", "greedy", "other", "me", "empty", "free"])
    reordered = _seeded_steps(method, placement, ["other", "empty", "me"])
    assert alone == crowded == reordered
    assert len({len(o) for o in alone}) > 1 or len({tuple(o) for o in alone}) > 1
