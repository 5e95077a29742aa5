"""DraftModelRunner: per-request draft KV blocks are allocated on demand, rolled back, freed, and sized per block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.attention.layer import Attention
from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.draft_runner import DraftEnv, DraftModelRunner


class _OneLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(2, 8, 8 ** -0.5, 1, prefix="draft.attn", backend="sdpa")


def _runner(num_blocks: int = 6) -> DraftModelRunner:
    env = DraftEnv(device=torch.device("cpu"), dtype=torch.float32, block_size=4, max_num_seqs=4, max_model_len=32)
    runner = DraftModelRunner(_OneLayer(), env, max_extra_tokens=3)
    runner.initialize_kv_cache(num_blocks)
    return runner


def test_bytes_per_block_and_cache_shape():
    runner = _runner()
    assert runner.kv_cache_bytes_per_block() == 2 * 4 * 1 * 8 * 4  # K+V, block_size, kv heads, head size, fp32
    assert runner.layers[0].kv_cache.shape[1] == 6


def test_allocate_rollback_free():
    runner = _runner()
    runner.reset("a", 0)
    assert runner.ensure_slots("a", 9) and runner.num_free_blocks == 5 - 3
    runner.set_computed("a", 9)
    runner.set_computed("a", 6)  # rollback: rejected drafts
    assert runner.num_computed("a") == 6 and runner.num_free_blocks == 2
    assert not runner.ensure_slots("a", 21)  # needs 3 more blocks, only 2 free: nothing allocated
    assert runner.num_free_blocks == 2
    runner.remove("a")
    assert runner.num_free_blocks == 5 and runner.num_computed("a") is None
    runner.remove("a")  # unknown: no-op


def test_metadata_uses_local_positions_after_a_late_start():
    runner = _runner()
    runner.reset("b", 8)  # the draft never saw positions 0..7
    assert runner.ensure_slots("b", 12)
    md = runner.metadata(["b"], np.array([8]), np.array([3]))
    assert md.num_actual_tokens == 3
    block = runner.requests["b"].blocks[0].block_id
    assert md.write_slots.tolist() == [block * 4, block * 4 + 1, block * 4 + 2]


def test_draft_num_layers_config():
    cfg = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, draft_num_layers=1)
    assert cfg.model is None
    with pytest.raises(ValueError, match="draft_num_layers"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, model="x", draft_num_layers=1)
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
