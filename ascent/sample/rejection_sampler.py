"""Rejection sampler: verifies draft tokens against the target model (specdec spec §2), lossless by construction.

Per request ``i`` with drafts ``d_1..d_k`` (layout: ``spec_metadata.py``), target rows are processed exactly like
plain sampler rows (allowed ids, min_tokens, logit_bias, penalties with the drafts before each position in the
history; then temperature, min-p, top-k, top-p), giving ``p_j`` (float32 softmax) per position ``j = 0..k``.

- Greedy requests (temperature 0): accept while ``d_{j+1} == argmax_j``; emit the argmax at the first mismatch, or
  the bonus argmax ``argmax_k`` when every draft matched. Identical to non-speculative greedy decoding.
- Random requests, ``method="standard"`` (Leviathan et al. 2023, arXiv 2211.17192): accept ``d_{j+1}`` iff
  ``q_j(d) > 0`` and ``u_j * q_j(d) < p_j(d)`` with ``u_j ~ U[0, 1)`` float64 (probability ``min(1, p/q)``); at the
  first rejection emit a token from ``max(p_j - q_j, 0)`` (normalised); if all are accepted emit the bonus token from
  ``p_k``.
- Random requests, ``method="block"``: block verification (Sun et al., ICLR 2025, arXiv 2403.10444, Algorithm 2),
  see :func:`block_verify`.
- ``draft_probs=None`` (deterministic proposers only: n-gram, suffix, greedy model drafters): the proposal is a
  point mass, ``q_j = onehot(d_{j+1})``, so acceptance is ``u < p(d)`` and the residual is ``p`` with ``d`` removed.
- Placeholder drafts (``-1``) are always rejected; their proposal row counts as zero, so the residual is ``p_j``.
- A residual that is all zero in floating point (``p == q``) falls back to ``p_j``.

Randomness, per request (seeded requests draw only from their own generator, in this order, so their output does not
depend on the batch): ``k`` float64 uniforms for the accept tests, then ONE final draw (recovered or bonus token) from
the final weights with the configured RNG placement (``rng.py``: exponential race on device / host noise, or
``"host_cdf"``: one host uniform + float64 inverse CDF, the 310P and CPU default). Recovered tokens are drawn only for
the requests that reject, one row each. A batch without drafts draws exactly what the plain ``Sampler`` draws.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rng import RandomSampler, argmax_rows
from ascent.sample.sampler import apply_logits_processors, apply_random_transforms, has_logits_processors
from ascent.sample.spec_metadata import SpecDecodeMetadata, expand_sampling_metadata

__all__ = [
    "VERIFY_METHODS",
    "RejectionSampler",
    "SpecDecodeMetadata",
    "block_prefix_weights",
    "block_residual_mass",
    "block_verify",
    "final_weights",
    "leading_accepts",
    "standard_verify",
]

VERIFY_METHODS = ("standard", "block")


def leading_accepts(flags: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
    """Per request, the number of leading True flags among its drafts: int64 ``[B]`` (``flags``: bool ``[T]``)."""
    padded = _pad(flags.to(torch.int64), spec, 0)
    return padded.cumprod(dim=1).sum(dim=1)


def _pad(flat: torch.Tensor, spec: SpecDecodeMetadata, fill: float) -> torch.Tensor:
    """Flat per-draft values ``[T]`` -> ``[B, max_spec_len]``, ``fill`` past each request's drafts."""
    out = flat.new_full((spec.num_requests, spec.max_spec_len), fill)
    if flat.numel():
        out[_index(spec.request_of_draft, flat.device), _index(spec.position_of_draft, flat.device)] = flat
    return out


def _verify_all_greedy(spec: SpecDecodeMetadata, argmax: list[int]) -> list[list[int]]:
    """Greedy verification of a batch without logits processors, from the target argmax of every row (host ints):
    per request the drafts equal to the argmax before them, then the argmax after the last accepted one. The same
    result as :meth:`RejectionSampler._verify_greedy`, without its tensor bookkeeping (a decode step's batch is
    small)."""
    out: list[list[int]] = []
    row = 0
    for drafts in spec.draft_token_ids:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == argmax[row + accepted]:
            accepted += 1
        out.append(list(drafts[:accepted]) + [argmax[row + accepted]])
        row += len(drafts) + 1
    return out


def _index(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def standard_verify(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor,
                    spec: SpecDecodeMetadata) -> torch.Tensor:
    """Token-level verification. ``p_draft`` / ``q_draft``: float64 ``[T]`` target / proposal probability of each
    draft (``q = 0`` for placeholders); ``u``: float64 ``[T]`` in ``[0, 1)``. Returns accepted counts int64 ``[B]``."""
    accept = (q_draft > 0) & (u * q_draft < p_draft)
    return leading_accepts(accept, spec)


def block_prefix_weights(p_draft: torch.Tensor, q_draft: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
    """``p_i`` of Algorithm 2 (see :func:`block_verify`) per request: float64 ``[B, max_spec_len + 1]``, column 0 =
    1, 0 past a request's drafts and after a placeholder / zero-proposal draft. ``p_draft`` / ``q_draft`` as in
    :func:`standard_verify`."""
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    padded = _pad(ratio, spec, 0.0)
    weights = torch.ones(spec.num_requests, spec.max_spec_len + 1, dtype=torch.float64, device=p_draft.device)
    for i in range(spec.max_spec_len):
        weights[:, i + 1] = (weights[:, i] * padded[:, i]).clamp_max(1.0)
    return weights


def block_residual_mass(target: torch.Tensor | None, p_draft: torch.Tensor, drafts: torch.Tensor,
                        draft_probs: torch.Tensor | None, coef: torch.Tensor) -> torch.Tensor:
    """``Σ_x max(c · M_b(x) - M_s(x), 0)`` per draft: float64 ``[T]``.

    ``target``: float32 ``[T, V]`` target probs at each draft's position (unused without draft probs);
    ``coef``: float64 ``[T]``, the prefix weight ``p_j`` of the draft's position. For a deterministic proposer
    (``M_s`` = one-hot at the draft, zero for a placeholder) the sum is ``c · (1 - M_b(d))`` in closed form.
    """
    valid = drafts >= 0
    if draft_probs is None:
        return coef * (1.0 - p_draft * valid)
    assert target is not None
    proposal = draft_probs.to(target.device, torch.float32) * valid.unsqueeze(1)
    residual = (coef.to(torch.float32).unsqueeze(1) * target - proposal).clamp_min_(0.0)
    return residual.sum(dim=1).to(torch.float64)


def block_verify(weights: torch.Tensor, residual_mass: torch.Tensor, eta: torch.Tensor,
                 spec: SpecDecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification, arXiv 2403.10444 Algorithm 2 (lossless; optimal among on-path verifiers).

    With ``M_b`` / ``M_s`` the target / draft conditionals and drafts ``X_1..X_γ`` (``γ = k_i``):
    ``p_0 = 1``; ``p_i = min(1, p_{i-1} M_b(X_i | X_<i) / M_s(X_i | X_<i))``;
    ``h_i = S_i / (S_i + 1 - p_i)`` with ``S_i = Σ_x max(p_i M_b(x | X_≤i) - M_s(x | X_≤i), 0)`` for ``i < γ`` and
    ``h_γ = p_γ``; ``τ`` = the largest ``i`` with ``η_i < h_i`` (0 if none); output ``X_≤τ`` then
    ``Y ~ M_b(· | X_≤γ)`` if ``τ = γ`` else ``Y ∝ max(p_τ M_b(· | X_≤τ) - M_s(· | X_≤τ), 0)``.
    ``h_i`` with a zero denominator (``p_i = 1`` and ``S_i = 0``: the residual is empty) is taken as 1.
    What was verified: the formula above is the transcription of Algorithm 2 in ``specdec_sampling.md`` §2.6 (the
    paper's full text was not retrievable here); ``tests/reference/test_rejection_stats.py`` enumerates it exactly
    in float64 and checks that it is lossless (emitted prefix + target continuation == target joint, to 1e-12) for
    random context-dependent models, never accepts fewer tokens than token verification in expectation, and
    reproduces the paper's motivating example: 11/9 expected accepted tokens against 10/9 for token verification.

    ``weights``: :func:`block_prefix_weights` ``[B, K + 1]``; ``residual_mass``: float64 ``[T]``, ``S_j`` at each
    draft's position ``j`` (:func:`block_residual_mass` with ``c = p_j``; ``S_0`` is unused); ``eta``: float64
    ``[T]`` uniforms. Returns (τ int64 ``[B]``, ``p_τ`` float64 ``[B]``).
    """
    num_drafts = _index(spec.num_draft_tokens, weights.device)
    if spec.max_spec_len == 0:
        return torch.zeros_like(num_drafts), weights[:, 0]
    mass = _pad(residual_mass, spec, 0.0)
    s_i = torch.cat([mass[:, 1:], torch.zeros_like(mass[:, :1])], dim=1)
    p_i = weights[:, 1:]
    denom = s_i + 1.0 - p_i
    h = torch.where(denom > 0, s_i / denom.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(p_i))
    positions = torch.arange(1, spec.max_spec_len + 1, device=weights.device).unsqueeze(0)
    h = torch.where(positions == num_drafts.unsqueeze(1), p_i, h)
    h = h.masked_fill(positions > num_drafts.unsqueeze(1), 0.0)
    tau = ((_pad(eta, spec, 1.0) < h).to(torch.int64) * positions).amax(dim=1)
    return tau, weights.gather(1, tau.unsqueeze(1)).squeeze(1)


class RejectionSampler(nn.Module):
    """Verifies drafts and emits, per request, its accepted drafts plus one recovered or bonus token.

    ``method``: "standard" (token-level) | "block" (arXiv 2403.10444, lossless, opt-in); ``rng_placement``: "device" |
    "host" | "host_cdf" (``rng.py``; the 310p profile's host-RNG variant is "host_cdf"); ``generator``: the engine
    generator for requests without a per-request generator (a CPU generator for the host placements).
    """

    def __init__(self, method: str = "standard", rng_placement: str = "device",
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if method not in VERIFY_METHODS:
            raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}.")
        self.method = method
        self.random_sampler = RandomSampler(rng_placement, generator)

    @property
    def rng_placement(self) -> str:
        return self.random_sampler.placement

    def forward(self, spec: SpecDecodeMetadata, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                sampling_metadata: SamplingMetadata, deterministic_proposer: bool) -> list[list[int]]:
        """Verify one step.

        ``draft_probs``: float32 ``[T, V]`` (``T = Σ k_i``), the proposal distribution of each draft, or None for a
        deterministic proposer (else ValueError); ``target_logits``: float ``[T + B, V]`` in the layout of
        :class:`SpecDecodeMetadata` (not modified); ``sampling_metadata``: one row per request, built exactly as for
        plain sampling (greedy requests ignore ``draft_probs``). Returns per request ``drafts[:a] + [token]``
        (``1 <= len <= k_i + 1``; ``a`` accepted drafts, then the recovered or bonus token).
        """
        _validate(spec, draft_probs, target_logits, sampling_metadata, deterministic_proposer)
        if spec.num_requests == 0:
            return []
        greedy = (sampling_metadata.temperature <= 0).cpu().numpy()
        if greedy.all() and not has_logits_processors(sampling_metadata) and target_logits.dtype == torch.float32:
            return _verify_all_greedy(spec, argmax_rows(target_logits).tolist())
        row_md = expand_sampling_metadata(sampling_metadata, spec)
        if not has_logits_processors(row_md) and target_logits.dtype == torch.float32:
            processed = target_logits  # read only: the argmax and the out-of-place temperature need no copy
        else:
            processed = apply_logits_processors(
                target_logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format), row_md
            )
        accepted = np.zeros(spec.num_requests, dtype=np.int64)
        final = np.zeros(spec.num_requests, dtype=np.int64)
        if greedy.any():
            self._verify_greedy(spec, argmax_rows(processed).cpu().numpy(), greedy, accepted, final)
        if not greedy.all():
            probs = torch.softmax(apply_random_transforms(processed, row_md, inplace=processed is not target_logits),
                                  dim=-1)
            self._verify_random(spec, draft_probs, probs, sampling_metadata.generators, ~greedy, accepted, final)
        return [drafts[:a] + [t] for drafts, a, t in zip(spec.draft_token_ids, accepted.tolist(), final.tolist())]

    @staticmethod
    def _verify_greedy(spec: SpecDecodeMetadata, argmax: np.ndarray, rows: np.ndarray, accepted: np.ndarray,
                       final: np.ndarray) -> None:
        match = torch.from_numpy(spec.flat_draft_token_ids == argmax[spec.target_logits_indices])
        count = leading_accepts(match, spec).numpy()
        accepted[rows] = count[rows]
        final[rows] = argmax[spec.row_starts + count][rows]

    def _verify_random(self, spec: SpecDecodeMetadata, draft_probs: torch.Tensor | None, probs: torch.Tensor,
                       generators: dict[int, torch.Generator], rows: np.ndarray, accepted: np.ndarray,
                       final: np.ndarray) -> None:
        device = probs.device
        drafts = _index(spec.flat_draft_token_ids, device)
        safe = drafts.clamp_min(0)
        target_rows = _index(spec.target_logits_indices, device)
        p_draft = probs[target_rows, safe].to(torch.float64)
        if draft_probs is None:
            q_draft = (drafts >= 0).to(torch.float64)
        else:
            draft_probs = draft_probs.to(device)
            q_draft = draft_probs[torch.arange(drafts.shape[0], device=device), safe].to(torch.float64) * (drafts >= 0)
        u = self._accept_uniforms(spec, generators, device)
        if self.method == "block":
            weights = block_prefix_weights(p_draft, q_draft, spec)
            coef = weights[_index(spec.request_of_draft, device), _index(spec.position_of_draft, device)]
            target = None if draft_probs is None else probs.index_select(0, target_rows)
            mass = block_residual_mass(target, p_draft, drafts, draft_probs, coef)
            count, final_coef = block_verify(weights, mass, u, spec)
        else:
            count = standard_verify(p_draft, q_draft, u, spec)
            final_coef = torch.ones(spec.num_requests, dtype=torch.float64, device=device)
        count_np = count.cpu().numpy()
        accepted[rows] = count_np[rows]
        weights_final = final_weights(spec, probs, drafts, draft_probs, count_np, final_coef, rows)
        req = np.flatnonzero(rows)
        local = {int(np.searchsorted(req, row)): gen for row, gen in generators.items() if rows[row]}
        final[rows] = self.random_sampler.sample(weights_final, local).cpu().numpy()

    def _accept_uniforms(self, spec: SpecDecodeMetadata, generators: dict[int, torch.Generator],
                         device: torch.device) -> torch.Tensor:
        """float64 ``[T]`` uniforms on ``device``: seeded requests' slices from their own generators, the rest from
        one draw of the engine generator (host placements draw it on the CPU)."""
        total = spec.total_draft_tokens
        u = torch.empty(total, dtype=torch.float64, device=device)
        seeded = {row: gen for row, gen in generators.items() if spec.num_draft_tokens[row] > 0}
        if int(sum(spec.num_draft_tokens[row] for row in seeded)) < total:
            shared = self.random_sampler.generator
            src = shared.device if shared is not None else (device if self.rng_placement == "device" else "cpu")
            u.copy_(torch.rand(total, dtype=torch.float64, generator=shared, device=src))
        for row, gen in seeded.items():
            start, num = int(spec.draft_starts[row]), int(spec.num_draft_tokens[row])
            u[start:start + num] = torch.rand(num, dtype=torch.float64, generator=gen, device=gen.device).to(device)
        return u


def final_weights(spec: SpecDecodeMetadata, probs: torch.Tensor, drafts: torch.Tensor,
                  draft_probs: torch.Tensor | None, count: np.ndarray, coef: torch.Tensor,
                  rows: np.ndarray) -> torch.Tensor:
    """The distribution of the token emitted after the accepted drafts, for the requests selected by ``rows``.

    float32 ``[R, V]`` (unnormalised): ``max(coef_i · p_a - q_a, 0)`` when request ``i`` rejected at position
    ``a = count_i < k_i`` (``coef = 1`` for token-level verification, ``p_τ`` for block verification; ``p_a`` itself if
    that residual is empty; ``q_a`` = one-hot at the draft without draft probs, zero for a placeholder), else the
    bonus distribution ``p_k``. ``probs``: float32 ``[T + B, V]``; ``drafts``: int64 ``[T]``; ``count``: int64
    ``[B]``; ``coef``: float64 ``[B]``; ``rows``: bool ``[B]``.
    """
    device = probs.device
    req = np.flatnonzero(rows)
    weights = probs.index_select(0, _index(spec.row_starts[req] + count[req], device))
    rejected = count[req] < spec.num_draft_tokens[req]
    if not rejected.any():
        return weights
    sub = _index(np.flatnonzero(rejected), device)
    draft_idx = _index(spec.draft_starts[req][rejected] + count[req][rejected], device)
    rejected_drafts = drafts.index_select(0, draft_idx)
    base = weights.index_select(0, sub)
    scale = coef.index_select(0, _index(req[rejected], device)).to(torch.float32).unsqueeze(1)
    if draft_probs is None:
        residual = scale * base
        valid = torch.nonzero(rejected_drafts >= 0).squeeze(1)
        residual[valid, rejected_drafts.index_select(0, valid)] = 0.0
    else:
        proposal = draft_probs.index_select(0, draft_idx).to(torch.float32) * (rejected_drafts >= 0).unsqueeze(1)
        residual = (scale * base - proposal).clamp_min_(0.0)
    empty = residual.sum(dim=1) <= 0
    residual[empty] = base[empty]
    weights[sub] = residual
    return weights


def _validate(spec: SpecDecodeMetadata, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
              md: SamplingMetadata, deterministic_proposer: bool) -> int:
    """Shape / contract checks; returns the vocabulary size."""
    if target_logits.dim() != 2 or not target_logits.is_floating_point():
        raise ValueError(f"target_logits must be a float [rows, V] tensor, got {target_logits.dtype} "
                         f"{tuple(target_logits.shape)}.")
    if target_logits.shape[0] != spec.total_rows:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected {spec.total_rows} "
                         "(sum of num_draft_tokens + 1 per request).")
    if md.num_rows != spec.num_requests:
        raise ValueError(f"sampling metadata has {md.num_rows} rows, expected one per request ({spec.num_requests}).")
    vocab_size = int(target_logits.shape[1])
    if draft_probs is None:
        if not deterministic_proposer:
            raise ValueError("draft_probs=None is only valid for a deterministic proposer "
                             "(deterministic_proposer=False): pass the proposer's draft probabilities.")
    elif tuple(draft_probs.shape) != (spec.total_draft_tokens, vocab_size):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                         f"({spec.total_draft_tokens}, {vocab_size}).")
    spec.check_draft_ids(vocab_size)
    return vocab_size
