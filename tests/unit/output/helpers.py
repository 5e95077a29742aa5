"""Drive an OutputProcessor with synthetic engine-core outputs."""

from __future__ import annotations

from ascent.core.output_processor import OutputProcessor, OutputProcessorResult
from ascent.core.sched_output import EngineCoreOutput
from ascent.outputs import RequestOutput


def chunked(ids: list[int], sizes: list[int] | None) -> list[list[int]]:
    """Split ``ids`` into consecutive chunks of the given sizes (1 when sizes run out)."""
    out, pos, sizes = [], 0, list(sizes or [])
    while pos < len(ids):
        size = max(1, sizes.pop(0)) if sizes else 1
        out.append(ids[pos : pos + size])
        pos += size
    return out


def drive(
    proc: OutputProcessor,
    request_id: str,
    ids: list[int],
    sizes: list[int] | None = None,
    final_reason: str = "length",
    final_stop_reason: int | str | None = None,
) -> tuple[list[RequestOutput], list[OutputProcessorResult]]:
    """Feed ``ids`` as core outputs (the last chunk finishes with ``final_reason``) until the request is gone."""
    outputs, results = [], []
    chunks = chunked(ids, sizes)
    for i, chunk in enumerate(chunks):
        if request_id not in proc.request_states:
            break
        last = i == len(chunks) - 1
        reason, stop_reason = (final_reason, final_stop_reason) if last else (None, None)
        out = EngineCoreOutput(request_id, chunk, finish_reason=reason, stop_reason=stop_reason)
        result = proc.process_outputs([out])
        results.append(result)
        outputs.extend(result.request_outputs)
    return outputs, results
