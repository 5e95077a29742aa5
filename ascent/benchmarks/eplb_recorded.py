"""The ``recorded`` trace of ``ascent bench eplb``: expert loads recorded from our own MoE model (specs §4 "real
traces"). A synthetic-weight Qwen3-MoE (seeded random weights, ``RecordedSpec`` experts x layers, top-k routing) is
written to a temporary directory, served by an in-process engine core on a seeded random prompt set, and after every
engine step the EPLB load recorder (``ascent.eplb.load_recorder.LoadRecorder`` on the model's MoE layers) folds the
layers' executed rows into a ``[L, E]`` row of routed tokens per logical expert. The policies then run on it like
on the synthetic traces, starting from the legacy initial layout on ``ranks`` ranks.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ascent.eplb.placement import initial_placement

@dataclass
class RecordedSpec:
    """Synthetic model and workload of the recorded trace."""

    layers: int = 8
    experts: int = 64
    top_k: int = 8
    ranks: int = 8
    prompts: int = 32
    max_tokens: int = 24
    max_num_seqs: int = 8
    hidden: int = 64
    weight_std: float = 0.08  # wider than HF's init so that the router logits (and the loads) are not uniform

    @property
    def slots(self) -> int:
        """Slots per rank: every expert once plus one redundant slot per rank."""
        return -(-self.experts // self.ranks) + 1


def build_synthetic_moe(path: Path, spec: RecordedSpec, seed: int) -> Path:
    """Write a random-weight ``Qwen3MoeForCausalLM`` (vocab 512) into ``path`` (no tokenizer: prompts are ids)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
                            moe_intermediate_size=spec.hidden // 2, num_hidden_layers=spec.layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=spec.hidden // 4,
                            max_position_embeddings=512, num_experts=spec.experts, num_experts_per_tok=spec.top_k,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, spec.weight_std)
    model.save_pretrained(str(path))
    return path


def _prompts(spec: RecordedSpec, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, int(rng.integers(8, 97))).tolist() for _ in range(spec.prompts)]


def record_loads(model_dir: str, spec: RecordedSpec, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Serve the seeded prompts greedily; returns (load float64 [T, L, E], scheduled tokens int64 [T]) over the
    engine steps that ran the model."""
    from ascent.args import EngineArgs
    from ascent.core.engine_core import EngineCore
    from ascent.eplb.load_recorder import LoadRecorder
    from ascent.eplb.updator import find_moe_layers
    from ascent.sampling_params import SamplingParams

    args = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=spec.max_num_seqs,
                      kv_cache_memory_bytes=16 << 20, disable_log_stats=True, seed=seed)
    core = EngineCore(args.create_engine_config())
    try:
        recorder = LoadRecorder(find_moe_layers(core.worker.model_runner.model), window_size=1)
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
        for i, prompt in enumerate(_prompts(spec, seed)):
            core.add_request(core.make_request(str(i), prompt, params))
        loads, tokens = [], []
        while core.scheduler.has_unfinished_requests():
            scheduled = core.scheduler.schedule()
            output = core.executor.execute_model(scheduled)
            core.scheduler.update_from_output(scheduled, output)
            if scheduled.total_num_scheduled_tokens:
                loads.append(recorder.record().numpy())
                tokens.append(scheduled.total_num_scheduled_tokens)
        return np.stack(loads).astype(np.float64), np.asarray(tokens, dtype=np.int64)
    finally:
        core.shutdown()


def recorded_trace(spec: RecordedSpec, seed: int, windows: int):
    """The ``recorded`` :class:`~ascent.benchmarks.eplb_traces.Trace` (``windows`` equal windows of steps)."""
    from ascent.benchmarks.eplb_traces import Trace

    with tempfile.TemporaryDirectory(prefix="ascent-eplb-moe-") as tmp:
        model_dir = str(build_synthetic_moe(Path(tmp), spec, seed))
        load, tokens = record_loads(model_dir, spec, seed)
    window = max(load.shape[0] // max(windows, 1), 1)
    placement = initial_placement(spec.layers, spec.experts, spec.ranks, spec.slots)
    meta = {"tokens": tokens.tolist(), "top_k": spec.top_k, "model": f"synthetic Qwen3-MoE {spec.layers} layers x "
            f"{spec.experts} experts top-{spec.top_k}", "ranks": spec.ranks, "slots": spec.slots}
    return Trace("recorded", load[:window * max(windows, 1)], placement, window, drifting=False, meta=meta)
