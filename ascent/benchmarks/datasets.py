"""Synthetic benchmark requests: random prompt token ids with fixed or uniformly drawn input/output lengths
(the nano-vllm protocol: lengths U[lo, hi] inclusive, token ids uniform, one seeded generator)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def parse_len_range(text: str, name: str = "range") -> tuple[int, int]:
    """Parse ``"16,256"`` into ``(16, 256)``; both bounds positive and ordered, else ``ValueError``."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be two integers 'LO,HI'") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}={text!r} must satisfy 1 <= LO <= HI")
    return lo, hi


def resolve_len_range(fixed: int | None, span: tuple[int, int] | str | None, default: tuple[int, int],
                      name: str) -> tuple[int, int]:
    """A fixed length wins over a range; a range string is parsed; otherwise ``default``."""
    if fixed is not None:
        if fixed < 1:
            raise ValueError(f"{name}={fixed!r} must be at least 1")
        return fixed, fixed
    if span is None:
        return default
    return parse_len_range(span, name) if isinstance(span, str) else parse_len_range(f"{span[0]},{span[1]}", name)


def sample_requests(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0, token_offset: int = 0) -> list[BenchRequest]:
    """Draw ``num_prompts`` requests: input and output lengths uniform in the inclusive ranges, prompt ids uniform
    in ``[token_offset, vocab_size)``. Same arguments -> same requests."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r} must be at least 1")
    if not 0 <= token_offset < vocab_size:
        raise ValueError(f"token_offset={token_offset!r} must lie in [0, vocab_size={vocab_size!r})")
    for name, (lo, hi) in (("input_range", input_range), ("output_range", output_range)):
        if lo < 1 or hi < lo:
            raise ValueError(f"{name}={(lo, hi)!r} must satisfy 1 <= lo <= hi")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    return [
        BenchRequest(rng.integers(token_offset, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens)
    ]


def length_summary(requests: list[BenchRequest]) -> dict[str, int | float]:
    """Totals and means of the requested input/output lengths."""
    ins = [r.input_len for r in requests]
    outs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "total_input_tokens": int(sum(ins)),
        "total_output_tokens": int(sum(outs)),
        "mean_input_len": float(np.mean(ins)),
        "mean_output_len": float(np.mean(outs)),
        "max_input_len": int(max(ins)),
        "max_output_len": int(max(outs)),
    }
