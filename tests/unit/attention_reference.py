"""SDPA reference for the paged decode attention kernels (shared by the kernel tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_decode(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, heads: int,
                     scale: float, window: int) -> torch.Tensor:
    """Paged decode attention by SDPA over explicitly gathered keys: row i attends its slots [start, lens[i]) with
    start = lens[i] - window when window > 0; GQA with heads // kv_heads query heads per KV head; q's dtype out."""
    kv_heads, d = cache.shape[2], cache.shape[3]
    outs = []
    for i, length in enumerate(lens.tolist()):
        start = max(0, length - window) if window else 0
        idx = slots[i, start:length]
        k = cache[0].index_select(0, idx).float().transpose(0, 1)  # [kvh, n, d]
        v = cache[1].index_select(0, idx).float().transpose(0, 1)
        qi = q[i].float().view(kv_heads, heads // kv_heads, d)
        outs.append(F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(-1))
    return torch.stack(outs).to(q.dtype)
