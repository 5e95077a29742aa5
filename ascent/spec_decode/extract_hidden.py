"""``method: "extract_hidden_states"`` (vLLM's hidden-state extraction for training EAGLE-style heads).

Not speculation: it drafts nothing (vLLM returns the sampled token as a always-accepted draft; here the step is plain
decoding), ``num_speculative_tokens`` must be 1, and ``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``
names the target layers to capture (id ``i`` = the residual stream entering layer ``i``, i.e. transformers'
``output_hidden_states[i]`` for ``i < L``; ``i = L`` = the last layer's output before the final norm).

Where the result is: for every request, the hidden states of every token the target consumed (prompt + generated
tokens except the last sampled one, which is never fed back), ``hidden_states [num_tokens, num_layers, H]`` (CPU,
model dtype, ids in the configured order) with ``token_ids [num_tokens]``, kept in the engine's worker after the
request finishes until read with :func:`get_hidden_states` (``llm``, ``RequestOutput.request_id``; in-process
engines, world size 1). Rows of positions the target never computed (prefix-cache hits) are NaN, so disable prefix
caching to get every row. vLLM writes the same two tensors to ``<shared_storage_path>/<request>.safetensors``
through its ``ExampleHiddenStatesConnector``; :meth:`ExtractHiddenStatesProposer.save` writes that file format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ascent.spec_decode.base import SpeculativeConfig, pad_drafts
from ascent.spec_decode.eagle import check_aux_layers
from ascent.spec_decode.model_proposer import ModelProposer, TargetStep
from ascent.spec_decode.registry import register_proposer


@register_proposer("extract_hidden_states")
class ExtractHiddenStatesProposer(ModelProposer):
    """Captures the configured layers' hidden states per request; proposes no drafts."""

    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self._tokens: dict[str, list[int]] = {}
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def load_model(self, target_model: nn.Module | None) -> None:
        assert target_model is not None
        ids = self.config.aux_hidden_state_layer_ids() or []
        self.capture_layers = check_aux_layers(ids, int(target_model.config.num_hidden_layers))

    def add_request(self, req_id: str, prompt_token_ids: list[int]) -> None:
        self._tokens[req_id] = list(prompt_token_ids)

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        self._tokens.setdefault(req_id, []).extend(new_token_ids)

    def observe(self, step: TargetStep) -> None:
        assert step.aux_hidden_states is not None, "the target did not capture its aux hidden states"
        stacked = torch.stack(step.aux_hidden_states, dim=1).cpu()
        for i, req_id in enumerate(step.req_ids):
            if step.num_valid[i]:
                self._chunks.setdefault(req_id, []).append((int(step.first_positions[i]), stacked[step.rows(i)]))

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        self._check_batch(req_ids, token_ids, max_num_tokens)
        return pad_drafts([[] for _ in req_ids], self.k)

    def hidden_states(self, req_id: str, pop: bool = False) -> dict[str, torch.Tensor] | None:
        """``{"token_ids": int64 [P], "hidden_states": [P, num_layers, H]}`` for the ``P`` positions the target
        consumed so far (None for an unknown request); ``pop`` forgets the request afterwards."""
        chunks = self._chunks.get(req_id)
        if not chunks:
            return None
        end = max(first + t.shape[0] for first, t in chunks)
        out = torch.full((end, *chunks[0][1].shape[1:]), float("nan"), dtype=chunks[0][1].dtype)
        for first, t in chunks:
            out[first: first + t.shape[0]] = t
        tokens = torch.tensor(self._tokens.get(req_id, [])[:end], dtype=torch.int64)
        if pop:
            self._chunks.pop(req_id, None)
            self._tokens.pop(req_id, None)
        return {"token_ids": tokens, "hidden_states": out}

    def save(self, req_id: str, directory: str) -> Path:
        """Write ``<directory>/<req_id>.safetensors`` with ``token_ids`` and ``hidden_states`` (vLLM's file)."""
        from safetensors.torch import save_file

        data = self.hidden_states(req_id)
        if data is None:
            raise ValueError(f"request_id={req_id!r} has no captured hidden states")
        path = Path(directory) / f"{req_id}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in data.items()}, str(path))
        return path


def get_hidden_states(llm: Any, request_id: str, pop: bool = True) -> dict[str, torch.Tensor]:
    """The captured hidden states of ``request_id`` from an in-process ``LLM`` (see the module docstring)."""
    proposer = llm.llm_engine.engine_core.worker.model_runner.spec.proposer
    if not isinstance(proposer, ExtractHiddenStatesProposer):
        raise ValueError("the engine was not started with speculative method 'extract_hidden_states'")
    data = proposer.hidden_states(request_id, pop=pop)
    if data is None:
        raise ValueError(f"request_id={request_id!r} has no captured hidden states")
    return data
