"""Fan-out of an ``n > 1`` request into ``n`` child requests and aggregation of their outputs (vLLM semantics)."""

from __future__ import annotations

from ascent.outputs import CompletionOutput, RequestOutputKind
from ascent.sampling_params import SamplingParams


class ParentRequest:
    """Tracks the children of one ``n > 1`` request.

    Child ``i`` has id ``f"{i}_{request_id}"`` and a copy of the params with ``n=1`` (and ``seed + i`` when a seed
    is set, so children sample different but reproducible sequences).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = params
        self.n = params.n
        self.child_requests: set[str] = set()
        self._final_outputs: list[CompletionOutput | None] = [None] * self.n
        self._finished_indices: set[int] = set()

    @property
    def output_kind(self) -> int:
        return self.sampling_params.output_kind

    def child_request_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Register child ``index`` and return its request id and sampling params."""
        if not isinstance(index, int) or not 0 <= index < self.n:
            raise ValueError(f"child index {index!r} is out of range for n={self.n}.")
        child_id = self.child_request_id(index)
        self.child_requests.add(child_id)
        return child_id, self._child_params(index)

    def _child_params(self, index: int) -> SamplingParams:
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed = params.seed + index
        return params

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput
    ) -> tuple[str, list[CompletionOutput], bool]:
        """Fold one child's completion into the parent's view.

        Returns ``(parent_id, outputs, finished)``. FINAL_ONLY: ``outputs`` is empty until every child finished,
        then all completions sorted by index. Otherwise: the child's completion as it comes. ``finished`` is True
        once every child finished.
        """
        if completion.finished():
            self.child_requests.discard(child_request_id)
            self._finished_indices.add(completion.index)
        done = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            self._final_outputs[completion.index] = completion
            outputs = [c for c in self._final_outputs if c is not None] if done else []
            return self.request_id, outputs, done
        return self.request_id, [completion], done

    @property
    def finished(self) -> bool:
        """True once all ``n`` children finished."""
        return len(self._finished_indices) == self.n
