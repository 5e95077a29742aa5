"""B6 cold start (``ascent bench startup``) and the server-process launcher shared with ``ascent bench serve``.

``ServerProcess`` starts a server command on a free loopback port, collects its log lines in a reader thread, waits
for ``/health`` with a bounded timeout and always kills the process on exit. The start-up split (import, weights,
KV allocation, engine init, ...) is parsed from the engine's ``startup timings: {json}`` log line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np

from ascent.benchmarks.common import collect_env, write_json

STARTUP_LINE = re.compile(r"startup timings:\s*(\{.*\})")
SPLIT_KEYS = ("import_s", "load_weights_s", "kv_alloc_s", "warmup_s", "compile_s", "engine_init_s")
LOG_TAIL_LINES = 400
HEALTH_POLL_S = 0.05
STOP_GRACE_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bound and released; the usual small race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_server_command() -> list[str]:
    """This interpreter's ``ascent serve``."""
    return [sys.executable, "-m", "ascent.entrypoints.cli", "serve"]


def serve_command(engine_flags: list[str], host: str, port: int, server_cmd: str | None = None,
                  extra_args: str | None = None) -> list[str]:
    """Full command line: the server command, engine flags, ``--host/--port`` and any extra arguments."""
    base = shlex.split(server_cmd) if server_cmd else default_server_command()
    extra = shlex.split(extra_args) if extra_args else []
    return [*base, *engine_flags, "--host", host, "--port", str(port), *extra]


def parse_startup_timings(line: str) -> dict[str, float] | None:
    """The JSON object of a ``startup timings: {...}`` log line, or None when the line is not one."""
    match = STARTUP_LINE.search(line)
    if match is None:
        return None
    try:
        data = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) \
        else None


class ServerProcess:
    """A server subprocess on ``host:port`` whose output is captured line by line (context manager)."""

    def __init__(self, command: list[str], host: str, port: int, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.base_url = f"http://{host}:{port}"
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.startup_timings: dict[str, float] | None = None
        self.start_time = 0.0
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._timings_seen = threading.Event()

    def start(self) -> "ServerProcess":
        self.start_time = time.perf_counter()
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      bufsize=1, env=self._env, start_new_session=True)
        self._reader = threading.Thread(target=self._read_output, name="bench-server-log", daemon=True)
        self._reader.start()
        return self

    def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))
            timings = parse_startup_timings(line)
            if timings is not None:
                self.startup_timings = timings
                self._timings_seen.set()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``GET /health`` until 200; returns seconds since ``start``. Raises RuntimeError on exit/timeout."""
        deadline = time.perf_counter() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() < deadline:
                self._raise_if_exited()
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return time.perf_counter() - self.start_time
                except httpx.TransportError:
                    pass
                time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"server did not report /health 200 within {timeout_s:.0f} s; "
                           f"log tail:\n{self.log_tail()}")

    def wait_startup_timings(self, timeout_s: float) -> dict[str, float] | None:
        """The parsed start-up split, waiting at most ``timeout_s`` for its log line."""
        self._timings_seen.wait(timeout_s)
        return self.startup_timings

    def _raise_if_exited(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"server exited with code {self._proc.returncode} before becoming healthy; "
                               f"log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminate (SIGTERM, then SIGKILL after a grace period); idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait(timeout=STOP_GRACE_S)
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server's own session, started by us
    except (ProcessLookupError, PermissionError):
        proc.kill()


def first_model_id(client: httpx.Client, base_url: str) -> str:
    """The first ``id`` of ``GET /v1/models``."""
    resp = client.get(base_url + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def first_token_time(base_url: str, model: str | None, prompt: str, timeout_s: float) -> float:
    """Send a streamed 1-token completion; returns the ``perf_counter`` time its first token arrived."""
    with httpx.Client(timeout=timeout_s) as client:
        model = model or first_model_id(client, base_url)
        payload = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
        with client.stream("POST", base_url + "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"first completion failed: HTTP {resp.status_code} {resp.read()!r}")
            for line in resp.iter_lines():
                body = line.removeprefix("data:").strip()
                if body and body != "[DONE]" and json.loads(body).get("choices"):
                    return time.perf_counter()
    raise RuntimeError("the first completion streamed no token")


def measure_cold_start(command: list[str], host: str, port: int, model: str | None, timeout_s: float,
                       prompt: str = "Hello") -> dict[str, Any]:
    """One cold start: process start -> /health 200 -> first token, plus the server's own start-up split."""
    with ServerProcess(command, host, port) as server:
        to_health = server.wait_healthy(timeout_s)
        token_at = first_token_time(server.base_url, model, prompt, timeout_s)
        to_token = token_at - server.start_time
        timings = server.wait_startup_timings(timeout_s=2.0)
    result: dict[str, Any] = {"time_to_health_s": to_health, "time_to_first_token_s": to_token,
                              "first_request_s": to_token - to_health, "startup_timings": timings}
    for key in SPLIT_KEYS:
        result[key] = timings.get(key) if timings else None
    if timings and "import_s" in timings and "engine_init_s" in timings:
        result["other_s"] = to_health - timings["import_s"] - timings["engine_init_s"]
    else:
        result["other_s"] = None
    return result


def _mean_of(iterations: list[dict[str, Any]], key: str) -> float | None:
    values = [it[key] for it in iterations if it.get(key) is not None]
    return float(np.mean(values)) if values else None


def run_startup(args: argparse.Namespace, engine_flags: list[str]) -> dict[str, Any]:
    """Run B6 ``args.num_iters`` times; top-level values are means over the iterations."""
    iterations = []
    for _ in range(args.num_iters):
        port = free_port(args.host)
        command = serve_command(engine_flags, args.host, port, args.server_cmd, args.server_args)
        iterations.append(measure_cold_start(command, args.host, port, args.served_model_name, args.server_timeout))
    keys = ("time_to_health_s", "time_to_first_token_s", "first_request_s", *SPLIT_KEYS, "other_s")
    result: dict[str, Any] = {"benchmark": "startup", "num_iters": args.num_iters,
                              **{k: _mean_of(iterations, k) for k in keys},
                              "startup_timings": iterations[-1]["startup_timings"], "iterations": iterations,
                              "command": serve_command(engine_flags, args.host, 0, args.server_cmd, args.server_args),
                              "env": collect_env(args.dtype or "auto", args.num_threads)}
    if args.output_json:
        write_json(args.output_json, result)
    print(format_startup_summary(result))
    return result


def format_startup_summary(result: dict[str, Any]) -> str:
    """Human-readable start-up summary."""
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f} s"

    split = "  ".join(f"{k[:-2]}={fmt(result.get(k))}" for k in SPLIT_KEYS if result.get(k) is not None)
    return (f"startup ({result['num_iters']} iteration(s)): /health after {fmt(result['time_to_health_s'])}, "
            f"first token after {fmt(result['time_to_first_token_s'])}\n  split: {split or 'n/a'}  "
            f"other={fmt(result['other_s'])}  first request={fmt(result['first_request_s'])}")
