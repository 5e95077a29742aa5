"""Random draws for the sampler: where the randomness is made and how a token is picked from ``probs``.

Placements (the hardware profile's ``sampler RNG`` slot):

- ``"device"``: exponential race. ``q ~ Exp(1)`` of shape ``[B, V]`` is drawn on the probs' device (the engine
  generator, or the device's default one, for unseeded rows); ``token = argmax(probs / q)``.
- ``"host"``: the same exponential race, with the noise drawn on the CPU and copied to the device.
- ``"host_cdf"``: one uniform ``u`` per row drawn on the CPU (float64), ``token = searchsorted(cumsum(probs), u *
  total, right=True)`` (inverse CDF; the 310P path and the cheap CPU default).

All three draw exactly from ``probs / probs.sum()``. Rows with a per-request generator (seeded requests) draw their own
noise from it and nothing else does, so a seeded request's tokens do not depend on the rest of the batch. Each
generator's draws happen on ``generator.device``; create per-request generators with :func:`make_generator` so they
live where the placement draws.
"""

from __future__ import annotations

from typing import Any

import torch

from ascent.layers.cpu_kernels import sampling_ops

RNG_PLACEMENTS = ("device", "host", "host_cdf")
_TINY = torch.finfo(torch.float32).tiny
_CPU = torch.device("cpu")


_LOOK_UP = object()


def argmax_rows(x: torch.Tensor, kernels: Any = _LOOK_UP) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor, int64 ``[B]``; the CPU kernel for float32 rows (the same index in
    every case: first maximum, NaN greatest), torch elsewhere. ``kernels``: ``sampling_ops()`` as a caller resolved
    it once (None = torch), by default looked up now."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    kernels = sampling_ops() if kernels is _LOOK_UP else kernels
    return kernels.argmax_rows(x) if kernels is not None else x.argmax(dim=-1)


def check_placement(placement: str) -> str:
    """Return ``placement`` if it names a known RNG placement, else raise ValueError naming it."""
    if placement not in RNG_PLACEMENTS:
        raise ValueError(f"rng_placement must be one of {RNG_PLACEMENTS}, got {placement!r}.")
    return placement


def generator_device(placement: str, device: torch.device | str) -> torch.device:
    """The device on which generators for ``placement`` live: ``device`` for "device", the CPU otherwise."""
    return torch.device(device) if check_placement(placement) == "device" else _CPU


def make_generator(seed: int, placement: str, device: torch.device | str) -> torch.Generator:
    """A per-request generator seeded once with ``seed``, placed where ``placement`` draws its noise."""
    gen = torch.Generator(device=generator_device(placement, device))
    gen.manual_seed(int(seed))
    return gen


def exponential_noise(
    num_rows: int,
    vocab_size: int,
    generators: dict[int, torch.Generator],
    shared: torch.Generator | None,
    noise_device: torch.device,
    out_device: torch.device,
) -> torch.Tensor:
    """``q ~ Exp(1)``, float32 ``[num_rows, vocab_size]`` on ``out_device``, clamped to ``>= float32 tiny``.

    Rows in ``generators`` draw their row from that generator; the others share one draw from ``shared`` (or the
    default generator of ``noise_device`` when ``shared`` is None).
    """
    q = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=out_device)
    if len(generators) < num_rows:
        src_device = shared.device if shared is not None else noise_device
        shared_q = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=src_device)
        q.copy_(shared_q.exponential_(generator=shared))
    for row, gen in generators.items():
        row_q = torch.empty(vocab_size, dtype=torch.float32, device=gen.device).exponential_(generator=gen)
        q[row].copy_(row_q)
    return q.clamp_min_(_TINY)


def host_uniforms(
    num_rows: int, generators: dict[int, torch.Generator], shared: torch.Generator | None
) -> torch.Tensor:
    """One ``u ~ U[0, 1)`` per row, float64 ``[num_rows]`` on the CPU, clamped to ``>= float32 tiny``.

    Seeded rows draw one value from their own generator (on its device, then copied); the others from ``shared``.
    """
    u = torch.empty(num_rows, dtype=torch.float64)
    if len(generators) < num_rows:
        u.copy_(torch.rand(num_rows, dtype=torch.float64, generator=shared, device=_shared_device(shared)))
    for row, gen in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).item()
    return u.clamp_min_(_TINY)


def _shared_device(shared: torch.Generator | None) -> torch.device:
    return shared.device if shared is not None else _CPU


def sample_exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / q)`` per row: int64 ``[B]``. ``probs`` may be unnormalised (non-negative)."""
    return argmax_rows(probs.div(q))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: int64 ``[B]``.

    ``probs``: non-negative weights ``[B, V]`` (need not sum to 1); ``u``: ``[B]`` in ``(0, 1)``. The token is the
    number of cumulative sums ``<= u * total`` (fp64), so zero-weight tokens are never chosen; an index past the end
    (``u * total`` rounding up to ``total``) is clamped to the last positive-weight token.
    """
    kernels = sampling_ops() if probs.device.type == "cpu" and probs.dtype == torch.float32 else None
    if kernels is not None:  # same fp64 partial sums in the same order, without materialising the cdf
        return kernels.inverse_cdf_sample(probs, u.to(dtype=torch.float64))
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    vocab_size = probs.shape[1]
    # An index below the end lands where the cdf steps up, i.e. on a positive-weight token, so only rows past the end
    # need the last positive token; on the CPU skip that [B, V] scan when no row is past the end.
    if idx.device.type == "cpu" and not bool((idx >= vocab_size).any()):
        return idx
    last_positive = vocab_size - 1 - (probs > 0).flip(dims=[1]).to(torch.int8).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


class RandomSampler:
    """Draws one token per row from ``probs`` with the configured RNG placement.

    ``generator`` is the engine generator shared by unseeded rows (None = the default generator of the device for
    "device", of the CPU for the host placements); host placements need a CPU generator.
    """

    def __init__(self, placement: str = "device", generator: torch.Generator | None = None) -> None:
        self.placement = check_placement(placement)
        if placement != "device" and generator is not None and generator.device.type != "cpu":
            raise ValueError(f"rng_placement {placement!r} needs a CPU generator, got one on {generator.device}.")
        self.generator = generator

    def sample(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One token per row: int64 ``[B]``.

        ``probs``: float32 ``[B, V]``, non-negative; ``generators``: row -> per-request generator.
        """
        num_rows, vocab_size = probs.shape
        if self.placement == "host_cdf":
            return sample_inverse_cdf(probs, host_uniforms(num_rows, generators, self.generator))
        noise_device = probs.device if self.placement == "device" else _CPU
        q = exponential_noise(num_rows, vocab_size, generators, self.generator, noise_device, probs.device)
        return sample_exponential_race(probs, q)
