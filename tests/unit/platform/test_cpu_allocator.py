"""``keep_freed_buffers``: freed multi-MiB host buffers stay mapped, so re-allocating them costs no page faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ascent.platform import cpu_allocator

_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from ascent.platform.cpu_allocator import keep_freed_buffers
    applied = keep_freed_buffers(int(sys.argv[1]))
    def step():  # a 40 MiB buffer, touched, freed: above glibc's 32 MiB ceiling of its adaptive mmap threshold
        torch.empty(10 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    rounds = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            step()
        rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(int(applied), min(rounds))
""")


def _faults(keep_mib: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(keep_mib)], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_reallocations_stop_faulting_once_buffers_are_kept():
    default_applied, default_faults = _faults(0)
    kept_applied, kept_faults = _faults(64)
    assert not default_applied and kept_applied
    assert default_faults >= 5 * 10240  # by default every step maps (and faults in) the 10240 pages afresh
    assert kept_faults < default_faults / 100  # kept: the heap serves them again without faults


def test_env_threshold_validation(monkeypatch):
    monkeypatch.delenv(cpu_allocator.ENV, raising=False)
    assert cpu_allocator.keep_mib_from_env() == cpu_allocator.DEFAULT_KEEP_MIB
    monkeypatch.setenv(cpu_allocator.ENV, "0")
    assert cpu_allocator.keep_mib_from_env() == 0 and not cpu_allocator.keep_freed_buffers()
    for bad in ("lots", "-1", "4096"):
        monkeypatch.setenv(cpu_allocator.ENV, bad)
        with pytest.raises(ValueError, match=cpu_allocator.ENV):
            cpu_allocator.keep_mib_from_env()
