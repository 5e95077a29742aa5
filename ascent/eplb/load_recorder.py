"""Per-step expert load of every MoE layer, kept in a window and summed over the EP group.

Each step, every layer's ``last_expert_tokens`` (rows executed per *local* slot in the last forward, specs §1.4) is
folded into *logical* expert ids with the layer's current placement, so the window stays meaningful across
rebalances. The ring always advances by one row per step on every rank (a step without MoE work records zeros), which
keeps the rows of all ranks aligned for the all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ascent.distributed.parallel_state import GroupCoordinator
from ascent.layers.fused_moe.layer import FusedMoE


class LoadRecorder:
    """Ring window ``[window_size, L, E]`` (int64) of this rank's logical expert load per step."""

    def __init__(self, layers: Sequence[FusedMoE], window_size: int) -> None:
        if not layers:
            raise ValueError("LoadRecorder needs at least one MoE layer, got none")
        if window_size < 1:
            raise ValueError(f"window_size={window_size} must be >= 1")
        experts = {layer.expert_map.num_logical for layer in layers}
        if len(experts) != 1:
            raise ValueError(f"MoE layers disagree on the number of logical experts: {sorted(experts)}")
        self.layers = list(layers)
        self.num_logical = experts.pop()
        self.window = torch.zeros(window_size, len(self.layers), self.num_logical, dtype=torch.int64)
        self.steps = 0

    @property
    def window_size(self) -> int:
        return self.window.shape[0]

    @property
    def filled(self) -> int:
        """Rows holding recorded steps (<= window_size)."""
        return min(self.steps, self.window_size)

    def _layer_load(self, layer: FusedMoE) -> torch.Tensor:
        load = torch.zeros(self.num_logical, dtype=torch.int64)
        counts = layer.last_expert_tokens
        if counts is None:
            return load
        counts = counts.detach().to("cpu", torch.int64).flatten()
        if counts.numel() != layer.expert_map.num_local:
            raise ValueError(f"{layer.prefix or 'MoE layer'}: last_expert_tokens has {counts.numel()} entries, "
                             f"expected one per local slot ({layer.expert_map.num_local})")
        layer.last_expert_tokens = None
        return load.index_add_(0, layer.expert_map.local_physical_to_logical(), counts)

    def record(self) -> torch.Tensor:
        """Fold the layers' last-forward counts into the next window row (and consume them); returns that row
        ``[L, E]``."""
        row = torch.stack([self._layer_load(layer) for layer in self.layers])
        self.window[self.steps % self.window_size] = row
        self.steps += 1
        return row

    def local_window(self) -> torch.Tensor:
        """This rank's recorded rows in chronological order, ``[filled, L, E]``."""
        n, w = self.filled, self.window_size
        if self.steps <= w:
            return self.window[:n].clone()
        start = self.steps % w
        return torch.cat([self.window[start:], self.window[:start]]).clone()

    def global_window(self, ep_group: GroupCoordinator) -> torch.Tensor:
        """The window summed over the EP group (a collective: every EP rank must call it in the same step)."""
        return ep_group.all_reduce(self.local_window())

    def clear(self) -> None:
        self.window.zero_()
        self.steps = 0
