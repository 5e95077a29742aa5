"""Speculative decoding inside the model runner: proposer lifecycle, draft placement, verification, proposals.

Per step, for a request with ``k`` scheduled drafts the scheduler scheduled ``num_tokens + k - num_computed`` tokens;
the drafts are written into the persistent token buffer right after the committed tokens (not committed), the model
scores all positions, and the ``k + 1`` last positions' logits go to the rejection sampler, which returns the accepted
drafts plus one recovered/bonus token. Those are committed; the scheduler rolls ``num_computed_tokens`` back by the
rejected count (the rejected drafts' KV slots are simply overwritten later). After sampling, model-based proposers
receive the step's valid target hidden states (:class:`TargetStep`), then the proposer drafts the next ``k`` tokens
from every request's committed tokens.

With ``dynamic: true`` a :class:`DynamicSpecScheduler` picks each request's draft length in ``[min_verify_tokens,
k]`` from per-request, per-position acceptance statistics of earlier verifications (:class:`AcceptanceStats`),
then :class:`DraftGate` cuts drafts below ``min_draft_survival`` (a request can drop to 0 drafts; it is re-probed
every ``probe_interval`` steps). Per step, the number of running requests can cap every draft length
(``num_speculative_tokens_per_batch_size``) or switch speculation off (``speculative_disable_by_batch_size``); a step
without drafts skips the proposer's drafting entirely (it still learns the committed tokens).

Step timing (cost-aware gate ``dynamic_params.cost_gate``, goodput arbiter ``goodput_arbiter``): the model runner wraps
every step in :meth:`SpecDecodeRunner.timed_step`; a decode-only step (every request computes 1 token plus its drafts)
yields one sample ``(tokens, seconds, carried drafts)`` for the step-cost model of its batch size
(:class:`BatchStepCost`) and one ``(requests, output tokens, seconds, speculated)`` for the :class:`GoodputArbiter`,
where ``seconds`` runs from its start to the next step's start (so scheduler, proposer and output processing count), or
is its own execution time when the engine idled in between. With the arbiter on, it decides at each proposal whether the
next step speculates, except at batch sizes whose step-cost model (once ready) shows a plain step spending under
``ARBITER_MIN_TOKEN_SHARE`` of its time on its tokens ``b B / (a + b B)``: there (batch 1-2 on 2 cores) a draft costs
little next to the weight stream, speculation that the gate lets through rarely loses, and the arbiter's plain windows
only cost. Measured on the bench workloads at batch 1 (SmolLM2, 2 cores, AVX2, one process, 3 rounds): with the
arbiter a third of the steps had run plain; without it the same tokens took 4 % fewer steps, at 1.64x / 1.21x
(repetitive / non-repetitive) against no speculation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from ascent.spec_decode.arbiter import GoodputArbiter
from ascent.spec_decode.base import Proposer, SpeculativeConfig
from ascent.spec_decode.calibration import DraftCalibration, DraftEvidence
from ascent.spec_decode.draft_runner import DraftEnv
from ascent.spec_decode.dynamic import (AcceptanceStats, DraftGate, DynamicSpecParams, DynamicSpecScheduler,
                                        batch_size_k)
from ascent.spec_decode.model_proposer import ModelProposer, TargetStep
from ascent.spec_decode.registry import get_proposer_cls
from ascent.spec_decode.step_cost import BatchStepCost, StepCostModel
from ascent.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from ascent.config import EngineConfig
    from ascent.core.sched_output import SchedulerOutput

# a step-to-step period above this multiple of the step's own execution time means the engine idled in between
IDLE_GAP_FACTOR = 3.0
# the arbiter decides only batch sizes whose plain step spends at least this share of its time on its tokens
ARBITER_MIN_TOKEN_SHARE = 1.0 / 3.0


@dataclass
class StepRecord:
    """One decode-only step as timed for the step-cost model and the arbiter (``num_reqs == 0``: not timed)."""

    num_reqs: int = 0
    tokens: int = 0  # scheduled tokens (1 + drafts per request)
    start: float = 0.0
    busy: float = 0.0  # execution seconds
    verify: bool = False  # carried drafts
    speculated: bool | None = None  # the arbiter's mode for this step (None: not decided by the arbiter)
    output_tokens: int = 0  # committed tokens (set by the caller)


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, rng_placement: str,
                 generator: torch.Generator | None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer: Proposer = get_proposer_cls(config.method)(config, max_model_len)
        self.rejection_sampler = RejectionSampler(method=config.rejection_sample_method, rng_placement=rng_placement,
                                                  generator=generator)
        self._known: set[str] = set()
        self.dynamic: DynamicSpecScheduler | None = None
        self.acceptance: AcceptanceStats | None = None
        self.gate: DraftGate | None = None
        self.step_cost: StepCostModel | BatchStepCost | None = None
        self.arbiter: GoodputArbiter | None = None
        self.calibration: DraftCalibration | None = None
        if config.dynamic:
            params = DynamicSpecParams.from_dict(config.dynamic_params)
            self.dynamic = DynamicSpecScheduler(self.k, params)
            self.acceptance = AcceptanceStats(self.k)
            self.step_cost = params.step_cost_model()
            self.arbiter = params.arbiter()
            self.calibration = DraftCalibration() if params.calibrate_drafts else None
            self.gate = DraftGate(params.min_draft_survival, params.probe_interval, self.step_cost,
                                  params.cost_safety_factor)
        self.clock: Callable[[], float] = time.perf_counter  # injectable (tests)
        self._step_done: StepRecord | None = None  # the previous decode-only step, closed by the next one's start
        self._next_mode: tuple[int, bool] | None = None  # (num_reqs, speculate) the arbiter chose for the next step
        self.last_draft_lengths: dict[str, int] = {}  # per request, the drafts of the latest proposal (after gating)

    def load_model(self, target_model: torch.nn.Module, engine_config: EngineConfig | None = None) -> None:
        if isinstance(self.proposer, ModelProposer):
            if engine_config is None:
                raise ValueError(f"speculative method {self.config.method!r} needs the engine config to load")
            self.proposer.bind(_draft_env(engine_config))
        self.proposer.load_model(target_model)
        if isinstance(self.proposer, ModelProposer) and self.proposer.capture_layers:
            target_model.model.capture_layers = tuple(self.proposer.capture_layers)

    # ------------------------------------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        """The drafter's KV bytes per block (0 for drafters without their own attention layers)."""
        return self.proposer.kv_cache_bytes_per_block() if isinstance(self.proposer, ModelProposer) else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if isinstance(self.proposer, ModelProposer):
            self.proposer.initialize_kv_cache(num_blocks)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def add_request(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        if req_id in self._known:
            self.proposer.remove_request(req_id)
        self.proposer.add_request(req_id, list(prompt_token_ids))
        if output_token_ids:
            self.proposer.update_request(req_id, list(output_token_ids))
        self._known.add(req_id)

    def remove_request(self, req_id: str) -> None:
        if req_id in self._known:
            self._known.discard(req_id)
            self.proposer.remove_request(req_id)
            self.last_draft_lengths.pop(req_id, None)
            if self.acceptance is not None:
                self.acceptance.remove(req_id)
            if self.gate is not None:
                self.gate.remove(req_id)
            if self.calibration is not None:
                self.calibration.remove(req_id)

    # ------------------------------------------------------------------------------------------------ timing
    @contextmanager
    def timed_step(self, so: SchedulerOutput) -> Iterator[StepRecord]:
        """Wrap one model-runner step: feeds the step-cost model and the goodput arbiter (module docstring); the
        caller sets the yielded record's ``output_tokens``. A no-op without either."""
        if self.step_cost is None and self.arbiter is None:
            yield StepRecord()
            return
        now = self.clock()
        if self._step_done is not None:
            self._observe(self._step_done, now)
            self._step_done = None
        num_reqs = len(so.num_scheduled_tokens)
        num_drafts = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        mode, self._next_mode = self._next_mode, None
        if num_reqs == 0 or so.total_num_scheduled_tokens != num_reqs + num_drafts:  # not decode-only: not timed
            yield StepRecord()
            return
        record = StepRecord(num_reqs=num_reqs, tokens=so.total_num_scheduled_tokens, start=now,
                            verify=num_drafts > 0,
                            speculated=mode[1] if mode is not None and mode[0] == num_reqs else None)
        yield record
        record.busy = self.clock() - now
        self._step_done = record

    def _observe(self, step: StepRecord, now: float) -> None:
        period = now - step.start
        seconds = period if period <= IDLE_GAP_FACTOR * step.busy else step.busy
        if self.step_cost is not None:
            self.step_cost.for_batch(step.num_reqs).observe(step.tokens, seconds, step.verify)
        if self.arbiter is not None and step.speculated is not None:
            self.arbiter.observe(step.num_reqs, step.output_tokens, seconds, step.speculated)

    # ------------------------------------------------------------------------------------------------ drafts
    def verify(self, drafts: list[list[int]], target_logits: torch.Tensor, metadata: SamplingMetadata,
               min_tokens: list[int], req_ids: list[str] | None = None) -> list[list[int]]:
        """``target_logits`` fp32 ``[sum(k_i + 1), V]`` -> accepted drafts + one recovered/bonus token per request.
        ``min_tokens`` per request lets each draft position mask stop tokens exactly as plain sampling would;
        ``req_ids`` (batch order) lets a probabilistic drafter pass its draft distributions."""
        spec = SpecDecodeMetadata(draft_token_ids=drafts, min_tokens=min_tokens)
        draft_probs = self._draft_probs(drafts, req_ids, target_logits)
        accepted = self.rejection_sampler(spec, draft_probs, target_logits, metadata,
                                          deterministic_proposer=self.proposer.deterministic)
        if self.acceptance is not None and req_ids is not None:
            verified = [(r, len(d), len(a) - 1) for r, d, a in zip(req_ids, drafts, accepted) if d]
            if verified:
                ids, num_drafts, num_accepted = zip(*verified)
                self.acceptance.record_batch(ids, num_drafts, num_accepted)
                if self.calibration is not None:
                    self.calibration.record(ids, num_drafts, num_accepted)
        return accepted

    def _draft_probs(self, drafts: list[list[int]], req_ids: list[str] | None,
                     target_logits: torch.Tensor) -> torch.Tensor | None:
        if self.proposer.deterministic or not isinstance(self.proposer, ModelProposer):
            return None
        if req_ids is None:
            raise ValueError("a probabilistic drafter needs req_ids at verification")
        rows = []
        for req_id, d in zip(req_ids, drafts):
            if not d:
                continue
            probs = self.proposer.draft_probs(req_id, len(d))
            if probs is None:
                raise ValueError(f"no draft probabilities for the {len(d)} drafts of request {req_id!r}")
            rows.append(probs)
        vocab = target_logits.shape[1]
        if not rows:
            return target_logits.new_zeros((0, vocab), dtype=torch.float32)
        return torch.cat(rows).to(target_logits.device, torch.float32)

    def observe(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray, query_start_loc: np.ndarray,
                positions: np.ndarray, hidden: torch.Tensor, target_model: torch.nn.Module) -> None:
        """Hand the proposer this step's valid target rows (see :class:`TargetStep`); call after sampling."""
        if not (isinstance(self.proposer, ModelProposer) and self.proposer.needs_hidden_states):
            return
        first = positions[query_start_loc[:-1]].astype(np.int64)
        num_sched = np.diff(query_start_loc).astype(np.int64)
        num_valid = np.clip(batch.num_tokens[rows].astype(np.int64) - 1 - first, 0, num_sched)
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(query_start_loc[:-1], num_valid)])
        index_t = torch.from_numpy(index.astype(np.int64)).to(hidden.device)
        aux = getattr(getattr(target_model, "model", None), "aux_hidden_states", None)
        step = TargetStep(req_ids=list(req_ids), first_positions=first, num_valid=num_valid,
                          hidden_states=hidden.index_select(0, index_t),
                          aux_hidden_states=[a.index_select(0, index_t) for a in aux] if aux else None)
        self.proposer.observe(step)

    def step_k(self, num_running: int) -> int:
        """Draft-length cap for a step with ``num_running`` requests in the batch (0: no speculation)."""
        limit = self.config.speculative_disable_by_batch_size
        if limit is not None and num_running >= limit:
            return 0
        schedule = self.config.num_speculative_tokens_per_batch_size
        return self.k if schedule is None else batch_size_k(schedule, num_running, self.k)

    def propose(self, batch: InputBatch, req_ids: list[str], new_tokens: list[list[int]]) -> dict[str, list[int]]:
        """Teach the proposer the committed tokens, then draft up to ``k`` tokens per request (never past
        ``max_model_len``; fewer under ``dynamic`` or a batch-size rule)."""
        self.proposer.update_requests(req_ids, new_tokens)
        cap = self.step_k(int(batch.num_reqs))
        if cap > 0 and req_ids and self.arbiter is not None and self._arbitrated(len(req_ids)):
            speculate = self.arbiter.speculate(len(req_ids))
            self._next_mode = (len(req_ids), speculate)
            cap = cap if speculate else 0
        if cap == 0 or not req_ids:
            self.last_draft_lengths.update((r, 0) for r in req_ids)
            return {}
        drafts = self._draft_then_gate(batch, req_ids, cap) if self._gates_drafted() \
            else self._plan_then_draft(batch, req_ids, cap)
        self.last_draft_lengths.update(zip(req_ids, (len(d) for d in drafts)))
        return {req_id: d for req_id, d in zip(req_ids, drafts) if d}

    def _arbitrated(self, num_reqs: int) -> bool:
        """Whether the goodput arbiter decides the mode of a step of ``num_reqs`` requests: not where the step-cost
        model (ready) shows the plain step dominated by its weight stream, a token's share ``b B / (a + b B)`` under
        ``ARBITER_MIN_TOKEN_SHARE`` (module docstring)."""
        if self.step_cost is None:
            return True
        model = self.step_cost.for_batch(num_reqs)
        if not model.ready:
            return True
        a, b, _ = model.coefficients()
        plain = a + b * num_reqs
        return plain <= 0 or b * num_reqs / plain >= ARBITER_MIN_TOKEN_SHARE

    def _plan_then_draft(self, batch: InputBatch, req_ids: list[str], cap: int) -> list[list[int]]:
        """Draft lengths planned first (the scheduler's shared budget, then the gate), then drafting."""
        token_ids, budget = self._contexts(batch, req_ids, cap)
        if self.dynamic is not None and self.acceptance is not None:
            probs = self.acceptance.token_probs(req_ids)
            keep = self.dynamic.update(probs)
            if self.gate is not None:
                keep = self.gate.apply(req_ids, probs, keep)
            budget = [min(b, n) for b, n in zip(budget, keep.tolist())]
        if not any(budget):  # (model drafters catch up on the skipped positions at their next proposal)
            return [[] for _ in req_ids]
        if isinstance(self.proposer, ModelProposer):
            self.proposer.set_sampling(*_sampling_of(batch, req_ids))
        return _valid_drafts(self.proposer.propose(req_ids, token_ids, budget), budget)

    def _draft_then_gate(self, batch: InputBatch, req_ids: list[str], cap: int) -> list[list[int]]:
        """Draft first at full length (only the requests :meth:`DraftGate.drafting_mask` lets through), then let the
        gate cut the drafts that exist; its bookkeeping (idle requests, probes) advances every step."""
        assert self.gate is not None and self.acceptance is not None
        probs = self.acceptance.token_probs(req_ids)
        mask = self.gate.drafting_mask(probs)
        drafts: list[list[int]] = [[] for _ in req_ids]
        evidence: list[DraftEvidence | None] = [None] * len(req_ids)
        chosen = np.flatnonzero(mask).tolist()
        if chosen:
            ids = req_ids if len(chosen) == len(req_ids) else [req_ids[i] for i in chosen]
            token_ids, budget = self._contexts(batch, ids, cap)
            if any(budget):
                for i, d in zip(chosen, _valid_drafts(self.proposer.propose(ids, token_ids, budget), budget)):
                    drafts[i] = d
                for i, ev in zip(chosen, self.proposer.draft_evidence() or ()):
                    evidence[i] = ev if drafts[i] else None
        lengths = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        if self.calibration is not None and any(ev is not None for ev in evidence):
            probs = self.calibration.estimate(evidence, probs)
        keep = self.gate.apply(req_ids, probs, lengths, drafted=True, skipped=~mask).tolist()
        if self.calibration is not None:
            for req_id, ev, n in zip(req_ids, evidence, keep):
                self.calibration.remember(req_id, ev, n)
        return [d[:n] if n < len(d) else d for d, n in zip(drafts, keep)]

    def _contexts(self, batch: InputBatch, req_ids: list[str], cap: int) -> tuple[list[np.ndarray], list[int]]:
        """Per request: its tokens so far (a view of the persistent batch) and its draft budget (``cap``, never past
        ``max_model_len``)."""
        token_ids = []
        for req_id in req_ids:
            row = batch.req_id_to_index[req_id]
            token_ids.append(batch.token_ids[row, : int(batch.num_tokens[row])])
        limit = self.max_model_len - 1
        return token_ids, [max(0, min(cap, limit - len(t))) for t in token_ids]

    def _gates_drafted(self) -> bool:
        """Draft first, then gate: a model-free proposer (drafting costs next to nothing) under the cost gate. The
        gate then cuts the drafts that exist, by their estimated survival, instead of a budget of positions planned
        before drafting (most of which a suffix or n-gram proposer leaves empty: no match), and the scheduler's
        shared budget does not apply (the measured cost decides). Requests whose first draft could not pay are not
        drafted at all (:meth:`DraftGate.drafting_mask`)."""
        return (self.gate is not None and self.gate.cost is not None and self.acceptance is not None
                and not isinstance(self.proposer, ModelProposer))


def _valid_drafts(proposals: np.ndarray, budget: list[int]) -> list[list[int]]:
    """``proposals`` int ``[B, k]`` padded with -1 -> per row its drafts, at most ``budget[i]``."""
    return [[t for t in row if t >= 0][:b] for row, b in zip(np.asarray(proposals).tolist(), budget)]


def _sampling_of(batch: InputBatch, req_ids: list[str]) -> tuple[dict[str, float], dict[str, Any]]:
    states = [batch.states[r] for r in req_ids]
    temps = {r: float(s.sampling_params.temperature) for r, s in zip(req_ids, states)}
    gens = {r: s.generator for r, s in zip(req_ids, states) if s.generator is not None}
    return temps, gens


def _draft_env(config: EngineConfig) -> DraftEnv:
    return DraftEnv(device=config.device_config.device, dtype=config.model_config.torch_dtype,
                    block_size=config.cache_config.block_size, max_num_seqs=config.scheduler_config.max_num_seqs,
                    max_model_len=config.model_config.max_model_len, load_format=config.load_config.load_format,
                    target_model_path=config.model_config.model)
