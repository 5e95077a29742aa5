"""Qwen3-MoE against HF transformers on a tiny random checkpoint (fp32): paged/chunked/batched logits within 1e-4
relative, a dense-layer variant (mlp_only_layers), engine greedy tokens equal to HF's greedy continuation, and the
same tokens with two gloo worker processes, experts either TP-sliced or expert-parallel (EP = 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ascent import LLM, SamplingParams
from ascent.executor import Executor
from ascent.layers.fused_moe import FusedMoE
from ascent.loader.base import build_model, check_all_loaded, get_model
from ascent.loader.hf import iterate_safetensors_weights
from tests.fixtures.tiny_moe import build_moe_model
from tests.integration.executor_helpers import greedy_generate, make_config
from tests.integration.helpers import hf_greedy, random_prompts, token_ids
from tests.reference.test_models_vs_hf import run_and_compare

MAX_NEW = 16


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_moe_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=5))


def test_loads_every_expert(moe_dir: str) -> None:
    config = AutoConfig.from_pretrained(moe_dir)
    model = get_model(moe_dir, config, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == config.num_hidden_layers
    for i, layer in enumerate(layers):
        ref = hf.model.layers[i].mlp.experts
        assert torch.equal(layer.w13_weight, ref.gate_up_proj)
        assert torch.equal(layer.w2_weight, ref.down_proj)


def test_missing_expert_tensor_is_reported(moe_dir: str) -> None:
    config = AutoConfig.from_pretrained(moe_dir)
    model = build_model(config, torch.float32, "cpu")
    dropped = "model.layers.1.mlp.experts.6.up_proj.weight"
    loaded = model.load_weights((n, t) for n, t in iterate_safetensors_weights(moe_dir) if n != dropped)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13_weight"):
        check_all_loaded(model, loaded, moe_dir)


def test_paged_logits_match_hf(moe_dir: str) -> None:
    run_and_compare(moe_dir, torch.float32, 1e-4, 1e-5)


def test_bf16_paged_logits_match_hf(moe_dir: str) -> None:
    run_and_compare(moe_dir, torch.bfloat16, 2e-2, 0.0)


def test_dense_layer_variant_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = str(build_moe_model(tmp_path_factory.mktemp("moe_dense0"), seed=6, mlp_only_layers=[0]))
    model = get_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    assert sum(isinstance(m, FusedMoE) for m in model.modules()) == 1
    run_and_compare(model_dir, torch.float32, 1e-4, 1e-5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, 512, 3, 90, seed=7)  # ~200-token first step: size-based EP picks all-to-all there


@pytest.fixture(scope="module")
def hf_tokens(moe_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    return hf_greedy(hf, prompts, MAX_NEW)


def _engine_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def test_engine_greedy_tokens_equal_hf(moe_dir: str, prompts: list[list[int]], hf_tokens: list[list[int]]) -> None:
    llm = LLM(model=moe_dir, dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=True)
    assert _engine_tokens(llm, prompts) == hf_tokens


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_workers_greedy_tokens_equal_hf(moe_dir: str, prompts: list[list[int]], hf_tokens: list[list[int]],
                                             expert_parallel: bool) -> None:
    config = make_config(moe_dir, 2, dtype="float32", enable_expert_parallel=expert_parallel)
    executor = Executor.create(config)
    try:
        infos = executor.collective_rpc("parallel_info")
        assert [(i["tp_size"], i["ep_size"]) for i in infos] == [(2, 2 if expert_parallel else 1)] * 2
        assert greedy_generate(executor, config, prompts, MAX_NEW) == hf_tokens
    finally:
        executor.shutdown()
