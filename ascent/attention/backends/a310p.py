"""Compatibility attention backend (the 310P paths of device_ops spec §3, portable torch form).

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V), as the SDPA backend, so the
model runner can swap backends; the 310P kernels' NZ layout is a pure relayout and is not emulated. Every step first
writes the new K/V rows into their slots (slot -1 = padding, skipped), then dispatches on the step's state (§3.1):

- PrefillNoCache (no request has cached tokens): FA-style prefill, per request over the fresh K/V with the causal
  additive mask of the mask builder, sized to the request;
- DecodeOnly (one query token per request): PA-style decode, one batched call over the paged context gathered through
  the block table, keys past each ``context_len`` masked;
- ChunkedPrefill / PrefillCacheHit / SpecDecoding: splitfuse. Host query lengths (numpy, from the metadata builder)
  split the batch; multi-token requests attend their paged context with the splitfuse mask (plain rows gathered at
  the absolute positions, or the compressed 2048 tile expanded per request), single-token requests take the PA path
  (their splitfuse row is all-visible, the same computation).

Padding rows (beyond ``num_actual_tokens``) are zero in the output. ``attn_metadata=None`` (dummy/profiling forward):
all rows form one causal sequence, no cache access — the SDPA backend's contract.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ascent.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from ascent.attention.backends.sdpa import _context_slots, paged_kv_cache_shape, write_plan
from ascent.attention.mask import AttentionMaskBuilder, causal_additive_mask

SUPPORTED_KERNEL_BLOCK_SIZES = (128, 64)


class A310PAttentionState(enum.Enum):
    """Per-step attention state (upstream ``AscendAttentionState``)."""

    PREFILL_NO_CACHE = "PrefillNoCache"
    PREFILL_CACHE_HIT = "PrefillCacheHit"
    DECODE_ONLY = "DecodeOnly"
    CHUNKED_PREFILL = "ChunkedPrefill"
    SPEC_DECODING = "SpecDecoding"


SPLITFUSE_STATES = (
    A310PAttentionState.CHUNKED_PREFILL,
    A310PAttentionState.PREFILL_CACHE_HIT,
    A310PAttentionState.SPEC_DECODING,
)


def attention_state(query_lens: np.ndarray, num_computed: np.ndarray, chunked_prefill: bool = True,
                    num_spec_tokens: int = 0) -> A310PAttentionState:
    """The §3.1 state of a step from host query lengths and cached-token counts (both ``[B]``)."""
    if np.all(num_computed == 0):
        return A310PAttentionState.PREFILL_NO_CACHE
    if np.all(query_lens == 1):
        return A310PAttentionState.DECODE_ONLY
    if num_spec_tokens > 0 and np.all(query_lens == 1 + num_spec_tokens):
        return A310PAttentionState.SPEC_DECODING
    return A310PAttentionState.CHUNKED_PREFILL if chunked_prefill else A310PAttentionState.PREFILL_CACHE_HIT


@dataclass
class A310PRequest:
    """A multi-token request: token rows ``start:end`` at positions ``seq_len - (end-start) .. seq_len - 1``.

    ``context_slots`` (int64 ``[seq_len]`` cache slots) is set in the splitfuse states only.
    """

    index: int
    start: int
    end: int
    seq_len: int
    context_slots: torch.Tensor | None


@dataclass
class A310PDecodePlan:
    """PA-style decode of the single-token requests ``req_indices``: query rows ``rows`` (int64, device), cache
    ``slots`` ``[n, max_len]`` (padding repeats a valid slot), ``context_lens`` int64 ``[n]`` on device."""

    req_indices: np.ndarray
    rows: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    uniform: bool


@dataclass
class A310PMetadata:
    """Per-step metadata of the compatibility backend (shared by all layers).

    ``query_lens_cpu``: host int32 ``[B]`` query lengths (splitfuse states; a view of the builder's persistent buffer
    unless built for drafting); ``seq_lens`` int32 ``[B]`` device context lengths. Masks are built lazily per
    (dtype, window) by :meth:`masks` and cached here.
    """

    state: A310PAttentionState
    num_actual_tokens: int
    write_slots: torch.Tensor
    write_rows: torch.Tensor | None
    query_lens_cpu: np.ndarray | None
    seq_lens_np: np.ndarray
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    requests: list[A310PRequest]
    decode: A310PDecodePlan | None
    mask_builder: AttentionMaskBuilder
    compressed_mask: bool
    _masks: dict[tuple[torch.dtype, int | None], tuple[list[torch.Tensor], torch.Tensor | None]] = field(
        default_factory=dict)

    def masks(self, dtype: torch.dtype, window: int | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(per multi-token request ``[q_len, seq_len]`` additive masks, decode mask ``[n, 1, 1, max_len]`` or
        None when every decode sees its whole padded row)."""
        key = (dtype, window)
        if key not in self._masks:
            self._masks[key] = (self._request_masks(dtype, window), self._decode_mask(dtype, window))
        return self._masks[key]

    def _request_masks(self, dtype: torch.dtype, window: int | None) -> list[torch.Tensor]:
        mb, device = self.mask_builder, self.block_table.device
        if self.state == A310PAttentionState.PREFILL_NO_CACHE:
            return [mb.causal_mask(r.seq_len, None, dtype, device, window) for r in self.requests]
        if not self.requests:
            return []
        if self.compressed_mask and window is None:
            return [mb.expand_compressed(r.end - r.start, r.seq_len, dtype, device) for r in self.requests]
        q_lens = np.array([r.end - r.start for r in self.requests], dtype=np.int64)
        seq_lens = np.array([r.seq_len for r in self.requests], dtype=np.int64)
        rows = mb.splitfuse_mask(q_lens, seq_lens, dtype, device, window)
        bounds = np.concatenate([[0], np.cumsum(q_lens)])
        return [rows[bounds[i] : bounds[i + 1], : r.seq_len] for i, r in enumerate(self.requests)]

    def _decode_mask(self, dtype: torch.dtype, window: int | None) -> torch.Tensor | None:
        d = self.decode
        if d is None or (d.uniform and window is None):
            return None
        mask = self.mask_builder.key_padding_mask(d.context_lens, d.slots.shape[1], dtype, window)
        return mask.view(len(d.req_indices), 1, 1, -1)


class A310PMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`A310PMetadata` from host-side lengths (§3.5).

    ``max_model_len`` sizes the mask builder's bound; ``compressed_mask`` selects the compressed splitfuse tile;
    ``chunked_prefill`` / ``num_spec_tokens`` refine the state names (all splitfuse states run the same path);
    ``max_num_seqs`` sizes the persistent host query-length buffer (grown if a batch is larger).
    """

    def __init__(self, max_model_len: int | None = None, compressed_mask: bool = False, chunked_prefill: bool = True,
                 num_spec_tokens: int = 0, max_num_seqs: int = 256) -> None:
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.mask_builder = AttentionMaskBuilder(max_model_len)
        self.compressed_mask = compressed_mask
        self.chunked_prefill = chunked_prefill
        self.num_spec_tokens = num_spec_tokens
        self._query_lens_buf = np.zeros(max_num_seqs, dtype=np.int32)

    def build(self, common: CommonAttentionMetadata) -> A310PMetadata:
        num_reqs = common.num_reqs
        qsl = common.query_start_loc_np[: num_reqs + 1].astype(np.int64)
        seq_lens = common.seq_lens_np[:num_reqs].astype(np.int64)
        computed = common.num_computed_tokens_np[:num_reqs].astype(np.int64)
        query_lens = np.diff(qsl)
        if np.any(computed + query_lens != seq_lens):
            raise ValueError(f"seq_lens {seq_lens.tolist()} != num_computed {computed.tolist()} + query lens "
                             f"{query_lens.tolist()}")
        state = attention_state(query_lens, computed, self.chunked_prefill, self.num_spec_tokens)
        write_slots, write_rows = write_plan(common.slot_mapping)
        md = A310PMetadata(state, common.num_actual_tokens, write_slots, write_rows, None,
                           seq_lens, common.seq_lens[:num_reqs], common.block_table, [], None, self.mask_builder,
                           self.compressed_mask)
        if state == A310PAttentionState.PREFILL_NO_CACHE:
            md.requests = [A310PRequest(i, int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), None)
                           for i in range(num_reqs) if query_lens[i] > 0]
            return md
        if state in SPLITFUSE_STATES:
            md.query_lens_cpu = query_lens = self._host_query_lens(qsl)
        single = np.flatnonzero(query_lens == 1)
        if len(single):
            md.decode = _plan_decode(common, single, qsl, seq_lens)
        for i in np.flatnonzero(query_lens > 1):
            slots = _context_slots(common.block_table[i : i + 1], common.block_size, int(seq_lens[i]))[0]
            md.requests.append(A310PRequest(int(i), int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), slots))
        return md

    def build_for_drafting(self, common: CommonAttentionMetadata) -> A310PMetadata:
        """Like :meth:`build`, with the host query lengths copied out of the persistent buffer (the next drafting
        step reuses the buffer while this metadata may still be read)."""
        md = self.build(common)
        if md.query_lens_cpu is not None:
            md.query_lens_cpu = md.query_lens_cpu.copy()
        return md

    def _host_query_lens(self, qsl: np.ndarray) -> np.ndarray:
        num_reqs = len(qsl) - 1
        if num_reqs > len(self._query_lens_buf):
            self._query_lens_buf = np.zeros(max(num_reqs, 2 * len(self._query_lens_buf)), dtype=np.int32)
        out = self._query_lens_buf[:num_reqs]
        np.subtract(qsl[1:], qsl[:-1], out=out, casting="unsafe")
        return out


def _plan_decode(common: CommonAttentionMetadata, req_indices: np.ndarray, qsl: np.ndarray,
                 seq_lens: np.ndarray) -> A310PDecodePlan:
    device = common.block_table.device
    lens = seq_lens[req_indices]
    max_len = int(lens.max())
    table = common.block_table.index_select(0, torch.from_numpy(req_indices).to(device))
    slots = _context_slots(table, common.block_size, max_len)
    context_lens = torch.from_numpy(lens).to(device)
    uniform = int(lens.min()) == max_len
    if not uniform:
        valid = torch.arange(max_len, device=device).unsqueeze(0) < context_lens.unsqueeze(1)
        slots = torch.where(valid, slots, slots[:, :1])
    rows = torch.from_numpy(qsl[req_indices]).to(device)
    return A310PDecodePlan(req_indices, rows, slots, context_lens, uniform)


class A310PImpl(AttentionImpl):
    """See the module docstring; ``sliding_window`` is honoured through the masks (the compressed tile has no
    window, so windowed layers use the plain splitfuse mask)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: A310PMetadata | None,
    ) -> torch.Tensor:
        """q ``[T, nh*d]``, k/v ``[T, nkv*d]`` (fp16 on the 310P profile; any float dtype) -> ``[T, nh*d]``."""
        if attn_metadata is None:
            mask = causal_additive_mask(q.shape[0], q.dtype, q.device, self.sliding_window)
            return self._attend(q, self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads), mask)
        if kv_cache.numel() == 0:
            raise RuntimeError("attention layer has no KV cache allocated but attention metadata was given")
        md = attn_metadata
        k_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        v_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        self._write(k, v, kv_cache, md)
        out = q.new_zeros(q.shape[0], self.num_heads * self.head_size)
        request_masks, decode_mask = md.masks(q.dtype, self.sliding_window)
        if md.state == A310PAttentionState.PREFILL_NO_CACHE:
            self._forward_prefill(q, k, v, md, request_masks, out)
            return out
        if md.decode is not None:
            self._forward_paged_decode(q, k_cache, v_cache, md.decode, decode_mask, out)
        self._forward_splitfuse(q, k_cache, v_cache, md, request_masks, out)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: A310PMetadata) -> None:
        """KV write through the 310P device adaptor (host-planned block/offset pairs, no fused scatter kernel)."""
        k = k.reshape(-1, self.num_kv_heads, self.head_size)
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        if md.write_rows is not None:
            k, v = k.index_select(0, md.write_rows), v.index_select(0, md.write_rows)
        _compat_adaptor().reshape_and_cache(k, v, kv_cache[0], kv_cache[1], md.write_slots)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``[L, num_heads*d]`` -> ``[1, num_heads, L, d]``."""
        return x.reshape(1, x.shape[0], num_heads, self.head_size).transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q rows ``[n, nh*d]`` against k/v ``[1, nkv, L, d]`` with the additive mask ``[n, L]`` -> ``[n, nh*d]``."""
        o = F.scaled_dot_product_attention(
            self._heads(q, self.num_heads), k, v, attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_size)

    def _forward_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: A310PMetadata,
                         masks: list[torch.Tensor], out: torch.Tensor) -> None:
        """FA-style: each request attends its own fresh K/V (no cache read) under its causal mask."""
        for r, mask in zip(md.requests, masks):
            rows = slice(r.start, r.end)
            kh, vh = self._heads(k[rows], self.num_kv_heads), self._heads(v[rows], self.num_kv_heads)
            out[rows] = self._attend(q[rows], kh, vh, mask)

    def _forward_paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              d: A310PDecodePlan, mask: torch.Tensor | None, out: torch.Tensor) -> None:
        """PA-style: one query per request over its paged context; query heads of a KV head share one K/V row."""
        n, group = len(d.req_indices), self.num_heads // self.num_kv_heads
        qd = q.index_select(0, d.rows).reshape(n, self.num_kv_heads, group, self.head_size)
        shape = (n, d.slots.shape[1], self.num_kv_heads, self.head_size)
        flat = d.slots.reshape(-1)
        kd = k_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
        vd = v_cache.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scale)
        out.index_copy_(0, d.rows, o.reshape(n, self.num_heads * self.head_size))

    def _forward_splitfuse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: A310PMetadata,
                           masks: list[torch.Tensor], out: torch.Tensor) -> None:
        """Multi-token requests over their paged context (cached prefix + this step's tokens) with splitfuse masks."""
        for r, mask in zip(md.requests, masks):
            assert r.context_slots is not None
            kc = k_cache.index_select(0, r.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vc = v_cache.index_select(0, r.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            out[r.start : r.end] = self._attend(q[r.start : r.end], kc, vc, mask)


class A310PBackend(AttentionBackend):
    """The compatibility backend selected by the 310P profile (``get_attn_backend("compat310p")``)."""

    @staticmethod
    def get_name() -> str:
        return "compat310p"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return paged_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes() -> tuple[int, ...]:
        """Kernel block sizes of the 310P paged kernels (the profile restricts ``block_size`` to these)."""
        return SUPPORTED_KERNEL_BLOCK_SIZES

    @staticmethod
    def get_builder_cls() -> type[A310PMetadataBuilder]:
        return A310PMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[A310PImpl]:
        return A310PImpl


@functools.lru_cache(maxsize=1)
def _compat_adaptor() -> "A310PDeviceAdaptor":
    from ascent.platform.adaptor import A310PDeviceAdaptor

    return A310PDeviceAdaptor()
