"""Small tensor helpers shared by the device adaptors: paged-cache slot arithmetic, masked SDPA, quantization,
grouped row ranges and the FRACTAL_NZ relayout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

IntSeq = Sequence[int] | np.ndarray | torch.Tensor
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
NZ_FRACTAL = 16


def to_int_list(values: IntSeq | None, name: str) -> list[int]:
    """Host list of ints from a list / numpy array / tensor (a device tensor is copied to the host)."""
    if values is None:
        raise ValueError(f"{name} is required")
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def paged_slots(block_table: torch.Tensor, lens: list[int], block_size: int,
                starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of positions ``starts[i] .. starts[i]+lens[i]-1`` of each request.

    block_table: int ``[N, max_blocks]`` (row i = request i). Returns (slots int64 ``[sum(lens)]`` on the block
    table's device, request-major; cu_seqlens int32 ``[N+1]``). ValueError if a request needs more blocks than
    its row holds or a length is negative.
    """
    n = len(lens)
    starts = starts if starts is not None else [0] * n
    if len(starts) != n or n > block_table.shape[0]:
        raise ValueError(f"lens ({n}) / starts ({len(starts)}) do not match block_table rows {block_table.shape[0]}")
    ends = [s + length for s, length in zip(starts, lens)]
    if any(length < 0 for length in lens) or any(s < 0 for s in starts):
        raise ValueError(f"lens {lens} and starts {starts} must be >= 0")
    max_end = max(ends, default=0)
    if -(-max_end // block_size) > block_table.shape[1]:
        raise ValueError(f"position {max_end - 1} needs more than {block_table.shape[1]} blocks of {block_size}")
    device = block_table.device
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    cu = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens_t, 0, out=cu[1:])
    req = torch.repeat_interleave(torch.arange(n, device=device), lens_t)
    total = int(sum(lens))
    starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
    pos = torch.arange(total, device=device) - cu[:-1][req] + starts_t[req]
    blocks = block_table.to(torch.int64)[req, pos // block_size]
    return blocks * block_size + pos % block_size, cu.to(torch.int32)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a paged cache ``[num_blocks, block_size, *rest]`` -> ``[len(slots), *rest]``."""
    return cache.reshape(-1, *cache.shape[2:]).index_select(0, slots.to(cache.device))


def causal_mask(q_start: int, q_end: int, q_total: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """bool ``[q_end - q_start, kv_len]``: rows ``q_start:q_end`` of a ``q_total``-query sequence with bottom-right
    aligned causality (query i sees key j iff ``j <= kv_len - q_total + i``)."""
    q_pos = torch.arange(q_start, q_end, device=device).unsqueeze(1) + (kv_len - q_total)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= q_pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           query_chunk: int = 1024) -> torch.Tensor:
    """Attention of one sequence: q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` (Hq % Hkv == 0) -> ``[Lq, Hq, Dv]`` in q's
    dtype. ``causal``: bottom-right aligned (query i sees keys ``j <= Lk - Lq + i``); otherwise every key. Queries
    are processed ``query_chunk`` rows at a time (bounded memory for long prefills)."""
    lq, hq, lk = q.shape[0], q.shape[1], k.shape[0]
    if lk == 0 or lq == 0:
        return q.new_zeros(lq, hq, v.shape[-1])
    kh, vh = k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    out = q.new_empty(lq, hq, v.shape[-1])
    for s in range(0, lq, query_chunk):
        e = min(s + query_chunk, lq)
        mask = causal_mask(s, e, lq, lk, q.device) if causal else None
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=mask, scale=scale,
                                           enable_gqa=hq != k.shape[1])
        out[s:e] = o[0].transpose(0, 1)
    return out


def symmetric_quant(x: torch.Tensor, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization over the last dim: scale = max|x|/qmax (float32 ``x.shape[:-1]``), q = round
    (int8) or cast (fp8) of x/scale. All-zero rows get scale 0 and q 0."""
    if quant_dtype not in QMAX:
        raise ValueError(f"quant_dtype={quant_dtype} is not supported (int8 or float8_e4m3fn)")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX[quant_dtype]
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    if quant_dtype == torch.int8:
        return torch.round(y).clamp_(-128, 127).to(torch.int8), scale
    return y.clamp_(-QMAX[quant_dtype], QMAX[quant_dtype]).to(quant_dtype), scale


def group_ranges(group_list: IntSeq, group_list_type: int, num_groups: int, num_rows: int) -> list[tuple[int, int]]:
    """Row range of each group: ``group_list_type`` 1 = per-group counts, 0 = cumulative ends. ValueError if the
    list length differs from ``num_groups`` or the rows exceed ``num_rows``."""
    values = to_int_list(group_list, "group_list")
    if len(values) != num_groups:
        raise ValueError(f"group_list has {len(values)} entries, expected {num_groups}")
    if group_list_type == 1:
        ends = np.cumsum(values).tolist()
    elif group_list_type == 0:
        ends = values
    else:
        raise ValueError(f"group_list_type={group_list_type} is invalid (0 = cumsum, 1 = counts)")
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > num_rows):
        raise ValueError(f"group_list {values} (type {group_list_type}) does not fit {num_rows} rows")
    return list(zip(starts, ends))


def swiglu(h: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` with gate = first half, up = second half of the last dim; ``limit > 0`` clamps gate to
    ``<= limit`` and up to ``[-limit, limit]`` first."""
    gate, up = h.chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def to_fractal_nz(x: torch.Tensor) -> torch.Tensor:
    """FRACTAL_NZ relayout: ``[..., M, N]`` zero-padded to multiples of 16 -> ``[..., N/16, M_pad, 16]`` with
    ``nz[..., c, m, i] = x[..., m, 16c + i]``."""
    *batch, m, n = x.shape
    mp, np_ = -(-m // NZ_FRACTAL) * NZ_FRACTAL, -(-n // NZ_FRACTAL) * NZ_FRACTAL
    x = F.pad(x, (0, np_ - n, 0, mp - m))
    return x.reshape(*batch, mp, np_ // NZ_FRACTAL, NZ_FRACTAL).transpose(-3, -2).contiguous()


def from_fractal_nz(nz: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Inverse of :func:`to_fractal_nz`: ``[..., N/16, M_pad, 16]`` -> ``[..., m, n]``."""
    *batch, c, mp, f = nz.shape
    return nz.transpose(-3, -2).reshape(*batch, mp, c * f)[..., :m, :n].contiguous()
