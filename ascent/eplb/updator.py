"""EplbUpdator: the per-step EPLB state machine of one rank (specs §3.2, portable form).

``after_forward()`` runs after every model step on every EP rank:

* record this step's expert load (``LoadRecorder``);
* every ``step_interval`` steps (*begin*): sum the load window over the EP group; EP rank 0 sends the current
  placement ``[L, R, S]`` and the load ``[W, L, E]`` to the policy process, which plans in the background;
* ``plan_delay_steps`` later (*finish*): rank 0 waits (bounded) for the plan, validates it per layer (an invalid layer
  keeps its placement), and broadcasts the decision over the EP group so that every rank takes the same one; every
  rank then moves the changed layers (``transfer.exchange_layer``: batched P2P + map switch). All of it happens
  between two forwards, so the next step sees all layers on the new placement.

If the policy process dies, rank 0 logs an error; the next decision broadcast carries "disabled" and every rank stops
rebalancing while serving continues. A plan that fails or times out only skips that cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascent.distributed.parallel_state import GroupCoordinator
from ascent.eplb.config import EplbConfig
from ascent.eplb.load_recorder import LoadRecorder
from ascent.eplb.stats import EplbMetrics, RebalanceStats, hotness, imbalance, rank_loads
from ascent.eplb.transfer import exchange_layer
from ascent.eplb.worker import PlanResult, PolicyWorker, PolicyWorkerDied
from ascent.layers.fused_moe.expert_map import ExpertMap
from ascent.layers.fused_moe.layer import FusedMoE

logger = logging.getLogger(__name__)
WorkerFactory = Callable[[str], PolicyWorker]


def find_moe_layers(model: nn.Module) -> list[FusedMoE]:
    """The model's FusedMoE layers in module order."""
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


class EplbUpdator:
    """Dynamic EPLB for one rank. ``worker_factory`` builds the policy process on EP rank 0 (tests inject fakes)."""

    def __init__(self, config: EplbConfig, model: nn.Module, ep_group: GroupCoordinator,
                 worker_factory: WorkerFactory = PolicyWorker) -> None:
        self.config, self.ep_group = config, ep_group
        self.layers = find_moe_layers(model)
        if not self.layers:
            raise ValueError("EPLB is enabled but the model has no FusedMoE layer")
        self._check_layers()
        self.recorder = LoadRecorder(self.layers, config.window_size)
        self.step = 0
        self.metrics = EplbMetrics(enabled=config.enable)
        self._begun_at: int | None = None
        self._cycle_load: torch.Tensor | None = None
        self._dead: str | None = None
        self.worker: PolicyWorker | None = None
        if config.enable and self.is_leader:
            self.worker = worker_factory(config.policy)

    def _check_layers(self) -> None:
        maps = [layer.expert_map for layer in self.layers]
        shapes = {(m.num_logical, m.num_physical, m.ep_size) for m in maps}
        if len(shapes) != 1:
            raise ValueError(f"MoE layers have different (logical, physical, ep) expert layouts: {sorted(shapes)}")
        if maps[0].ep_size != self.ep_group.world_size:
            raise ValueError(f"expert maps span ep_size={maps[0].ep_size}, EP group has {self.ep_group.world_size}")
        if maps[0].num_redundant != self.config.num_redundant_experts:
            raise ValueError(f"eplb num_redundant_experts={self.config.num_redundant_experts} but the MoE layers "
                             f"were built with {maps[0].num_redundant} redundant experts")

    @property
    def is_leader(self) -> bool:
        return self.ep_group.rank_in_group == 0

    @property
    def enabled(self) -> bool:
        return self.metrics.enabled

    def placement(self) -> torch.Tensor:
        """Current placement, int64 ``[L, R, S]`` of logical ids."""
        maps = [layer.expert_map for layer in self.layers]
        return torch.stack([m.physical_to_logical.view(m.ep_size, m.num_local) for m in maps])

    # ------------------------------------------------------------------------------------------------ per step
    def after_forward(self) -> None:
        """Call after every model step, on every EP rank (collectives happen at the cycle's begin and finish)."""
        if not self.enabled:
            return
        self.recorder.record()
        self.step += 1
        self.metrics.steps = self.step
        self._watch_worker()
        if self.step % self.config.step_interval == 0:
            self._begin_cycle()
        if self._begun_at is not None and self.step >= self._begun_at + self.config.plan_delay_steps:
            self._finish_cycle()

    def _watch_worker(self) -> None:
        if self.worker is not None and self._dead is None and not self.worker.is_alive():
            self._worker_died(PolicyWorkerDied(f"EPLB policy process pid={self.worker.pid} died (exitcode="
                                               f"{self.worker.process.exitcode})"))

    def _worker_died(self, exc: PolicyWorkerDied) -> None:
        self._dead = str(exc)
        logger.error("%s; dynamic expert rebalancing will be disabled, serving continues", exc)

    def _begin_cycle(self) -> None:
        load = self.recorder.global_window(self.ep_group).float()
        placement = self.placement()
        self._cycle_load, self._begun_at = load, self.step
        self.metrics.observe_load(load.sum(0), placement)
        if self.config.log_balancedness and self.is_leader:
            logger.info("EPLB step %d: per-layer imbalance (max/mean per rank) %s, hotness %s", self.step,
                        [round(v, 3) for v in self.metrics.imbalance], [round(v, 3) for v in self.metrics.hotness])
        if self.worker is not None and self._dead is None:
            try:
                self.worker.submit(placement, load)
            except PolicyWorkerDied as exc:
                self._worker_died(exc)

    def _finish_cycle(self) -> None:
        start = time.perf_counter()
        decision = self._leader_decision() if self.is_leader else None
        decision = self.ep_group.broadcast_object(decision, 0)
        self._begun_at = None
        if decision["disable"] is not None:
            self._disable(decision["disable"])
            return
        if decision["placement"] is None:
            return
        stats = self._apply(decision["placement"], decision["plan_s"])
        stats.stall_s = time.perf_counter() - start
        self.metrics.add(stats)
        if self.is_leader:
            logger.info(stats.log_line())

    # ------------------------------------------------------------------------------------------------ decision
    def _leader_decision(self) -> dict[str, Any]:
        decision: dict[str, Any] = {"disable": None, "placement": None, "plan_s": 0.0}
        if self.worker is not None and self._dead is None:
            try:
                result = self.worker.result(self.config.plan_timeout_s)
            except PolicyWorkerDied as exc:
                self._worker_died(exc)
            else:
                decision["placement"], decision["plan_s"] = self._accept(result)
        if self._dead is not None:
            decision["disable"] = self._dead
        return decision

    def _accept(self, result: PlanResult | None) -> tuple[torch.Tensor | None, float]:
        if result is None:
            self.metrics.plans_failed += 1
            logger.warning("EPLB plan not ready within %.1fs at step %d; skipping this rebalance",
                           self.config.plan_timeout_s, self.step)
            return None, 0.0
        if result.error is not None or result.new_placement is None:
            self.metrics.plans_failed += 1
            logger.error("EPLB policy failed at step %d; skipping this rebalance:\n%s", self.step, result.error)
            return None, result.compute_s
        if not result.changed:
            return None, result.compute_s
        return self._validated(result.new_placement), result.compute_s

    def _validated(self, new: torch.Tensor) -> torch.Tensor | None:
        old = self.placement()
        if tuple(new.shape) != tuple(old.shape):
            self.metrics.plans_failed += 1
            logger.error("EPLB plan shape %s != placement shape %s; skipping", tuple(new.shape), tuple(old.shape))
            return None
        out = new.clone()
        em = self.layers[0].expert_map
        for layer in range(out.shape[0]):
            try:
                ExpertMap(em.num_logical, em.ep_size, 0, physical_to_logical=out[layer].flatten())
            except ValueError as exc:
                logger.error("EPLB plan for MoE layer %d rejected (keeping its placement): %s", layer, exc)
                out[layer] = old[layer]
        return None if torch.equal(out, old) else out

    # ------------------------------------------------------------------------------------------------ apply
    def _apply(self, new: torch.Tensor, plan_s: float) -> RebalanceStats:
        old = self.placement()
        stats = RebalanceStats(step=self.step, plan_s=plan_s)
        for index, layer in enumerate(self.layers):
            if torch.equal(new[index], old[index]):
                continue
            result = exchange_layer(layer, new[index].flatten(), self.ep_group)
            expert_bytes = sum(w.numel() * w.element_size() for w in layer.expert_weights(0))
            stats.changed_layers += 1
            stats.moves += int((new[index] != old[index]).sum())
            stats.p2p_transfers += len(result.transfers)
            stats.bytes_moved += len(result.transfers) * expert_bytes
        if self._cycle_load is not None:
            load = self._cycle_load.sum(0)
            stats.imbalance_before = imbalance(rank_loads(load, old)).tolist()
            stats.imbalance_after = imbalance(rank_loads(load, new)).tolist()
            ratio, stats.hottest = hotness(load)
            stats.hotness = ratio.tolist()
        return stats

    def _disable(self, reason: str) -> None:
        self.metrics.disable(reason)
        logger.error("EPLB disabled on EP rank %d: %s", self.ep_group.rank_in_group, reason)
        self.shutdown()

    def stats(self) -> dict[str, Any]:
        """Metrics of this rank (for logs and /metrics), plus the policy process pid on EP rank 0."""
        out = self.metrics.as_dict()
        out["policy_pid"] = self.worker.pid if self.worker is not None else None
        out["placement"] = self.placement().tolist()
        return out

    def summary(self, since_version: int = -1, since_rebalances: int = 0) -> dict[str, Any] | None:
        """Compact metrics for the engine (:meth:`EplbMetrics.summary`); None when unchanged."""
        return self.metrics.summary(since_version, since_rebalances)

    def shutdown(self) -> None:
        """Stop the policy process (idempotent)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
