"""Host-RNG sampling: the 310P sampler path of specdec spec §1.5 (randomness made on the CPU only).

What ``rng.py`` already provides and is reused unchanged (its "host_cdf" placement is §1.5 steps 2-3 exactly):
one float64 uniform per row clamped to ``>= float32 tiny`` (:func:`ascent.sample.rng.host_uniforms`) and the
float64 inverse-CDF search ``searchsorted(cumsum(w), u * sum(w), right=True)`` with the "rounds up to the total"
clamp to the last positive-weight token (:func:`ascent.sample.rng.sample_inverse_cdf`). Added here:

- :class:`HostGeneratorCache` (§1.5 step 1): each per-request source generator, on whatever device, maps to a CPU
  generator seeded with ``source.initial_seed()``, cached by the identity of the source object (a batch reorder
  keeps each stream; a new source object starts a fresh one). Deliberate difference from upstream: entries live as
  long as their source (weak keys) instead of being rebuilt per call, so a seeded request absent from one step
  continues its stream instead of restarting it;
- :func:`sample_from_cdf`: the inverse-CDF draw with the all-zero-row guard (§1.5 edge case c);
- :func:`fill_exponential` (§1.5 step 4): ``E = -ln(u)``, ``u ~ U[0, 1)`` drawn on the CPU per row, clamped to
  ``>= tiny``; inactive seeded rows do not advance their stream;
- :class:`HostRNGSampler`: the sampler's random draw on host randomness, "cdf" (one uniform per row, the default)
  or "exponential" (exponential race on host noise).
"""

from __future__ import annotations

import weakref

import torch

from ascent.sample.rng import RandomSampler, host_uniforms, sample_exponential_race, sample_inverse_cdf

HOST_RNG_METHODS = ("cdf", "exponential")
_TINY = torch.finfo(torch.float32).tiny


class HostGeneratorCache:
    """Source generator (any device) -> dedicated CPU generator seeded with ``source.initial_seed()``."""

    def __init__(self) -> None:
        self._cpu: weakref.WeakKeyDictionary[torch.Generator, torch.Generator] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._cpu)

    def get(self, source: torch.Generator) -> torch.Generator:
        """The CPU generator of ``source`` (created on first use; ``source`` itself is never drawn from)."""
        cpu = self._cpu.get(source)
        if cpu is None:
            cpu = torch.Generator(device="cpu")
            cpu.manual_seed(source.initial_seed())
            self._cpu[source] = cpu
        return cpu

    def map(self, generators: dict[int, torch.Generator]) -> dict[int, torch.Generator]:
        """``{row: CPU generator}`` for ``{row: source generator}``."""
        return {row: self.get(gen) for row, gen in generators.items()}


def request_uniforms(num_rows: int, generators: dict[int, torch.Generator], cache: HostGeneratorCache,
                     shared: torch.Generator | None = None) -> torch.Tensor:
    """One ``u ~ U[0, 1)`` per row: float64 ``[num_rows]`` on the CPU, clamped to ``>= float32 tiny``.

    Rows in ``generators`` draw from their mapped CPU generator, the others share one draw from ``shared`` (a CPU
    generator; None = the global CPU RNG).
    """
    _check_rows(num_rows, generators)
    return host_uniforms(num_rows, cache.map(generators), shared)


def sample_from_cdf(weights: torch.Tensor, u: torch.Tensor, zero_row_token: int = 0) -> torch.Tensor:
    """Inverse-CDF draw per row: int64 ``[B]`` on ``weights``' device, ``P(v) = w_v / sum(w)`` exactly.

    ``weights``: non-negative ``[B, V]``, need not be normalised; ``u``: ``[B]`` in ``(0, 1)``. The cumulative sums
    are float64; zero-weight tokens are never chosen; ``u * total`` rounding up to the total is clamped to the last
    positive-weight token; an all-zero row returns ``zero_row_token`` (0 = what the exponential race returns).
    """
    if weights.dim() != 2 or u.shape != (weights.shape[0],):
        raise ValueError(f"expected weights [B, V] and u [B], got {tuple(weights.shape)} and {tuple(u.shape)}")
    if not 0 <= zero_row_token < weights.shape[1]:
        raise ValueError(f"zero_row_token {zero_row_token} is outside the vocabulary of {weights.shape[1]}")
    tokens = sample_inverse_cdf(weights, u)
    empty = ~(weights > 0).any(dim=-1)
    return tokens.masked_fill_(empty, zero_row_token)


def fill_exponential(reference: torch.Tensor, generators: dict[int, torch.Generator], cache: HostGeneratorCache,
                     active_mask: torch.Tensor | None = None, shared: torch.Generator | None = None) -> torch.Tensor:
    """``E ~ Exp(1)`` noise shaped like ``reference`` ``[B, V]``, in its dtype and on its device.

    Uniforms are float32 on the CPU, clamped to ``>= float32 tiny``, then ``E = -ln(u)``. A seeded row draws its row
    from its mapped CPU generator only if it is active (``active_mask`` bool ``[B]``, None = all active); every
    other row comes from one draw of ``shared`` (None = the global CPU RNG), so inactive rows never advance their
    request's stream.
    """
    if reference.dim() != 2:
        raise ValueError(f"reference must be [B, V], got shape {tuple(reference.shape)}")
    num_rows, vocab_size = reference.shape
    _check_rows(num_rows, generators)
    if active_mask is not None and tuple(active_mask.shape) != (num_rows,):
        raise ValueError(f"active_mask must have shape ({num_rows},), got {tuple(active_mask.shape)}")
    active = None if active_mask is None else active_mask.to("cpu", torch.bool).tolist()
    own = {row: gen for row, gen in cache.map(generators).items() if active is None or active[row]}
    u = torch.empty(num_rows, vocab_size, dtype=torch.float32)
    if len(own) < num_rows:
        torch.rand(num_rows, vocab_size, generator=shared, out=u)
    for row, gen in own.items():
        u[row] = torch.rand(vocab_size, generator=gen)
    noise = u.clamp_min_(_TINY).log_().neg_()
    return noise.to(device=reference.device, dtype=reference.dtype)


def _check_rows(num_rows: int, generators: dict[int, torch.Generator]) -> None:
    bad = [row for row in generators if not 0 <= row < num_rows]
    if bad:
        raise ValueError(f"generator rows {bad} are outside a batch of {num_rows} rows")


class HostRNGSampler(RandomSampler):
    """One token per row from ``probs`` with host-made randomness (the 310P sampler).

    ``method``: "cdf" (one float64 uniform per row + inverse CDF) or "exponential" (``argmax(probs / E)`` with host
    noise from :func:`fill_exponential`). ``generator``: CPU generator for rows without a per-request generator
    (None = the global CPU RNG). Per-request generators are mapped through a :class:`HostGeneratorCache`.
    """

    def __init__(self, method: str = "cdf", generator: torch.Generator | None = None) -> None:
        if method not in HOST_RNG_METHODS:
            raise ValueError(f"method must be one of {HOST_RNG_METHODS}, got {method!r}")
        super().__init__("host_cdf" if method == "cdf" else "host", generator)
        self.method = method
        self.cache = HostGeneratorCache()

    def sample(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """int64 ``[B]`` on probs' device; ``probs`` float ``[B, V]`` non-negative; ``generators``: row -> source."""
        if probs.dim() != 2:
            raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
        if self.method == "cdf":
            u = request_uniforms(probs.shape[0], generators, self.cache, self.generator)
            return sample_from_cdf(probs, u)
        noise = fill_exponential(probs, generators, self.cache, None, self.generator)
        return sample_exponential_race(probs, noise)
