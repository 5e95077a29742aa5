"""Unified expert MLP over grouped matmul, and the ``group_list`` contract (specs/eplb_moe_lora.md §5.3).

Input rows are sorted by local expert; ``group_list`` describes the row segments:
type 0 = inclusive cumulative sum (rows of experts 0..i), type 1 = counts per expert, type 2 = sparse
``[expert, count]`` pairs (MC2 style). Example: counts ``[0, 2, 1, 0]`` == cumsum ``[0, 2, 3, 3]`` == pairs
``[[1, 2], [2, 1], [0, 0], [0, 0]]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascent.platform.adaptor import DeviceAdaptor

GROUP_LIST_CUMSUM = 0
GROUP_LIST_COUNTS = 1
GROUP_LIST_PAIRS = 2
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def cumsum_group_list(group_list: torch.Tensor, src_type: int, dst_type: int,
                      num_experts: int | None = None) -> torch.Tensor:
    """Convert ``group_list`` between its three forms: 0 = cumulative row counts ``[E]``, 1 = row counts ``[E]``,
    2 = ``[n, 2]`` (expert id, rows) pairs of the non-empty experts (``[0, 0]`` rows are padding; reading pairs
    needs ``num_experts``). An invalid type or a malformed list is a ValueError. Returns int64."""
    for value in (src_type, dst_type):
        if value not in (0, 1, 2):
            raise ValueError(f"group_list_type should be in [0, 1, 2], but received {value}")
    gl = group_list.to(torch.int64)
    if src_type == dst_type:
        return gl.clone()
    if src_type == GROUP_LIST_PAIRS:
        counts = _pairs_to_counts(gl, num_experts)
    elif src_type == GROUP_LIST_CUMSUM:
        counts = torch.diff(gl, prepend=gl.new_zeros(1))
    else:
        counts = gl
    if dst_type == GROUP_LIST_COUNTS:
        return counts
    if dst_type == GROUP_LIST_CUMSUM:
        return counts.cumsum(0)
    experts = counts.nonzero().squeeze(1)
    return torch.stack([experts, counts.index_select(0, experts)], dim=1)


def _pairs_to_counts(gl: torch.Tensor, num_experts: int | None) -> torch.Tensor:
    if num_experts is None:
        raise ValueError("num_experts is required to convert group_list type 2 (pairs)")
    if gl.dim() != 2 or gl.shape[1] != 2:
        raise ValueError(f"group_list type 2 must be [n, 2] pairs, got shape {tuple(gl.shape)}")
    experts, counts = gl[:, 0], gl[:, 1]
    if bool(((experts < 0) | (experts >= num_experts)).any()):
        raise ValueError(f"group_list pairs name experts {experts.tolist()} outside [0, {num_experts})")
    return gl.new_zeros(num_experts).index_add_(0, experts, counts)


def _to_counts_or_cumsum(group_list: torch.Tensor, group_list_type: int,
                         num_experts: int) -> tuple[torch.Tensor, int]:
    if group_list_type == GROUP_LIST_PAIRS:
        return cumsum_group_list(group_list, 2, 0, num_experts), GROUP_LIST_CUMSUM
    if group_list_type not in (GROUP_LIST_CUMSUM, GROUP_LIST_COUNTS):
        raise ValueError(f"group_list_type should be in [0, 1, 2], but received {group_list_type}")
    return group_list, group_list_type


def _gated_act(h: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return F.gelu(gate, approximate=approximate) * up


def unified_apply_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_list: torch.Tensor,
                      group_list_type: int = GROUP_LIST_COUNTS, activation: str = "silu",
                      topk_scales: torch.Tensor | None = None,
                      adaptor: DeviceAdaptor | None = None) -> torch.Tensor:
    """Gated expert MLP on expert-sorted rows: ``down_e(act(gate_e(x)) * up_e(x))`` for the rows of expert e.

    x ``[R, H]`` (rows sorted by expert, rows past the last group are left 0); w13 ``[E, 2I, H]`` (gate rows then
    up rows, checkpoint layout); w2 ``[E, H, I]``; group_list per ``group_list_type``; ``topk_scales`` ``[R]``
    optionally scales each row after the activation. activation in ``ACTIVATIONS`` (gated). Returns ``[R, H]``
    in x's dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} must be [E, 2I, H] / [E, H, I]")
    if x.dim() != 2 or x.shape[1] != w13.shape[2]:
        raise ValueError(f"x shape {tuple(x.shape)} must be [R, {w13.shape[2]}]")
    adaptor = adaptor or DeviceAdaptor()
    gl, gl_type = _to_counts_or_cumsum(group_list, group_list_type, w13.shape[0])
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    if activation == "silu":
        h = adaptor.grouped_matmul_swiglu(x, w13_t, gl, group_list_type=gl_type)
    else:
        h = _gated_act(adaptor.grouped_matmul(x, w13_t, gl, group_list_type=gl_type), activation)
    if topk_scales is not None:
        h = h * topk_scales.reshape(-1, 1).to(h.dtype)
    return adaptor.grouped_matmul(h, w2_t, gl, group_list_type=gl_type)
