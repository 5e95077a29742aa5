"""The kernel build cache survives a killed build and keeps checkouts apart.

torch's ``cpp_extension.load`` guards a build directory with a baton file that a killed process leaves behind, after
which every later load waited forever; two checkouts with identical sources shared one build directory and rebuilt
each other's module (ninja's build file names the source by path)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from ascent.layers import cpu_kernels as ck

pytestmark = pytest.mark.skipif(ck.fcntl is None, reason="flock is POSIX-only")


def _hold_then_die(build_dir: str, held: multiprocessing.synchronize.Event) -> None:
    with ck.exclusive_build(Path(build_dir)):
        (Path(build_dir) / "lock").touch()  # torch's baton, as a build in progress has it
        held.set()
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build: nothing is cleaned up


def _enter_within(build_dir: Path, seconds: float) -> bool:
    """Whether exclusive_build(build_dir) is entered within `seconds` (the body checks the baton is gone)."""
    entered = threading.Event()

    def enter() -> None:
        with ck.exclusive_build(build_dir):
            assert not (build_dir / "lock").exists()
            entered.set()

    worker = threading.Thread(target=enter, daemon=True)
    worker.start()
    return entered.wait(seconds)


def test_a_build_killed_while_holding_the_lock_blocks_nobody(tmp_path):
    ctx = multiprocessing.get_context("fork")
    held = ctx.Event()
    child = ctx.Process(target=_hold_then_die, args=(str(tmp_path), held))
    child.start()
    assert held.wait(30)
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert (tmp_path / "lock").exists()  # the leftover that used to hang every later load
    assert _enter_within(tmp_path, 30)


def test_the_lock_excludes_a_second_process_while_held(tmp_path):
    ctx = multiprocessing.get_context("fork")
    release, held = ctx.Event(), ctx.Event()

    def hold() -> None:
        with ck.exclusive_build(tmp_path):
            held.set()
            release.wait(60)

    child = ctx.Process(target=hold)
    child.start()
    assert held.wait(30)
    assert not _enter_within(tmp_path, 0.5)  # waits while the holder is alive
    release.set()
    child.join(30)
    assert _enter_within(tmp_path, 30)


def test_a_stale_baton_no_longer_hangs_a_real_load():
    source = Path(ck.__file__).with_name("sampling_cpu.cpp")
    build_dir = ck._build_dir(ck.build_hash(source, ck._compile_flags()))
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()  # left by a build killed mid-way
    result: list = []
    loader = threading.Thread(target=lambda: result.append(ck.load_extension.__wrapped__("sampling_cpu.cpp")),
                              daemon=True)
    loader.start()
    loader.join(600)
    assert not loader.is_alive(), "load_extension waited on a stale baton"
    assert result and result[0] is not None and hasattr(result[0], "argmax_rows")


def test_checkouts_with_identical_sources_build_apart(tmp_path):
    package = Path(ck.__file__).parent
    copy = tmp_path / "cpu_kernels"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    flags = ck._compile_flags()
    here = ck.build_hash(package / "sampling_cpu.cpp", flags)
    assert here == ck.build_hash(package / "sampling_cpu.cpp", flags)
    assert here != ck.build_hash(copy / "sampling_cpu.cpp", flags)
    assert here != ck.build_hash(package / "sampling_cpu.cpp", flags + ["-DX"])
