"""Tensor parallelism end to end: TP=2 over gloo (two spawned worker processes) produces the TP=1 greedy tokens on
tiny Llama and Qwen3 (4 query / 2 KV heads, vocab 512 -> column/row-parallel linears, split KV heads, vocab-parallel
embedding and LM head), with chunked prefill and prefix caching on. Driven directly through the executor and through
the offline ``LLM(..., tensor_parallel_size=2)``."""

from __future__ import annotations

import os

import pytest

from ascent import LLM, SamplingParams
from ascent.executor import Executor
from ascent.executor.multiproc import MultiprocExecutor
from ascent.executor.uniproc import UniProcExecutor
from tests.integration.executor_helpers import greedy_generate, make_config
from tests.integration.helpers import random_prompts, token_ids

NEW = 12
BATCH_TOKENS = 64  # small step budget: long prompts are prefilled in chunks across steps


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tiny_llama_dir, tiny_qwen3_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen3_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    base = random_prompts(5, 512, 3, 90, seed=7)
    shared = base[4][:40]
    return base + [shared + [11, 12, 13], shared + [14, 15]]  # two prompts sharing 2 cached blocks


def test_tp2_executor_greedy_equals_tp1(model_dir, prompts) -> None:
    cfg1 = make_config(model_dir, 1, max_num_batched_tokens=BATCH_TOKENS)
    with Executor.create(cfg1) as uni:
        assert isinstance(uni, UniProcExecutor)
        ref = greedy_generate(uni, cfg1, prompts, NEW)
        blocks_tp1 = uni.determine_num_blocks()
    cfg2 = make_config(model_dir, 2, max_num_batched_tokens=BATCH_TOKENS)
    executor = Executor.create(cfg2)
    try:
        assert isinstance(executor, MultiprocExecutor)
        got = greedy_generate(executor, cfg2, prompts, NEW)
        infos = executor.collective_rpc("parallel_info")
        hash_seeds = executor.collective_rpc("get_env", ("PYTHONHASHSEED",))
        blocks_tp2 = executor.determine_num_blocks()
        timings = dict(executor.timings)
    finally:
        executor.shutdown()
    assert got == ref
    assert [p.exitcode for p in executor._workers.procs] == [0, 0]  # stopped by command, not terminated
    assert [(i["rank"], i["tp_rank"], i["tp_size"], i["tp_ranks"]) for i in infos] == [(0, 0, 2, [0, 1]),
                                                                                       (1, 1, 2, [0, 1])]
    assert all(i["num_threads"] == 1 and i["backend"] == "gloo" and i["ep_size"] == 1 for i in infos)
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 3
    assert hash_seeds == [os.environ["PYTHONHASHSEED"]] * 2 and infos[0]["hash_probe"] == infos[1]["hash_probe"]
    assert blocks_tp2 == 2 * blocks_tp1  # each rank holds half of the KV heads in the same byte budget
    assert {"load_weights_s", "kv_alloc_s", "worker_start_s"} <= set(timings)


def test_rpc_and_lifecycle_errors(tiny_llama_dir) -> None:
    executor = Executor.create(make_config(tiny_llama_dir, 2), backend="mp")
    try:
        for bad in ("_private", "no_such_method"):
            with pytest.raises(ValueError, match=f"method='{bad}'"):
                executor.collective_rpc(bad)
        assert executor.collective_rpc("ping") == [0, 1]
        executor.check_health()
    finally:
        executor.shutdown()
    executor.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("ping")
    with pytest.raises(ValueError, match="'uni' needs world size 1"):
        Executor.create(make_config(tiny_llama_dir, 2), backend="uni")
    with pytest.raises(ValueError, match="backend='ray'"):
        Executor.create(make_config(tiny_llama_dir, 1), backend="ray")


def _llm_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def test_llm_tensor_parallel_size_2_equals_1(model_dir, prompts) -> None:
    kw = dict(dtype="float32", max_model_len=256, disable_log_stats=True, max_num_batched_tokens=BATCH_TOKENS,
              max_num_seqs=BATCH_TOKENS)
    ref = _llm_tokens(LLM(model=model_dir, **kw), prompts)
    llm = LLM(model=model_dir, tensor_parallel_size=2, **kw)
    try:
        assert isinstance(llm.llm_engine.engine_core.executor, MultiprocExecutor)
        got = _llm_tokens(llm, prompts)
    finally:
        llm.llm_engine.engine_core.executor.shutdown()
    assert got == ref
