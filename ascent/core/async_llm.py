"""AsyncLLM: the engine inside an asyncio server, with per-request output streams.

One background thread owns the ``LLMEngine`` (nothing else touches it). The event loop talks to it through a command
queue (add / abort / profile / reset) whose replies come back as asyncio futures, and outputs come back through one
``RequestOutputCollector`` per request via ``loop.call_soon_threadsafe``. Many concurrent ``generate`` calls are
therefore batched by the engine's scheduler like offline requests.

Contract of ``generate``: validation errors raise ``ValueError`` from the first ``__anext__`` (nothing yielded); the
last output has ``finished == True``; a consumer that stops early (``aclose``, ``GeneratorExit``, cancellation — e.g.
a disconnected HTTP client) aborts the request, which frees every KV block it held. If the engine thread dies, every
open stream receives the error and ``errored`` becomes True.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ascent.args import EngineArgs
from ascent.core.llm_engine import LLMEngine, PromptType
from ascent.core.output_processor import IterationStats, RequestOutputCollector
from ascent.core.scheduler import SchedulerStats
from ascent.outputs import RequestOutput
from ascent.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StatObserver = Callable[[SchedulerStats, IterationStats | None], None]


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server must be restarted."""


def _seconds_since_process_start() -> float:
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.engine_config = engine.config
        self.model_config = engine.config.model_config
        self.tokenizer = engine.tokenizer
        self.timings: dict[str, float] = dict(engine.timings)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}
        self._observers: list[StatObserver] = []
        self._profiler: Any = None
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_engine_loop, name="ascent-engine", daemon=True)
        self._thread.start()

    def generation_defaults(self) -> dict[str, Any]:
        """SamplingParams keywords from the model's generation_config (read from files, not the engine thread)."""
        return self.engine.generation_defaults()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, log_stats: bool = True) -> "AsyncLLM":
        import_s = _seconds_since_process_start()
        engine = LLMEngine(engine_args.create_engine_config(), log_stats=log_stats)
        self = cls(engine)
        self.timings["import_s"] = import_s
        logger.info("startup timings: %s", json.dumps({k: round(v, 4) for k, v in self.timings.items()}))
        return self

    # ------------------------------------------------------------------------------------------------ state
    @property
    def is_ready(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def kv_cache_usage(self) -> float:
        return self.engine.engine_core.kv_cache_manager.usage

    def add_stat_observer(self, fn: StatObserver) -> None:
        self._observers.append(fn)

    # ------------------------------------------------------------------------------------------------ requests
    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        collector = RequestOutputCollector(sampling_params.output_kind)
        try:
            await self._call("add", request_id, prompt, sampling_params, priority, loop, collector)
        except asyncio.CancelledError:  # the caller left while the add was in flight: don't run it for nobody
            self._submit("abort", request_id)
            raise
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._submit("abort", request_id)

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def start_profile(self, trace_dir: str) -> None:
        await self._call("start_profile", trace_dir)

    async def stop_profile(self) -> str:
        return await self._call("stop_profile")

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self.engine.shutdown()

    # ------------------------------------------------------------------------------------------------ plumbing
    def _submit(self, *command: Any, reply: asyncio.Future | None = None) -> None:
        self._commands.put((command, reply))
        self._wakeup.set()

    async def _call(self, *command: Any) -> Any:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        reply = asyncio.get_running_loop().create_future()
        self._submit(*command, reply=reply)
        return await reply

    def _run_engine_loop(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        except BaseException as exc:  # the engine is unusable: fail every stream, never hang a client
            logger.exception("engine loop died")
            self.dead_error = exc
            for loop, collector in list(self._streams.values()):
                loop.call_soon_threadsafe(collector.put, EngineDeadError(f"engine failed: {exc!r}"))
            self._streams.clear()
            self._fail_pending_commands(exc)

    def _step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            loop, collector = stream
            loop.call_soon_threadsafe(collector.put, out)
            if out.finished:
                del self._streams[out.request_id]
        self._notify_observers(self.engine.last_scheduler_stats, self.engine.last_iteration_stats)

    def _notify_observers(self, stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        for fn in self._observers:
            try:
                fn(stats, iteration)
            except Exception:  # a metrics bug must never take the engine down
                logger.exception("stat observer %r failed", fn)

    def _drain_commands(self) -> None:
        while True:
            try:
                command, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = self._execute(*command)
            except Exception as exc:  # reported to the caller; the engine keeps serving others
                _resolve(reply, exc=exc)
            else:
                _resolve(reply, result=result)

    def _execute(self, name: str, *args: Any) -> Any:
        if name == "add":
            request_id, prompt, params, priority, loop, collector = args
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use.")
            self.engine.add_request(request_id, prompt, params, priority=priority)
            self._streams[request_id] = (loop, collector)
            return None
        if name == "abort":
            stream = self._streams.pop(args[0], None)
            was_active = stream is not None
            for final in self.engine.abort_request([args[0]]):
                if stream is not None:  # a consumer still waiting (abort() called by someone else) gets the end
                    stream[0].call_soon_threadsafe(stream[1].put, final)
            if was_active and self._observers and not self.engine.has_unfinished_requests():
                # the engine goes idle without another step: publish the drained state (gauges would go stale)
                self._notify_observers(self.engine.engine_core.make_stats(), None)
            return None
        if name == "reset_prefix_cache":
            return self.engine.reset_prefix_cache()
        if name == "start_profile":
            from ascent.metrics.torch_profiler import TorchProfilerWrapper

            if self._profiler is not None:
                raise RuntimeError("profiler is already running")
            profiler = TorchProfilerWrapper(args[0])
            profiler.start()
            self._profiler = profiler
            return None
        if name == "stop_profile":
            if self._profiler is None:
                raise RuntimeError("profiler is not running; call /start_profile first")
            profiler, self._profiler = self._profiler, None
            return profiler.stop()
        raise ValueError(f"unknown engine command {name!r}")

    def _fail_pending_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            _resolve(reply, exc=EngineDeadError(f"engine failed: {exc!r}"))


def _resolve(reply: asyncio.Future | None, result: Any = None, exc: BaseException | None = None) -> None:
    if reply is None:
        return

    def settle() -> None:
        if reply.done():
            return
        if exc is not None:
            reply.set_exception(exc)
        else:
            reply.set_result(result)

    reply.get_loop().call_soon_threadsafe(settle)
