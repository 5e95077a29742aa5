"""Paged attention on ``torch.nn.functional.scaled_dot_product_attention`` (portable: CPU and CUDA).

KV cache per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V), in the model
dtype. Each step:
- this step's K/V rows are written into their slots (rows with slot -1 are skipped);
- decode requests (query length 1) run in ONE SDPA call: their K/V are gathered from the cache through the block
  table, padded to the longest context with a key-padding mask; the query heads sharing a KV head are laid out as
  the query-length axis so GQA needs no K/V repetition;
- prefill requests (query length > 1) run one SDPA call each: with no cached prefix, ``is_causal=True`` on the fresh
  K/V; otherwise over the full context gathered from the cache with a bottom-right aligned causal mask (query i
  sees keys ``0 .. num_computed + i``). Covers prefix-cache hits, chunked prefill and speculative verification;
- short multi-token queries on a cached prefix (``2 <= q_len <= MULTI_QUERY_MAX_LEN``, e.g. speculative verification
  of ``k + 1`` tokens), when there are at least two such requests, run in ONE SDPA call like decodes: queries padded
  to the longest (padding repeats the last query row; its output is dropped), the query heads of a KV head and the
  query positions folded into one axis, and a per-request causal + key-padding mask.
  With the CPU profile's fused decode kernel (``paged_decode_attention``) they are instead expanded into decode
  rows: query token i of a request is a decode row over the first ``num_computed + i + 1`` slots of its context
  (its K/V are written before attention), so verification rows take exactly the path, and give exactly the values,
  of plain decode rows; a step made only of decodes and such rows is decode-only (see ``models/decode_stack.py``).
Gather indices and masks are built once per step by the metadata builder and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ascent.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from ascent.layers.cpu_kernels import fused_ops


# Decode contexts up to this many cache rows (summed over the batch) are gathered with one index_select for K and V.
SINGLE_GATHER_MAX_ROWS = 1024
# Cached-prefix queries up to this many tokens are batched into one SDPA call (see the module docstring).
MULTI_QUERY_MAX_LEN = 16


@dataclass
class SDPAMultiQuery:
    """Batched short queries on cached prefixes (``n`` requests, queries padded to ``q_max``).

    rows: int64 ``[n * q_max]`` token rows (padding repeats the request's last row); valid: int64 indices of the real
    queries in that flattened order; out_rows: int64 their token rows; slots: int64 ``[n, l_max]`` cache slots
    (padding repeats a valid slot); q_pos: int64 ``[n, q_max, 1]`` query positions; mask: bool ``[n, q_max, l_max]``.
    """

    n: int
    q_max: int
    rows: torch.Tensor
    valid: torch.Tensor
    out_rows: torch.Tensor
    slots: torch.Tensor
    q_pos: torch.Tensor
    mask: torch.Tensor
    _folded: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def folded_mask(self, group: int, window: int | None) -> torch.Tensor:
        """bool ``[n, 1, q_max * group, l_max]`` (query i's ``group`` heads share its row), optional window."""
        key = (group, window)
        if key not in self._folded:
            mask = self.mask
            if window is not None:
                k_pos = torch.arange(mask.shape[2], device=mask.device).view(1, 1, -1)
                mask = mask & (k_pos > self.q_pos - window)
            self._folded[key] = mask.repeat_interleave(group, dim=1).unsqueeze(1)
        return self._folded[key]


@dataclass
class SDPAPrefill:
    """One multi-token request: token rows ``start:end`` at positions ``num_computed .. seq_len-1``.

    ``context_slots`` (int64 ``[seq_len]``) and ``mask`` (bool ``[end-start, seq_len]``) are set only when a cached
    prefix exists (``num_computed > 0``); otherwise the fresh K/V are attended with ``is_causal``.
    """

    start: int
    end: int
    num_computed: int
    seq_len: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class SDPAMetadata:
    """Per-step SDPA metadata.

    write_slots: int64 slots for the K/V rows ``write_rows`` (None = rows ``0..len(write_slots)-1``).
    decode_rows: int64 token rows of the decode requests (None = contiguous rows ``decode_start:+num_decodes``).
    decode_slots: int64 ``[num_decodes, decode_max_len]`` cache slots per context position (padding repeats a
    valid slot); decode_mask: bool ``[num_decodes, 1, 1, decode_max_len]`` (None = no padding);
    decode_seq_lens: int64 ``[num_decodes]`` on device.
    """

    num_actual_tokens: int
    write_slots: torch.Tensor
    write_rows: torch.Tensor | None
    num_decodes: int
    decode_rows: torch.Tensor | None
    decode_start: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    prefills: list[SDPAPrefill]
    multi: SDPAMultiQuery | None = None
    _window_masks: dict[int, tuple[torch.Tensor | None, list[torch.Tensor]]] = field(default_factory=dict)

    def window_masks(self, window: int) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Decode and per-prefill masks restricted to a sliding window of ``window`` keys (cached per window)."""
        if window not in self._window_masks:
            device = self.write_slots.device
            prefill = [_prefill_mask(p, window, device) for p in self.prefills]
            self._window_masks[window] = (self._decode_window_mask(window), prefill)
        return self._window_masks[window]

    def _decode_window_mask(self, window: int) -> torch.Tensor | None:
        if self.decode_slots is None or self.decode_seq_lens is None:
            return None
        pos = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
        last = self.decode_seq_lens.unsqueeze(1) - 1
        return ((pos <= last) & (pos > last - window)).view(self.num_decodes, 1, 1, -1)


def _prefill_mask(p: SDPAPrefill, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[q_len, seq_len]``: query i (position num_computed + i) sees key j iff j <= pos (and pos - j < window)."""
    q_pos = torch.arange(p.num_computed, p.seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(p.seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window is not None else mask


def _context_slots(block_rows: torch.Tensor, block_size: int, length: int, lens: torch.Tensor | None = None,
                   ops: Any = None) -> torch.Tensor:
    """int64 ``[R, length]`` cache slots of positions ``0..length-1`` for block-table rows ``[R, max_blocks]``; with
    ``lens`` (int64 ``[R]``, each in ``[1, length]``) positions ``>= lens[r]`` repeat row r's first slot (padding
    that attention never reads). ``ops``: the fused CPU kernels (``fused_ops()``), which compute it in one call
    (``context_slots``) for a CPU int32 table; None = torch ops."""
    num_blocks = -(-length // block_size)
    if num_blocks > block_rows.shape[1]:
        raise ValueError(f"context of {length} tokens needs {num_blocks} blocks; block table has {block_rows.shape[1]}")
    if (ops is not None and block_rows.device.type == "cpu" and block_rows.dtype == torch.int32
            and block_rows.stride(1) == 1):
        return ops.context_slots(block_rows, block_size, length, lens if lens is not None else _NO_LENS)
    blocks = block_rows[:, :num_blocks].to(torch.int64).repeat_interleave(block_size, dim=1)[:, :length]
    offsets = torch.arange(length, device=block_rows.device) % block_size
    slots = blocks * block_size + offsets
    if lens is not None and int(lens.min()) < length:
        pad = torch.arange(length, device=slots.device).unsqueeze(0) < lens.unsqueeze(1)
        slots = torch.where(pad, slots, slots[:, :1])
    return slots


_NO_LENS = torch.empty(0, dtype=torch.int64)


def write_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV write plan shared by the paged backends: int64 destination slots and the token rows they come from
    (None = rows ``0..len(slots)-1``); rows with slot -1 (padding) are left out."""
    if slot_mapping.numel() == 0 or _smallest(slot_mapping) >= 0:
        return (slot_mapping if slot_mapping.dtype is torch.int64 else slot_mapping.to(torch.int64)), None
    valid = slot_mapping >= 0
    rows = valid.nonzero().squeeze(1)
    return slot_mapping.index_select(0, rows).to(torch.int64), rows


def _smallest(values: torch.Tensor) -> int:
    """Minimum of a non-empty integer tensor; on CPU through numpy (~5 us in a step's cold caches, torch's ~20)."""
    return int(values.numpy().min()) if values.device.type == "cpu" else int(values.min())


def paged_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """``[2 (K, V), num_blocks, block_size, num_kv_heads, head_size]``, the layout of the SDPA and 310P backends."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


class SDPAMetadataBuilder(AttentionMetadataBuilder):
    """Builds ``SDPAMetadata`` from host-side lengths (no device synchronization except the -1 slot check)."""

    def __init__(self) -> None:
        self._fused = fused_ops()  # resolved once: the lookup is not free in a step's cold caches

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        seq_lens = common.seq_lens_np[: common.num_reqs].astype(np.int64)
        if common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs:
            return self._build_decode_only(common, seq_lens)
        computed = common.num_computed_tokens_np[: common.num_reqs].astype(np.int64)
        return self._build_general(common, seq_lens, computed)

    def _build_general(self, common: CommonAttentionMetadata, seq_lens: np.ndarray,
                       computed: np.ndarray) -> SDPAMetadata:
        """Any mix of decodes, short multi-token queries and prefills, each planned by kind."""
        qsl = common.query_start_loc_np[: common.num_reqs + 1].astype(np.int64)
        query_lens = np.diff(qsl)
        if np.any(computed + query_lens != seq_lens):
            raise ValueError(f"seq_lens {seq_lens.tolist()} != num_computed {computed.tolist()} + query lens "
                             f"{query_lens.tolist()}")
        write_slots, write_rows = write_plan(common.slot_mapping)
        short = (query_lens > 1) & (query_lens <= MULTI_QUERY_MAX_LEN) & (computed > 0)
        expand = common.block_table.device.type == "cpu" and bool(short.any()) and self._fused is not None
        decode_idx = np.flatnonzero((query_lens == 1) | short) if expand else np.flatnonzero(query_lens == 1)
        rows, lens, owners = _decode_rows(decode_idx, qsl, seq_lens, computed)
        md = SDPAMetadata(common.num_actual_tokens, write_slots, write_rows, len(rows), None, 0, None, None,
                          None, [])
        if len(rows):
            self._plan_decodes(md, common, owners, rows, lens)
        multi = np.flatnonzero(short) if not expand else np.empty(0, dtype=np.int64)
        if len(multi) >= 2:
            md.multi = self._plan_multi(common, multi, qsl, seq_lens, computed)
        else:
            multi = multi[:0]
        prefill_idx = np.flatnonzero((query_lens > 1) & ~short) if expand else np.flatnonzero(query_lens > 1)
        for i in (np.setdiff1d(prefill_idx, multi) if len(prefill_idx) else prefill_idx):
            md.prefills.append(self._plan_prefill(common, int(i), qsl, seq_lens, computed))
        return md

    def _build_decode_only(self, common: CommonAttentionMetadata, seq_lens: np.ndarray) -> SDPAMetadata:
        """A step of one query token per request (token row i = request i): ``build``'s result without its
        per-kind splitting."""
        computed = common.num_computed_tokens_np[: common.num_reqs]
        if (seq_lens - computed != 1).any():
            raise ValueError(f"seq_lens {seq_lens.tolist()} != num_computed {computed.tolist()} + 1 (one-token step)")
        write_slots, write_rows = write_plan(common.slot_mapping)
        md = SDPAMetadata(common.num_actual_tokens, write_slots, write_rows, common.num_reqs, None, 0, None, None,
                          None, [])
        if common.num_reqs:
            self._plan_decodes(md, common, None, None, seq_lens)
        return md

    def _plan_multi(self, common: CommonAttentionMetadata, idx: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                    computed: np.ndarray) -> SDPAMultiQuery:
        device = common.block_table.device
        q_lens = qsl[idx + 1] - qsl[idx]
        n, q_max = len(idx), int(q_lens.max())
        offs = np.minimum(np.arange(q_max)[None, :], (q_lens - 1)[:, None])  # [n, q_max], padding -> last query
        rows = qsl[idx][:, None] + offs
        q_pos = computed[idx][:, None] + offs
        flat_valid = np.flatnonzero(np.arange(q_max)[None, :] < q_lens[:, None])
        lens = seq_lens[idx]
        l_max = int(lens.max())
        table = common.block_table.index_select(0, torch.from_numpy(idx).to(device))
        slots = _context_slots(table, common.block_size, l_max, torch.from_numpy(lens).to(device), self._fused)
        q_pos_t = torch.from_numpy(q_pos).to(device).unsqueeze(2)
        mask = torch.arange(l_max, device=device).view(1, 1, -1) <= q_pos_t
        return SDPAMultiQuery(n, q_max, torch.from_numpy(rows.reshape(-1)).to(device),
                              torch.from_numpy(flat_valid).to(device),
                              torch.from_numpy(rows.reshape(-1)[flat_valid]).to(device), slots, q_pos_t, mask)

    def _plan_decodes(self, md: SDPAMetadata, common: CommonAttentionMetadata, owners: np.ndarray | None,
                      rows: np.ndarray | None, lens: np.ndarray) -> None:
        """Decode rows: token row ``rows[j]`` of request ``owners[j]`` attends to its first ``lens[j]`` slots
        (``owners`` / ``rows`` None: ``0..len(lens)-1``)."""
        device = common.block_table.device
        if rows is None or (rows[-1] - rows[0] + 1 == len(rows) and np.all(np.diff(rows) == 1)):
            md.decode_start = 0 if rows is None else int(rows[0])
        else:
            md.decode_rows = torch.from_numpy(rows).to(device)
        max_len = int(lens.max()) if len(lens) > 1 else int(lens[0])
        table = (common.block_table if owners is None
                 else common.block_table.index_select(0, torch.from_numpy(owners).to(device)))
        if table.shape[0] != len(lens):  # (a slice costs ~8 us in a step's cold caches: only when needed)
            table = table[: len(lens)]
        md.decode_seq_lens = torch.from_numpy(lens).to(device)
        md.decode_slots = _context_slots(table, common.block_size, max_len, md.decode_seq_lens, self._fused)
        if len(lens) > 1 and int(lens.min()) < max_len:
            mask = torch.arange(max_len, device=device).unsqueeze(0) < md.decode_seq_lens.unsqueeze(1)
            md.decode_mask = mask.view(len(lens), 1, 1, max_len)

    @staticmethod
    def _plan_prefill(common: CommonAttentionMetadata, i: int, qsl: np.ndarray, seq_lens: np.ndarray,
                      computed: np.ndarray) -> SDPAPrefill:
        p = SDPAPrefill(int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(seq_lens[i]), None, None)
        if p.num_computed > 0:
            p.context_slots = _context_slots(common.block_table[i : i + 1], common.block_size, p.seq_len)[0]
            p.mask = _prefill_mask(p, None, common.block_table.device)
        return p


def _decode_rows(idx: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                 computed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every query token of requests ``idx`` as a decode row: (token rows, context lengths, owning request), int64;
    token i of request r sees ``computed[r] + i + 1`` keys."""
    q_lens = qsl[idx + 1] - qsl[idx]
    owners = np.repeat(idx, q_lens).astype(np.int64)
    offsets = np.arange(int(q_lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    return qsl[owners] + offsets, computed[owners] + offsets + 1, owners


def _adjacent_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[2, T, W]`` view of k and v when v's columns directly follow k's in one row-major tensor (k, v slices of
    one fused projection output), else None."""
    if k.dim() != 2 or k.shape != v.shape or k.stride() != v.stride() or k.stride(1) != 1 or k.dtype != v.dtype:
        return None
    if v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    if v.storage_offset() - k.storage_offset() != k.shape[1]:
        return None
    return k.as_strided((2, k.shape[0], k.shape[1]), (k.shape[1], k.stride(0), 1), k.storage_offset())


class SDPAImpl(AttentionImpl):
    """See the module docstring; optional ``sliding_window`` (keys with ``pos - key < window``) is honoured.

    With the CPU profile's fused kernels, the KV write and decode attention run as one C++ call each on CPU
    (``paged_kv_write``, ``paged_decode_attention``: fp32 softmax over the request's own slots, no gather/padding),
    and bf16 prefills (fresh, or a chunk over its gathered cached prefix) take ``prefill_attention`` where it applies
    (AVX512-BF16 without AMX: head size a multiple of 32 up to 256; AMX: head size 32, 64 or 128).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)
        self._fused = fused_ops()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SDPAMetadata | None,
    ) -> torch.Tensor:
        """q ``[T, nh*d]``, k/v ``[T, nkv*d]`` (any float dtype) -> ``[T, nh*d]`` in q's dtype.

        ``attn_metadata=None`` (dummy/profiling forward): all T rows form one causal sequence, no cache access.
        """
        num_tokens = q.shape[0]
        if attn_metadata is None:
            return self._attend_fresh(q, k, v, None)
        if kv_cache.numel() == 0:
            raise RuntimeError("attention layer has no KV cache allocated but attention metadata was given")
        self._write(k, v, kv_cache, attn_metadata)
        decode_mask, prefill_masks = attn_metadata.decode_mask, [p.mask for p in attn_metadata.prefills]
        if self.sliding_window is not None:
            decode_mask, prefill_masks = attn_metadata.window_masks(self.sliding_window)
        if attn_metadata.num_decodes == num_tokens and attn_metadata.decode_rows is None:
            return self._decode(q, kv_cache, attn_metadata, decode_mask)  # decode-only step: no output scatter
        k_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        v_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        out = q.new_empty(num_tokens, self.num_heads * self.head_size)
        if attn_metadata.num_decodes:
            o = self._decode(q, kv_cache, attn_metadata, decode_mask)
            if attn_metadata.decode_rows is not None:
                out.index_copy_(0, attn_metadata.decode_rows, o)
            else:
                out[attn_metadata.decode_start : attn_metadata.decode_start + attn_metadata.num_decodes] = o
        if attn_metadata.multi is not None:
            mq = attn_metadata.multi
            out.index_copy_(0, mq.out_rows, self._multi(q, kv_cache, mq))
        for p, mask in zip(attn_metadata.prefills, prefill_masks):
            rows = out[p.start : p.end]
            if p.context_slots is None:
                o = self._attend_fresh(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], mask, rows)
            else:
                o = self._attend_cached(q[p.start : p.end], k_cache, v_cache, p, mask, rows)
            if o is not rows:  # the fused kernel wrote into the rows; SDPA's result is copied there
                rows.copy_(o)
        if num_tokens > attn_metadata.num_actual_tokens:
            out[attn_metadata.num_actual_tokens :].zero_()
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata) -> None:
        """Scatter this step's K/V rows into their slots: one ``index_copy_`` when k and v are adjacent column
        blocks of one tensor (the fused QKV output), else one per cache plane."""
        width = self.num_kv_heads * self.head_size
        k, v = k.reshape(k.shape[0], width), v.reshape(v.shape[0], width)
        if md.write_rows is not None:
            k, v = k.index_select(0, md.write_rows), v.index_select(0, md.write_rows)
        elif k.shape[0] != md.write_slots.shape[0]:
            k, v = k[: md.write_slots.shape[0]], v[: md.write_slots.shape[0]]
        planes = kv_cache.view(2, -1, width)
        if (self._fused is not None and kv_cache.device.type == "cpu" and k.dtype == kv_cache.dtype
                and v.dtype == kv_cache.dtype and k.stride(-1) == 1 and v.stride(-1) == 1):
            self._fused.paged_kv_write(planes, k, v, md.write_slots)
            return
        pair = _adjacent_pair(k, v)
        if pair is not None and pair.dtype == kv_cache.dtype:
            planes.index_copy_(1, md.write_slots, pair)
            return
        planes[0].index_copy_(0, md.write_slots, k.to(kv_cache.dtype))
        planes[1].index_copy_(0, md.write_slots, v.to(kv_cache.dtype))

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of the decode rows over their gathered contexts: ``[n, nh*d]``."""
        n, group = md.num_decodes, self.num_heads // self.num_kv_heads
        assert md.decode_slots is not None
        if md.decode_rows is not None:
            qd = q.index_select(0, md.decode_rows)
        else:
            qd = q[md.decode_start : md.decode_start + n]
        if self._fused is not None and q.device.type == "cpu" and kv_cache.dtype == q.dtype and qd.stride(-1) == 1:
            cache = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
            return self._fused.paged_decode_attention(qd, cache, md.decode_slots, md.decode_seq_lens, self.num_heads,
                                                      self.scale, self.sliding_window or 0)
        qd = qd.reshape(n, self.num_kv_heads, group, self.head_size)
        k, v = self._gather_context(kv_cache, md.decode_slots)
        o = F.scaled_dot_product_attention(qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale)
        return o.reshape(n, self.num_heads * self.head_size)

    def _multi(self, q: torch.Tensor, kv_cache: torch.Tensor, mq: SDPAMultiQuery) -> torch.Tensor:
        """Batched short cached-prefix queries: ``[num valid queries, nh*d]`` in ``mq.out_rows`` order."""
        group = self.num_heads // self.num_kv_heads
        qm = q.index_select(0, mq.rows).view(mq.n, mq.q_max, self.num_kv_heads, group, self.head_size)
        qm = qm.permute(0, 2, 1, 3, 4).reshape(mq.n, self.num_kv_heads, mq.q_max * group, self.head_size)
        k, v = self._gather_context(kv_cache, mq.slots)
        o = F.scaled_dot_product_attention(qm, k.to(q.dtype), v.to(q.dtype),
                                           attn_mask=mq.folded_mask(group, self.sliding_window), scale=self.scale)
        o = o.view(mq.n, self.num_kv_heads, mq.q_max, group, self.head_size).permute(0, 2, 1, 3, 4)
        return o.reshape(mq.n * mq.q_max, self.num_heads * self.head_size).index_select(0, mq.valid)

    def _gather_context(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the cache slots ``[n, L]`` as ``[n, num_kv_heads, L, head_size]`` views. Small contexts
        gather K and V in one call (fewer dispatches); large ones per plane (the row-gather fast path, ~2x faster
        per byte than gathering along the second dim)."""
        flat = slots.view(-1)
        shape = (slots.shape[0], slots.shape[1], self.num_kv_heads, self.head_size)
        if flat.shape[0] <= SINGLE_GATHER_MAX_ROWS:
            kv = kv_cache.view(2, -1, self.num_kv_heads, self.head_size).index_select(1, flat)
            k, v = kv[0], kv[1]
        else:
            k = kv_cache[0].view(-1, self.num_kv_heads, self.head_size).index_select(0, flat)
            v = kv_cache[1].view(-1, self.num_kv_heads, self.head_size).index_select(0, flat)
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``[L, num_heads*d]`` -> ``[1, num_heads, L, d]`` (4-D: the CPU kernels are faster than for 3-D)."""
        return x.reshape(1, x.shape[0], num_heads, self.head_size).transpose(1, 2)

    def _prefill_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the fused causal kernel (``prefill_attention``: AVX512-BF16, or AMX tiles on AMX CPUs) takes this
        prefill: bf16 CPU tensors with unit last stride (k / v: this chunk's rows or the cache planes) and a head size
        it supports (1.3-3x torch's SDPA there)."""
        return (self._fused is not None and q.device.type == "cpu" and q.dtype == torch.bfloat16
                and k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 and q.dim() == 2 and q.stride(-1) == 1
                and k.stride(-1) == 1 and v.stride(-1) == 1 and self._fused.prefill_attention_available(self.head_size))

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of rows that form one whole sequence (no cached prefix). The fused kernel writes into
        ``out`` (contiguous [rows, heads * head_size] of q's dtype) when given and returns it; SDPA returns a new
        tensor."""
        if self._prefill_kernel(q, k, v):
            k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
            return self._fused.prefill_attention(q, k, v, self.num_heads, self.scale, 0, self.sliding_window or 0,
                                                 out)
        if mask is None and self.sliding_window is not None:
            n = q.shape[0]
            mask = _prefill_mask(SDPAPrefill(0, n, 0, n, None, None), self.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads),
            attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_size)

    def _attend_cached(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: SDPAPrefill,
                       mask: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """This chunk's queries over its cached context and itself (``out`` as in ``_attend_fresh``)."""
        assert p.context_slots is not None
        if self._prefill_kernel(q, k_cache, v_cache):  # the context's K/V rows, then this chunk's queries over them
            width = self.num_kv_heads * self.head_size
            kc = k_cache.index_select(0, p.context_slots).view(-1, width)
            vc = v_cache.index_select(0, p.context_slots).view(-1, width)
            return self._fused.prefill_attention(q, kc, vc, self.num_heads, self.scale, p.num_computed,
                                                 self.sliding_window or 0, out)
        kc = k_cache.index_select(0, p.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        vc = v_cache.index_select(0, p.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            self._heads(q, self.num_heads), kc, vc, attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_size)


class SDPABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "SDPA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return paged_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[SDPAMetadataBuilder]:
        return SDPAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[SDPAImpl]:
        return SDPAImpl
