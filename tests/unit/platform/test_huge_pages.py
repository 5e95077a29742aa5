"""Transparent huge pages for weights and the KV cache (ascent/platform/huge_pages.py)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from ascent.platform import huge_pages as hp

THP = hp.thp_mode()
needs_thp = pytest.mark.skipif(THP in (None, "never") or not sys.platform.startswith("linux"),
                               reason=f"kernel transparent huge pages unavailable (mode {THP})")
MIB = 1 << 20


def vma_flags(address: int, smaps: str = "/proc/self/smaps") -> set[str]:
    """The ``VmFlags`` of the mapping that holds ``address`` (``hg``: advised ``MADV_HUGEPAGE``). A read error
    raises: an empty answer would let the "not advised" checks pass without looking."""
    with open(smaps, encoding="ascii", errors="replace") as f:
        inside = False
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, _, hi = head.partition("-")
                inside = int(lo, 16) <= address < int(hi, 16)
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_env_switch(monkeypatch):
    monkeypatch.delenv(hp.ENV, raising=False)
    assert hp.enabled_from_env()
    monkeypatch.setenv(hp.ENV, "0")
    assert not hp.enabled_from_env()
    monkeypatch.setenv(hp.ENV, "yes")
    with pytest.raises(ValueError, match="ASCENT_CPU_HUGE_PAGES='yes'"):
        hp.enabled_from_env()


def test_thp_mode_parsing(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert hp.thp_mode(str(setting)) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert hp.thp_mode(str(setting)) == "always"
    assert hp.thp_mode(str(tmp_path / "missing")) is None


def test_huge_interior():
    two = hp.HUGE_PAGE_BYTES
    assert hp.huge_interior(two, 3 * two) == (two, 3 * two)
    assert hp.huge_interior(two + 4096, 3 * two) == (2 * two, 2 * two)  # both ends rounded inwards
    assert hp.huge_interior(two + 4096, two) == (2 * two, 0)  # no whole huge page inside


def test_merge_ranges():
    gap = 64 << 10
    ranges = [(0, 100), (50, 200), (200 + gap, 300 + gap), (10 * gap, 11 * gap)]
    assert hp.merge_ranges(ranges, max_gap=gap) == [(0, 300 + gap), (10 * gap, 11 * gap)]
    assert hp.merge_ranges([], max_gap=gap) == []


def test_storage_ranges_dedupe_views_and_skip_packed():
    base = torch.zeros(1024)
    packed = torch.zeros(8, 8).to_mkldnn()
    ranges = hp.storage_ranges([base, base[10:], base.view(32, 32), packed, torch.empty(0)])
    assert ranges == [(base.data_ptr(), base.data_ptr() + base.numel() * 4)]


@needs_thp
def test_advise_marks_mapping_and_keeps_values():
    t = torch.randn(6 * MIB // 4)
    before = t.clone()
    start, length = hp.huge_interior(t.data_ptr(), t.numel() * 4)
    assert length >= 2 * MIB
    accepted = hp.advise_ranges(hp.storage_ranges([t]), collapse=True)
    assert accepted in (0, length)  # 0 where the kernel cannot collapse now (old kernel, no free huge pages)
    assert "hg" in vma_flags(start)  # the MADV_HUGEPAGE advice itself always lands
    assert torch.equal(t, before)


def _child(code: str, **env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if k not in (hp.ENV, hp.TORCH_ENV)}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip()


# A fresh child: its first big torch allocation's mapping shows whether torch's allocator advised it.
PROBE = (inspect.getsource(vma_flags) + "import ascent, os, torch\n"
         "t = torch.empty(8 << 20, dtype=torch.uint8)\n"
         "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'hg' in vma_flags(t.data_ptr() + (4 << 20)))\n")


@needs_thp
def test_import_ascent_first_turns_on_torch_allocator_huge_pages():
    assert _child(PROBE) == "1 True"


@needs_thp
def test_opt_out_and_user_setting_are_respected():
    assert _child(PROBE, ASCENT_CPU_HUGE_PAGES="0") == "None False"
    assert _child(PROBE, THP_MEM_ALLOC_ENABLE="0") == "0 False"
    torch_first = "import torch\n" + PROBE  # too late for torch's allocator: left alone
    assert _child(torch_first) == "None False"


def test_engine_reports_huge_pages(tiny_llama_dir, monkeypatch):
    from ascent import LLM

    monkeypatch.setenv(hp.ENV, "0")
    off = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=8 * MIB, max_model_len=64)
    assert off.llm_engine.engine_core.worker.huge_pages == "off (ASCENT_CPU_HUGE_PAGES=0)"
    monkeypatch.setenv(hp.ENV, "1")
    on = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=8 * MIB, max_model_len=64)
    described = on.llm_engine.engine_core.worker.huge_pages
    if THP in (None, "never"):
        assert described.startswith("unavailable")
        return
    # Either torch's allocator advised the cache (ascent imported before torch) or the worker did (torch first).
    assert "torch allocations of 2 MiB" in described or "KV cache advised" in described
    kv = on.llm_engine.engine_core.worker.model_runner.kv_caches[0]
    start, length = hp.huge_interior(kv.data_ptr(), kv.numel() * kv.element_size())
    if length:
        assert "hg" in vma_flags(start)
