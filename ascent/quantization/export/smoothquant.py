"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights before quantization.

For a linear ``y = x W^T`` and a per-input-channel factor ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)``,
``y = (x / s) (W diag(s))^T`` exactly; ``x / s`` is produced by the layer *before* the linear, so the float function
is unchanged. Folding points used here (all exact in real arithmetic):

* q/k/v projections: divide the ``input_layernorm`` weight by ``s`` (one ``s`` for the three, from the max of their
  input statistics and of their weight columns, because they share the norm);
* gate/up projections: the same with ``post_attention_layernorm``;
* down_proj: divide the *rows* of ``up_proj`` by ``s`` - the SwiGLU product ``act(gate) * up`` is linear in ``up``;
* lm_head (only when it is quantized, :func:`smooth_lm_head`): divide the final ``model.norm`` weight by ``s``; a
  tied head is untied first (the embedding keeps its values);
* o_proj: divide the rows of ``v_proj`` by ``s`` - attention output of query head ``h`` is linear in the values of
  KV head ``h // n_rep``; with grouped-query attention ``s`` is shared by the ``n_rep`` query heads of one KV head
  (max of their statistics), which keeps the fold exact.

``alpha = 0.5`` is the paper's default. Channels whose activation or weight maximum is zero keep ``s = 1``.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.export.calibrate import ChannelStats

MIN_SCALE = 1e-5


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = a_j^alpha / w_j^(1 - alpha)`` in float32 (1 where either maximum is 0), clamped to >= 1e-5."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant alpha={alpha!r} must be in [0, 1]")
    a = act_absmax.double()
    w = weight_absmax.double()
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((a > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(min=MIN_SCALE).float()


def _column_absmax(linears: list[nn.Linear]) -> torch.Tensor:
    return torch.stack([lin.weight.detach().float().abs().amax(dim=0) for lin in linears]).amax(dim=0)


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.float() * s[None, :]).to(linear.weight.dtype)


def _divide_rows(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.float() / s[:, None]).to(linear.weight.dtype)
    if linear.bias is not None:
        linear.bias.data = (linear.bias.data.float() / s).to(linear.bias.dtype)


def _divide_norm(norm: nn.Module, s: torch.Tensor) -> None:
    norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    if getattr(norm, "bias", None) is not None:
        norm.bias.data = (norm.bias.data.float() / s).to(norm.bias.dtype)


def _smooth_shared_input(prev_divide, linears: dict[str, nn.Linear], stats: dict[str, ChannelStats],
                         alpha: float) -> dict[str, ChannelStats]:
    """Smooth linears that read the same input; ``prev_divide(s)`` folds ``1/s`` into the producer."""
    names = list(linears)
    act = torch.stack([stats[n].absmax() for n in names]).amax(dim=0)
    s = smoothing_factors(act, _column_absmax(list(linears.values())), alpha)
    prev_divide(s)
    for linear in linears.values():
        _scale_columns(linear, s)
    return {n: stats[n].scaled(s) for n in names}


def _smooth_o_proj(attn: nn.Module, config: object, prefix: str, stats: dict[str, ChannelStats],
                   alpha: float) -> dict[str, ChannelStats]:
    """o_proj smoothing folded into v_proj rows, one factor per (KV head, head dim) shared by its query heads."""
    o, v = attn.o_proj, attn.v_proj
    num_kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = v.out_features // num_kv
    n_rep = o.in_features // v.out_features
    if n_rep * v.out_features != o.in_features:
        raise ValueError(f"{prefix}.o_proj: in_features={o.in_features} is not a multiple of "
                         f"v_proj.out_features={v.out_features}")
    name = f"{prefix}.o_proj"
    act = stats[name].absmax().reshape(num_kv, n_rep, head_dim).amax(dim=1).reshape(-1)
    wmax = o.weight.detach().float().abs().amax(dim=0).reshape(num_kv, n_rep, head_dim).amax(dim=1).reshape(-1)
    s_kv = smoothing_factors(act, wmax, alpha)
    s = s_kv.reshape(num_kv, 1, head_dim).expand(num_kv, n_rep, head_dim).reshape(-1)
    _divide_rows(v, s_kv)
    _scale_columns(o, s)
    return {name: stats[name].scaled(s)}


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"SmoothQuant needs a decoder with model.layers; {type(model).__name__} has none")
    return layers


@torch.no_grad()
def apply_smoothquant(model: nn.Module, stats: dict[str, ChannelStats], alpha: float) -> dict[str, ChannelStats]:
    """Smooth every decoder layer of ``model`` in place (see the module docstring for the folding points).

    ``stats`` are the calibration statistics of the float model keyed by module name; returns a copy in which the
    smoothed linears' input statistics are divided by their factors (exact for min / max), so static activation
    scales can be computed without a second calibration pass."""
    new_stats = dict(stats)
    for index, layer in enumerate(_decoder_layers(model)):
        prefix = f"model.layers.{index}"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = (attn, mlp, getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if any(m is None for m in needed) or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{prefix}: SmoothQuant supports Llama/Qwen-style layers (self_attn q/k/v/o_proj, "
                             "mlp gate/up/down_proj, input/post_attention_layernorm)")
        qkv = {f"{prefix}.self_attn.{p}": getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")}
        new_stats.update(_smooth_shared_input(lambda s: _divide_norm(layer.input_layernorm, s), qkv, new_stats, alpha))
        new_stats.update(_smooth_o_proj(attn, model.config, f"{prefix}.self_attn", new_stats, alpha))
        gate_up = {f"{prefix}.mlp.{p}": getattr(mlp, p) for p in ("gate_proj", "up_proj")}
        new_stats.update(_smooth_shared_input(lambda s: _divide_norm(layer.post_attention_layernorm, s), gate_up,
                                              new_stats, alpha))
        down = {f"{prefix}.mlp.down_proj": mlp.down_proj}
        new_stats.update(_smooth_shared_input(lambda s: _divide_rows(mlp.up_proj, s), down, new_stats, alpha))
    return new_stats


@torch.no_grad()
def smooth_lm_head(model: nn.Module, head_name: str, stats: dict[str, ChannelStats],
                   alpha: float) -> dict[str, ChannelStats]:
    """Smooth the output projection ``head_name`` into the final norm (``model.model.norm``), untying it from the
    input embedding first when they share a tensor; returns the head's scaled statistics."""
    modules = dict(model.named_modules())
    head, norm = modules[head_name], getattr(getattr(model, "model", None), "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise ValueError(f"SmoothQuant of {head_name} needs the final norm model.norm; {type(model).__name__} has none")
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and embed.weight.data_ptr() == head.weight.data_ptr():
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    return _smooth_shared_input(lambda s: _divide_norm(norm, s), {head_name: head}, stats, alpha)
