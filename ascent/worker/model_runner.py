"""Model runner: applies the scheduler's diff to the persistent batch, prepares inputs with numpy, runs the model,
computes logits only at sampled positions and samples."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ascent.attention.backend import CommonAttentionMetadata, make_metadata_builder
from ascent.attention.layer import Attention
from ascent.config import EngineConfig
from ascent.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from ascent.forward_context import set_forward_context
from ascent.layers.cpu_kernels import sampling_ops
from ascent.loader.base import get_model
from ascent.platform.prefault import commit_caches
from ascent.sample.logprobs import compute_logprobs_tensors
from ascent.sample.metadata import SamplingMetadata, is_plain_greedy
from ascent.sample.rng import argmax_rows, make_generator
from ascent.sample.sampler import Sampler
from ascent.worker.input_batch import InputBatch, write_drafts
from ascent.worker.kv_zeroing import zero_new_blocks

if TYPE_CHECKING:
    from ascent.worker.spec_decode import SpecDecodeRunner


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    common: CommonAttentionMetadata
    rows: np.ndarray  # int64 [B] persistent-batch rows of the scheduled requests, in batch order
    req_ids: list[str]
    query_start_loc: np.ndarray  # int32 [B+1]
    positions_np: np.ndarray  # int64 [T]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = config.device_config.device
        self.dtype = self.model_config.torch_dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_commit = "not allocated"  # how the KV cache's memory was committed (prefault.commit_caches on CPU)
        self.profile = config.device_config.profile
        # cpu / 310p profiles: one host uniform per row + inverse CDF (exact, ~3x cheaper than a [B, V] race on CPU)
        self.rng_placement = str(self.profile.rng_placement)
        generator = make_generator(self.model_config.seed, self.rng_placement, self.device)
        self.sampler = Sampler(rng_placement=self.rng_placement, generator=generator)
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
            vocab_size=self.model_config.vocab_size,
        )
        # What a preempted request resumes with (the batch drops its row): its seeded generator, so the samples
        # continue the same stream, and how many prompt positions already got their logprobs.
        self._preempted: dict[str, tuple[torch.Generator | None, int]] = {}
        spec_config = getattr(config, "speculative_config", None)
        self.spec: SpecDecodeRunner | None = None
        if spec_config is not None:
            from ascent.worker.spec_decode import SpecDecodeRunner

            self.spec = SpecDecodeRunner(spec_config, self.max_model_len, self.rng_placement, generator)

    # ------------------------------------------------------------------------------------------------ setup
    def load_model(self) -> None:
        mc = self.model_config
        self.model = get_model(mc.model, self._model_hf_config(), self.dtype, self.device,
                               self.config.load_config.load_format, quantization=getattr(mc, "quantization", None),
                               profile_name=getattr(self.profile, "name", None))
        self._attn_layers = [m for m in self.model.modules() if _is_kv_layer(m)]
        if not self._attn_layers:
            raise ValueError(f"model {mc.model!r} has no attention layers")
        if self.spec is not None:
            self.spec.load_model(self.model, self.config)
        self._metadata_builder = make_metadata_builder(
            self._attn_layers[0].backend, max_model_len=self.max_model_len,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            chunked_prefill=self.config.scheduler_config.enable_chunked_prefill)
        self._sampling_ops = sampling_ops()  # the greedy argmax kernel, resolved once (argmax_rows)

    def _model_hf_config(self) -> Any:
        """The HF config the model is built from; EPLB's redundant expert slots travel on a copy of it
        (``num_redundant_experts``, read by the MoE models when they build ``FusedMoE``)."""
        hf_config = self.model_config.hf_config
        eplb = getattr(self.config, "eplb_config", None)
        if eplb is not None and eplb.enable and eplb.num_redundant_experts:
            hf_config = copy.copy(hf_config)
            hf_config.num_redundant_experts = eplb.num_redundant_experts
        return hf_config

    def attention_layers(self) -> list[Attention]:
        return self._attn_layers

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block summed over layers, from each backend's own cache shape (K+V pages, MLA latents, ...)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            math.prod(layer.backend.get_kv_cache_shape(1, self.block_size, layer.num_kv_heads, layer.head_size)) * elem
            for layer in self.attention_layers()
        ) + (self.spec.kv_cache_bytes_per_block() if self.spec is not None else 0)  # a drafter's own cache

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one cache tensor per attention layer and bind it to the layer."""
        self.kv_caches = []
        for layer in self.attention_layers():
            shape = layer.backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = _allocate_cache(shape, self.dtype, self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        self.kv_commit = ("zero-filled" if self.device.type != "cpu"
                          else commit_caches([c for c in self.kv_caches if c.nbytes >= LAZY_CACHE_BYTES]))
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks)

    # ------------------------------------------------------------------------------------------------ state diff
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.preempted_req_ids:
            state = batch.states.get(req_id)
            if state is not None:
                self._preempted[req_id] = (state.generator, state.prompt_logprobs_done)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove_request(req_id)
            if req_id in so.finished_req_ids:
                self._preempted.pop(req_id, None)
            if self.spec is not None:
                self.spec.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            seed = new.sampling_params.seed
            gen, prompt_logprobs_done = self._preempted.pop(new.req_id, (None, 0))
            if gen is None and seed is not None:
                gen = make_generator(seed, self.rng_placement, self.device)
            batch.add_request(new, gen)
            batch.states[new.req_id].prompt_logprobs_done = prompt_logprobs_done
            if self.spec is not None:
                self.spec.add_request(new.req_id, new.prompt_token_ids, new.output_token_ids)
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            batch.update_request(req_id, blocks, computed)
        if so.scheduled_spec_decode_tokens:
            write_drafts(batch, so.scheduled_spec_decode_tokens)

    # ------------------------------------------------------------------------------------------------ inputs
    def prepare_host_inputs(self, so: SchedulerOutput) -> PreparedInputs:
        """The host work of a step before the forward pass: the persistent batch updated from ``so`` and its inputs
        prepared (needs no model; ``ascent bench sched`` times it). ``so`` must schedule at least one token."""
        self._update_states(so)
        return self._prepare_inputs(so)

    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedInputs:
        batch = self.input_batch
        rows = np.fromiter((batch.req_id_to_index[r] for r in so.num_scheduled_tokens), dtype=np.int64)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int32)
        num_reqs = len(rows)
        if num_reqs > 1:
            order = np.argsort(rows, kind="stable")
            rows, num_sched = rows[order], num_sched[order]
        req_ids = [batch.req_ids[r] for r in rows]
        computed = batch.num_computed_tokens[rows]
        # every scheduled request has at least one token, so this total means exactly one each (a decode step)
        max_query_len = 1 if so.total_num_scheduled_tokens == num_reqs else int(num_sched.max())
        if max_query_len == 1:
            qsl = np.arange(num_reqs + 1, dtype=np.int32)
            total, positions, token_rows = num_reqs, computed.astype(np.int64), rows
        else:
            qsl = np.zeros(num_reqs + 1, dtype=np.int32)
            np.cumsum(num_sched, out=qsl[1:])
            total = int(qsl[-1])
            req_idx = np.repeat(np.arange(num_reqs), num_sched)
            positions = (computed[req_idx] + np.arange(total) - qsl[req_idx]).astype(np.int64)
            token_rows = rows[req_idx]
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = batch.block_table.compute_slot_mapping(token_rows, positions)
        seq_lens = (computed + num_sched).astype(np.int32, copy=False)  # (int32 + int32: a new array already)
        computed = computed.astype(np.int32, copy=False)  # (a fancy-indexed copy of the batch's column)
        block_table = batch.block_table.get_device_tensor(batch.num_reqs)
        if num_reqs != batch.num_reqs or (num_reqs and int(rows[-1]) != num_reqs - 1):  # rows: sorted, distinct
            block_table = block_table[self._tensor(rows)]
        common = CommonAttentionMetadata(
            query_start_loc=self._tensor(qsl),
            seq_lens=self._tensor(seq_lens),
            num_computed_tokens=self._tensor(computed),
            block_table=block_table,
            slot_mapping=self._tensor(slot_mapping, self.profile.slot_mapping_dtype),
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
            num_computed_tokens_np=computed,
            num_reqs=num_reqs,
            num_actual_tokens=total,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return PreparedInputs(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            common=common,
            rows=rows,
            req_ids=req_ids,
            query_start_loc=qsl,
            positions_np=positions,
        )

    def _tensor(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``array`` as a tensor on the model device (of ``dtype`` when given): the host array itself on CPU when the
        dtypes agree (a no-op ``.to`` costs ~2-9 us in a decode step's cold caches, and a step makes eight)."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu" and (dtype is None or tensor.dtype is dtype):
            return tensor
        return tensor.to(self.device, dtype)

    # ------------------------------------------------------------------------------------------------ execute
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.spec is None:
            return self._execute_model(so)
        with self.spec.timed_step(so) as step:  # step timing for the cost-aware draft gate and the arbiter
            output = self._execute_model(so)
            step.output_tokens = sum(len(t) for t in output.sampled_token_ids)
        return output

    @torch.inference_mode()
    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        assert self.model is not None
        if so.new_block_ids_to_zero:
            zero_new_blocks(self.kv_caches, so.new_block_ids_to_zero,
                            block_dim=self._attn_layers[0].backend.kv_cache_block_dim())
        inp = self._prepare_inputs(so)
        attn_metadata = self._metadata_builder.build(inp.common)
        with set_forward_context(attn_metadata):
            hidden = self.model(inp.input_ids, inp.positions)
        # Only requests whose known tokens are all computed sample; a partial prefill chunk does not (its logits
        # are never computed and its generator does not advance).
        spec_tokens = so.scheduled_spec_decode_tokens
        drafts = [spec_tokens.get(r, []) for r in inp.req_ids] if spec_tokens else None
        known = inp.common.seq_lens_np
        if drafts is not None:
            num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int32, count=len(drafts))
            known = known - num_drafts
        sampling = np.nonzero(known >= self.input_batch.num_tokens[inp.rows])[0]
        output = ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=[[] for _ in inp.req_ids])
        if drafts is not None and len(sampling) and num_drafts[sampling].any():
            self._verify_drafts(inp, sampling, hidden, [drafts[i] for i in sampling], output)
        elif len(sampling):
            last_rows = hidden  # every row is then one sampling request's only token
            if len(sampling) < inp.common.num_actual_tokens:
                last_idx = torch.from_numpy(inp.query_start_loc[sampling + 1].astype(np.int64) - 1).to(self.device)
                last_rows = hidden[last_idx]
            self._sample(inp, sampling, self.model.compute_logits(last_rows), output)
        if self.spec is not None:
            self.spec.observe(self.input_batch, inp.req_ids, inp.rows, inp.query_start_loc, inp.positions_np,
                              hidden, self.model)
        if self.spec is not None and len(sampling):
            req_ids = [inp.req_ids[i] for i in sampling]
            output.spec_token_ids = self.spec.propose(self.input_batch, req_ids,
                                                      [output.sampled_token_ids[i] for i in sampling])
        self._prompt_logprobs(inp, hidden, output)
        return output

    def _sampling_metadata(self, states: list) -> SamplingMetadata:
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        return SamplingMetadata.from_requests(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            generators,
            self.model_config.vocab_size,
            self.device,
        )

    def _verify_drafts(self, inp: PreparedInputs, sampling: np.ndarray, hidden: torch.Tensor,
                       drafts: list[list[int]], output: ModelRunnerOutput) -> None:
        """Score each sampling request's ``k_i + 1`` last positions and keep what the rejection sampler accepts."""
        assert self.spec is not None
        batch = self.input_batch
        states = [batch.states[inp.req_ids[i]] for i in sampling]
        ends = inp.query_start_loc[sampling + 1].astype(np.int64)
        rows = np.concatenate([np.arange(e - len(d) - 1, e) for e, d in zip(ends, drafts)])
        logits = self.model.compute_logits(hidden[torch.from_numpy(rows).to(self.device)])
        accepted = self.spec.verify(drafts, logits, self._sampling_metadata(states),
                                    [s.sampling_params.min_tokens for s in states], [s.req_id for s in states])
        offset = 0
        for j, i in enumerate(sampling):
            tokens = accepted[j]
            for t in tokens:
                batch.append_token(int(inp.rows[i]), t)
            output.sampled_token_ids[i] = tokens
            num = states[j].sampling_params.logprobs
            if num is not None:
                lp = compute_logprobs_tensors(logits[offset : offset + len(tokens)],
                                              torch.tensor(tokens, device=self.device), num)
                output.logprobs[inp.req_ids[i]] = [_trim_entry(e, num) for e in lp.to_entries()]
            offset += len(drafts[j]) + 1

    def _sample(self, inp: PreparedInputs, sampling: np.ndarray, logits: torch.Tensor,
                output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        states = [batch.states[inp.req_ids[i]] for i in sampling]
        if logits.dtype == torch.float32 and all(is_plain_greedy(s.sampling_params) for s in states):
            tokens = argmax_rows(logits, self._sampling_ops).tolist()  # the sampler's answer, without its metadata
            entries = None
        else:
            out = self.sampler(logits, self._sampling_metadata(states))
            tokens = out.sampled_token_ids.view(-1).tolist()
            entries = out.logprobs_tensors.to_entries() if out.logprobs_tensors is not None else None
        for j, i in enumerate(sampling):
            batch.append_token(int(inp.rows[i]), tokens[j])
            output.sampled_token_ids[i] = [tokens[j]]
            num = states[j].sampling_params.logprobs
            if entries is not None and num is not None:
                output.logprobs[inp.req_ids[i]] = [_trim_entry(entries[j], num)]

    def _prompt_logprobs(self, inp: PreparedInputs, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Logprobs of prompt token p+1 given positions <= p, for the prompt positions computed this step."""
        batch = self.input_batch
        for i, req_id in enumerate(inp.req_ids):
            state = batch.states[req_id]
            num = state.sampling_params.prompt_logprobs
            if num is None:
                continue
            start = int(inp.query_start_loc[i])
            step_first = int(inp.positions_np[start])
            first_pos = max(step_first, state.prompt_logprobs_done)  # a resumed request recomputes emitted ones
            last_pos = min(int(inp.common.seq_lens_np[i]), state.num_prompt_tokens - 1)
            if last_pos <= first_pos:
                continue
            state.prompt_logprobs_done = last_pos
            start += first_pos - step_first
            rows = torch.arange(start, start + last_pos - first_pos, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            targets = torch.tensor(state.prompt_token_ids[first_pos + 1 : last_pos + 1], device=self.device)
            tensors = compute_logprobs_tensors(logits, targets, num)
            output.prompt_logprobs[req_id] = tensors.to_entries()


def _trim_entry(entry: LogprobsEntry, num_logprobs: int) -> LogprobsEntry:
    """Keep the sampled token plus this request's own top-``num_logprobs`` (the batch computed the max over rows)."""
    if num_logprobs < 0:
        return entry
    return LogprobsEntry(entry.token_ids[: 1 + num_logprobs], entry.logprobs[: 1 + num_logprobs], entry.rank)


LAZY_CACHE_BYTES = 64 << 20  # CPU KV tensors from this size on are fresh zero pages (see _allocate_cache)


def _allocate_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled KV cache tensor.

    On CPU a large ``torch.empty`` is a fresh anonymous mapping, i.e. kernel zero pages that are only resident once
    written: ``initialize_kv_cache`` then commits them (``platform/prefault.py``: at start-up where that is cheap,
    else at each block's first write). Attention never reads a slot that was not written this step or earlier
    (padding repeats a valid slot), so even reused memory would be safe; ``zero_`` is still used for small tensors
    where the allocator may hand back recycled memory.
    """
    if device.type == "cpu" and math.prod(shape) * torch.tensor([], dtype=dtype).element_size() >= LAZY_CACHE_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _is_kv_layer(module: torch.nn.Module) -> bool:
    """Modules that own a paged KV cache: ``Attention`` and attention-like layers such as MLA (duck-typed)."""
    return all(hasattr(module, a) for a in ("layer_name", "kv_cache", "backend", "num_kv_heads", "head_size"))
