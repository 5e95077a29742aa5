"""What speculation could gain at a batch size at most, from a dynamic method's fitted step-cost model.

A cost-gated dynamic method fits its decode steps at each batch size as ``t ≈ a + b · tokens (+ c when the step
verifies drafts) + e · ⌈tokens / 16⌉`` (:mod:`ascent.spec_decode.step_cost`). A plain step of ``B`` requests then
costs ``t(B)`` for ``B`` output tokens, and even drafts that are always accepted and arbitrarily long cannot bring an
output token below the marginal cost of a verified token, ``b + e / 16``. So on decode steps speculation is bounded
by ``ceiling = (t(B) / B) / (b + e / 16)``, and a draft token pays only where its acceptance probability exceeds
``1 / ceiling`` (its break-even acceptance). At batch 1 a step streams the weights (``a ≫ b``: the ceiling is high);
with many requests on few cores a step is compute-bound (``a ≲ b · B``: the ceiling nears 1 and no proposer can help).
Prefill time is not in the bound, so the end-to-end bound is lower still. The bench reports these figures so that a
speed-up (or its absence) at a concurrency can be read against what the machine allows.
"""

from __future__ import annotations

import math
from typing import Any

from ascent.spec_decode.step_cost import ROW_BLOCK


def bench_batch_size(args: Any) -> int:
    """Requests a decode step of a ``bench spec`` run holds at most: its concurrency cap (``--max-concurrency``, else
    ``--max-num-seqs``), at most the prompts of one workload (``--num-prompts``)."""
    cap = getattr(args, "max_concurrency", None) or getattr(args, "max_num_seqs", None) or args.num_prompts
    return min(cap, args.num_prompts)


def runner_spec(llm: Any) -> Any | None:
    """The in-process model runner's speculative-decoding state (None without speculation, or with workers in
    other processes)."""
    try:
        worker = llm.llm_engine.engine_core.worker
    except AttributeError:
        return None
    return getattr(getattr(worker, "model_runner", None), "spec", None)


def speculation_ceiling(llm: Any, num_reqs: int) -> dict[str, Any] | None:
    """The decode-step bound at ``num_reqs`` requests (module docstring) from ``llm``'s fitted step-cost model:
    ``{"batch_size", "step_ms", "per_step_ms", "per_token_ms", "verify_ms", "row_block_ms", "plain_step_ms",
    "decode_ceiling", "break_even_acceptance"}`` (times in ms; ``decode_ceiling`` may be ``inf`` when tokens were
    measured free), or None when the engine has no ready model for that batch size."""
    step_cost = getattr(runner_spec(llm), "step_cost", None)
    if step_cost is None or num_reqs < 1:
        return None
    model = step_cost.for_batch(num_reqs)
    if not model.ready:
        return None
    a, b, c = model.coefficients()
    e = model.row_block_cost()
    plain = model.predict(num_reqs)
    marginal = b + e / ROW_BLOCK
    ceiling = (plain / num_reqs) / marginal if marginal > 0 else math.inf
    return {"batch_size": int(num_reqs), "per_step_ms": 1e3 * a, "per_token_ms": 1e3 * b, "verify_ms": 1e3 * c,
            "row_block_ms": 1e3 * e, "plain_step_ms": 1e3 * plain, "decode_ceiling": ceiling,
            "break_even_acceptance": 1.0 / ceiling if ceiling > 0 else math.inf}


def first_ceiling(engines: dict[str, Any], num_reqs: int) -> tuple[str, dict[str, Any]] | None:
    """``(method, ceiling)`` from the first engine with a ready step-cost model at ``num_reqs`` (the bound is the
    machine's and the model's, not the method's), or None."""
    for name, llm in engines.items():
        ceiling = speculation_ceiling(llm, num_reqs)
        if ceiling is not None:
            return name, ceiling
    return None


def format_ceiling(method: str, c: dict[str, Any]) -> str:
    """One summary line for a :func:`speculation_ceiling` result measured by ``method``'s engine."""
    return (f"  step cost at batch {c['batch_size']} ({method}'s fit): {c['per_step_ms']:.2f} ms + "
            f"{c['per_token_ms']:.2f} ms/token (+{c['verify_ms']:.2f} ms verifying): plain step "
            f"{c['plain_step_ms']:.2f} ms; decode steps can gain at most x{c['decode_ceiling']:.2f} from "
            f"speculation (a draft token pays above acceptance {c['break_even_acceptance']:.2f})")
