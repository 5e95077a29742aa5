"""Shared pieces of the golden quantized-checkpoint tests (``test_quant_golden_*.py``).

The checkpoints under ``tests/fixtures/quant/`` were produced by the formats' own tools (msmodelslim 26.1,
llmcompressor 0.14; see ``tools/quant_fixtures/README.md``). Everything here is independent of ascent's quantization
code: activation fake-quantizers written from the published formulas, HF-model patching (weights, biases, activation
quantization hooks), and a paged end-to-end harness that reuses the float reference tests' ``PagedHarness``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "quant"
MAKE_FIXTURES = REPO_ROOT / "tools" / "quant_fixtures" / "make_fixtures.py"

ATTN_SHARDS = ("q_proj", "k_proj", "v_proj")
MLP_SHARDS = ("gate_proj", "up_proj")
FP8_MAX = 448.0

ActQuant = Callable[[torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------------------------
# activation fake-quantizers (input -> dequantized input, float32 math)
# ------------------------------------------------------------------------------------------------------------------
def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric int8 per token: s = amax/127, q = clamp(rint(x/s), -128, 127), x' = q*s."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127.0
    return (torch.round(xf / s).clamp(-128, 127) * s).to(x.dtype)


def int8_static(scale: float, offset: float = 0.0) -> ActQuant:
    """Static per-tensor int8: q = clamp(rint(x/s + z), -128, 127), x' = (q - z)*s."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        q = torch.round(x.float() / scale + offset).clamp(-128, 127)
        return ((q - offset) * scale).to(x.dtype)

    return fn


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic FP8 (e4m3) per token: s = amax/448, x' = e4m3(clamp(x/s)) * s."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).to(x.dtype)


def fp8_per_group(group: int) -> ActQuant:
    """Dynamic FP8 per token and per ``group`` consecutive channels."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.float().reshape(*shape[:-1], shape[-1] // group, group)
        return fp8_per_token(xf).reshape(shape).to(x.dtype)

    return fn


# ------------------------------------------------------------------------------------------------------------------
# float source model (rebuilt from the generator's own code, for the "vs float" comparison)
# ------------------------------------------------------------------------------------------------------------------
def _make_fixtures_module():
    spec = importlib.util.spec_from_file_location("ascent_make_quant_fixtures", MAKE_FIXTURES)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def build_float_source(path: Path, moe: bool = False) -> Path:
    """The float32 model the fixtures were quantized from (same seed and code as ``make_fixtures.py``)."""
    return _make_fixtures_module().build_float_model(Path(path), moe=moe)


# ------------------------------------------------------------------------------------------------------------------
# HF reference model patching
# ------------------------------------------------------------------------------------------------------------------
def set_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        assert linear.weight.shape == weight.shape, (linear.weight.shape, weight.shape)
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias = nn.Parameter(bias.float().clone(), requires_grad=False)


def add_input_quant(module: nn.Module, fn: ActQuant) -> None:
    """Fake-quantize the module's input (forward pre-hook)."""
    module.register_forward_pre_hook(lambda mod, args: (fn(args[0]),) + tuple(args[1:]))


def add_output_bias(module: nn.Module, bias: torch.Tensor) -> None:
    """``y = module(x) + bias`` (forward hook), e.g. anti-outlier RMSNorm biases."""
    b = bias.float()
    module.register_forward_hook(lambda mod, args, out: out + b.to(out.dtype))


def patch_moe_experts_act_quant(experts: nn.Module, fn: ActQuant) -> None:
    """Replace a transformers ``*MoeExperts`` forward by an eager loop that fake-quantizes each expert GEMM input."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            token_idx, k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = fn(hidden_states[token_idx])
            gate, up = nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = fn(experts.act_fn(gate) * up)
            y = nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    experts.forward = forward


# ------------------------------------------------------------------------------------------------------------------
# ascent side
# ------------------------------------------------------------------------------------------------------------------
def ascent_linear_slices(model: nn.Module, layer_idx: int, hf_config) -> dict[str, tuple[nn.Module, slice]]:
    """HF linear name (``self_attn.q_proj`` ...) -> (ascent fused layer, its row slice)."""
    layer = model.model.layers[layer_idx]
    q = hf_config.num_attention_heads * hf_config.head_dim
    kv = hf_config.num_key_value_heads * hf_config.head_dim
    out = {
        "self_attn.q_proj": (layer.self_attn.qkv_proj, slice(0, q)),
        "self_attn.k_proj": (layer.self_attn.qkv_proj, slice(q, q + kv)),
        "self_attn.v_proj": (layer.self_attn.qkv_proj, slice(q + kv, q + 2 * kv)),
        "self_attn.o_proj": (layer.self_attn.o_proj, slice(0, hf_config.hidden_size)),
    }
    if hasattr(layer.mlp, "gate_up_proj"):
        inter = hf_config.intermediate_size
        out.update({
            "mlp.gate_proj": (layer.mlp.gate_up_proj, slice(0, inter)),
            "mlp.up_proj": (layer.mlp.gate_up_proj, slice(inter, 2 * inter)),
            "mlp.down_proj": (layer.mlp.down_proj, slice(0, hf_config.hidden_size)),
        })
    return out


def scheme_of(layer: nn.Module):
    method = getattr(layer, "quant_method", None)
    scheme = getattr(method, "scheme", None)
    assert scheme is not None, f"{type(layer).__name__} is not quantized (quant_method={type(method).__name__})"
    return scheme


def load_ascent(model_dir: str | Path, quantization: str | None = None) -> nn.Module:
    from transformers import AutoConfig

    from ascent.loader.base import get_model

    config = AutoConfig.from_pretrained(str(model_dir))
    return get_model(str(model_dir), config, torch.float32, "cpu", quantization=quantization)


# ------------------------------------------------------------------------------------------------------------------
# end-to-end: paged/chunked/batched ascent logprobs vs a full-sequence HF forward
# ------------------------------------------------------------------------------------------------------------------
SCHEDULE = [
    [("A", slice(0, 6)), ("B", slice(0, 7))],
    [("B", slice(7, 8)), ("A", slice(6, 11))],
    [("A", slice(11, 12)), ("B", slice(8, 9))],
]
LENGTHS = {"A": 12, "B": 9}


def prompt_ids(vocab_size: int, seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randint(3, vocab_size, (n,), generator=gen).tolist() for r, n in LENGTHS.items()}


def hf_logprobs(hf_model: nn.Module, seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {r: torch.log_softmax(hf_model(torch.tensor([t])).logits[0].float(), -1) for r, t in seqs.items()}


def ascent_logprobs(model: nn.Module, seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Run :data:`SCHEDULE` (chunked prefill + decodes of two requests in one batch) through ``PagedHarness``."""
    from tests.reference.test_models_vs_hf import PagedHarness

    harness = PagedHarness(model)
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}
    for chunks in SCHEDULE:
        out = harness.step([(r, seqs[r][sl]) for r, sl in chunks])
        for r, _ in chunks:
            rows[r].append(out[r])
    return {r: torch.log_softmax(torch.cat(v).float(), -1) for r, v in rows.items()}


def max_logprob_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    for r in a:
        assert a[r].shape == b[r].shape, (r, a[r].shape, b[r].shape)
    return max(float((a[r] - b[r]).abs().max()) for r in a)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------------------
# offline LLM API (the --quantization plumbing: EngineArgs -> ModelConfig -> loader)
# ------------------------------------------------------------------------------------------------------------------
def llm_prompt_logprobs(fixture_dir: Path, tmp_path: Path, prompt: list[int], quantization: str | None
                        ) -> list[float]:
    """Copy the fixture (it has no tokenizer), add a tiny tokenizer, run ``LLM(..., quantization=...)`` with
    ``prompt_logprobs`` and return the logprob of every prompt token after the first."""
    import shutil

    from transformers import AutoConfig

    from ascent import LLM, SamplingParams
    from tests.fixtures.tiny_models import build_tokenizer

    model_dir = tmp_path / fixture_dir.name
    shutil.copytree(fixture_dir, model_dir)
    build_tokenizer(model_dir, vocab_size=AutoConfig.from_pretrained(str(fixture_dir)).vocab_size)
    llm = LLM(model=str(model_dir), dtype="float32", quantization=quantization, max_model_len=128, max_num_seqs=4,
              disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    return [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
