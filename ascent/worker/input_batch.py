"""Persistent input batch: one row per running request, kept across steps.

Rows ``0..num_reqs-1`` are always dense: removing a request moves the last row into the hole (``condense``), so the
block table and the numpy token buffer can be sliced without gathers. Token ids live in a host numpy buffer
``token_ids [max_num_reqs, max_model_len]``; ``num_tokens[row]`` of them are known (prompt + sampled so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ascent.core.sched_output import NewRequestData
from ascent.sampling_params import SamplingParams
from ascent.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int
    prompt_logprobs_done: int = 0  # prompt positions whose logprobs were already emitted
    lora_name: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device, vocab_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_reqs, max_blocks, block_size, device)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.states: dict[str, CachedRequestState] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, new: NewRequestData, generator: torch.Generator | None) -> None:
        if new.req_id in self.req_id_to_index:
            self.remove_request(new.req_id)
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows)")
        row = self.num_reqs
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            generator=generator,
            num_computed_tokens=new.num_computed_tokens,
            lora_name=new.lora_name,
        )
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table.add_row(new.block_ids, row)
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        self.states[new.req_id] = state

    def update_request(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        row = self.req_id_to_index[req_id]
        self.num_computed_tokens[row] = num_computed_tokens
        self.states[req_id].num_computed_tokens = num_computed_tokens
        if new_block_ids:
            self.block_table.append_row(new_block_ids, row)

    def append_token(self, row: int, token: int) -> None:
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token
            self.num_tokens[row] = n + 1
        self.states[self.req_ids[row]].output_token_ids.append(token)

    def remove_request(self, req_id: str) -> None:
        """Drop a request and move the last row into its place (rows stay dense)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        del self.states[req_id]
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_index[moved] = row
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            self.block_table.move_row(last, row)
        self.block_table.clear_row(last)
        self.req_ids.pop()
        self.num_tokens[last] = 0


def write_drafts(batch: InputBatch, spec_tokens: dict[str, list[int]]) -> None:
    """Place this step's draft tokens right after each request's committed tokens (inputs, not outputs: ``num_tokens``
    is unchanged, so accepted tokens later overwrite them in place)."""
    for req_id, drafts in spec_tokens.items():
        row = batch.req_id_to_index[req_id]
        n = int(batch.num_tokens[row])
        batch.token_ids[row, n : n + len(drafts)] = drafts
