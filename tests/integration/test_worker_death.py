"""Worker failure never hangs the engine: a worker killed with SIGKILL mid-generation raises ``WorkerDiedError``
(naming the rank and exit code) within a bounded time and the other workers are stopped; a worker that fails to start
reports its traceback; a step that exceeds its timeout is fatal; workers exit when the engine process dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ascent import LLM, SamplingParams
from ascent.executor import Executor, WorkerDiedError, WorkerError, WorkerTimeoutError
from tests.integration.executor_helpers import greedy_generate, make_config
from tests.integration.helpers import random_prompts

DETECT_BOUND_S = 20.0  # generous on a loaded 2-core machine; detection itself takes milliseconds
LONG = 200


def _kill_soon(pid: int, delay_s: float) -> threading.Thread:
    thread = threading.Timer(delay_s, os.kill, args=(pid, signal.SIGKILL))
    thread.start()
    return thread


def _assert_all_stopped(executor) -> None:
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in executor._workers.procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in executor._workers.procs)


@pytest.mark.parametrize("victim", [1, 0])
def test_sigkill_mid_generation_raises_worker_died(tiny_llama_dir, victim: int) -> None:
    config = make_config(tiny_llama_dir, 2)
    executor = Executor.create(config)
    pid = executor.worker_pids[victim]
    killed_at: list[float] = []

    def on_step(step: int) -> None:
        if step == 3:  # requests are in flight; the kill lands during a step or between two
            killed_at.append(time.monotonic())
            _kill_soon(pid, 0.005 if victim == 1 else 0.0).join(5)

    try:
        with pytest.raises(WorkerDiedError) as info:
            greedy_generate(executor, config, random_prompts(4, 512, 5, 40, seed=3), LONG, on_step=on_step)
        assert time.monotonic() - killed_at[0] < DETECT_BOUND_S
        err = info.value
        assert (err.rank, err.exitcode, err.pid) == (victim, -signal.SIGKILL, pid)
        assert f"worker rank {victim}" in str(err) and "SIGKILL" in str(err)
        _assert_all_stopped(executor)
        with pytest.raises(WorkerDiedError, match=f"rank {victim}"):
            executor.check_health()
    finally:
        executor.shutdown()


def test_worker_startup_failure_reports_traceback(tiny_llama_dir, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = make_config(str(model), 2)
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # the config resolves; loading the weights in the workers fails
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        Executor.create(config)
    assert time.monotonic() - start < 120
    assert info.value.rank in (0, 1) and "Traceback" in info.value.remote_traceback
    assert not [p for p in mp.active_children() if p.name.startswith("ascent-worker")]


def test_step_timeout_is_fatal(tiny_llama_dir) -> None:
    config = make_config(tiny_llama_dir, 2)
    executor = Executor.create(config)
    try:
        executor.execute_timeout_s = 1e-4  # no TP step over two processes answers this fast
        with pytest.raises(WorkerTimeoutError, match="did not answer execute_model"):
            greedy_generate(executor, config, [[5, 6, 7]], 4)
        _assert_all_stopped(executor)
        with pytest.raises(WorkerTimeoutError):
            executor.check_health()
    finally:
        executor.shutdown()


_ENGINE_SCRIPT = """
import sys, time
from ascent.executor.multiproc import MultiprocExecutor
from tests.integration.executor_helpers import make_config

if __name__ == "__main__":
    executor = MultiprocExecutor(make_config(sys.argv[1], 2), daemon=sys.argv[2] == "daemon")
    print(" ".join(map(str, executor.worker_pids)), flush=True)
    if sys.argv[3] == "sleep":
        time.sleep(120)
"""


def _pid_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _start_engine(model: str, tmp_path: Path, daemon: bool, sleep: bool) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    args = [sys.executable, str(script), model, "daemon" if daemon else "plain", "sleep" if sleep else "exit"]
    engine = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=repo, env=env)
    try:
        pids = [int(p) for p in _read_line(engine, timeout_s=120).split()]
    except BaseException:
        engine.kill()
        engine.wait(10)
        raise
    assert len(pids) == 2
    return engine, pids


def _assert_pids_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + DETECT_BOUND_S
    while any(_pid_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_pid_running(p) for p in pids)


def test_workers_exit_when_the_engine_process_dies(tiny_llama_dir, tmp_path: Path) -> None:
    engine, pids = _start_engine(tiny_llama_dir, tmp_path, daemon=True, sleep=True)
    try:
        assert all(_pid_running(p) for p in pids)
        engine.kill()
        engine.wait(10)
        _assert_pids_gone(pids)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)


def test_engine_exit_without_shutdown_stops_non_daemon_workers(tiny_llama_dir, tmp_path: Path) -> None:
    engine, pids = _start_engine(tiny_llama_dir, tmp_path, daemon=False, sleep=False)
    try:
        assert engine.wait(60) == 0  # the exit hook stops the workers before multiprocessing joins them
        _assert_pids_gone(pids)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0].strip():
        raise AssertionError(f"engine script printed no worker pids within {timeout_s}s (rc={proc.poll()})")
    return result[0]


def test_llm_generate_fails_fast_when_a_worker_is_killed(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, max_model_len=256, disable_log_stats=True)
    executor = llm.llm_engine.engine_core.executor
    try:
        params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 512, 3, 16, seed=5)]
        timer = _kill_soon(executor.worker_pids[1], 0.1)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1 .* exit code -9"):
            llm.generate(prompts, params, use_tqdm=False)
        timer.join(5)
        assert time.monotonic() - start < DETECT_BOUND_S
        _assert_all_stopped(executor)
    finally:
        executor.shutdown()
