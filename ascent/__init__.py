"""ascent: a portable LLM inference engine with vLLM's surface."""

import os as _os
import sys as _sys


def _request_torch_huge_pages() -> None:
    # Huge pages for torch's CPU allocations of 2 MiB and more (weights, KV cache, logits): torch reads
    # THP_MEM_ALLOC_ENABLE once, at its first allocation, so it is set here, before anything imports torch
    # (ascent/platform/huge_pages.py has the measurements and the fallback for a torch imported first).
    if _os.environ.get("ASCENT_CPU_HUGE_PAGES", "1").strip() == "0" or "torch" in _sys.modules:
        return
    if _sys.platform.startswith("linux"):
        _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


_request_torch_huge_pages()

from ascent.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt",
           "__version__"]


def __getattr__(name: str):
    # Lazy imports keep `import ascent` light (the CLI imports torch/transformers only when needed).
    if name == "LLM":
        from ascent.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from ascent.args import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        import ascent.outputs as outputs

        return getattr(outputs, name)
    if name in ("TextPrompt", "TokensPrompt"):
        import ascent.inputs as inputs

        return getattr(inputs, name)
    raise AttributeError(name)
