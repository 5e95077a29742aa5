"""ascent: a portable LLM inference engine with vLLM's surface."""

from ascent.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]


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
    raise AttributeError(name)
