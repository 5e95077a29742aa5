"""MLA (multi-head latent attention, DeepSeek-V2/V3) over a paged latent cache.

KV cache per layer: one tensor ``[num_blocks, block_size, 1, L + R]`` (L = kv_lora_rank, R = qk_rope_head_dim) in
the model dtype; a slot holds the normalised latent ``c_kv`` (first L values) and the roped shared key ``k_pe``
(last R values). With ``W_UK[h]`` ``[nope, L]`` and ``W_UV[h]`` ``[v, L]`` the per-head slices of ``kv_b_proj``:

    k[t, h] = [W_UK[h] c[t], k_pe[t]],   v[t, h] = W_UV[h] c[t]
    score(s, t, h) = scale * (q_nope[s, h] . W_UK[h] c[t] + q_pe[s, h] . k_pe[t])
                   = scale * ((W_UK[h]^T q_nope[s, h]) . c[t] + q_pe[s, h] . k_pe[t])

- decode (query length 1): weight-absorbed: the query is moved into the latent space (``q_nope @ W_UK``), attention
  runs as MQA over the cached ``[c_kv, k_pe]`` rows with ``c_kv`` as the value, and the latent output goes through
  ``W_UV``. All decodes run in one SDPA call (heads on the query-length axis, key padding masked).
- prefill (query length > 1): the new tokens' K/V are up-projected (``kv_b_proj``) and attended causally; a cached
  prefix (prefix-cache hit, chunked prefill) is read in context chunks bounded by a workspace, each chunk gathered
  from the cache, up-projected and attended without a mask; the partial results are merged by log-sum-exp.
This step's latents are written into the cache first (rows with slot -1 are skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ascent.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from ascent.platform.ops_utils import paged_slots

MAX_WORKSPACE_TOKENS = 128 * 1024


@dataclass
class MLAPrefill:
    """One multi-token request: batch index ``req``, token rows ``start:end`` at positions
    ``num_computed .. seq_len-1``; positions ``0 .. num_computed-1`` are read from the cache in context chunks."""

    req: int
    start: int
    end: int
    num_computed: int
    seq_len: int


@dataclass
class MLAContextChunk:
    """One round of context gathering: prefill ``prefill_idx[j]`` reads cached positions ``[chunk_start,
    chunk_start + n_j)``, which are rows ``offsets[j]:offsets[j+1]`` of the gathered ``slots`` (int64)."""

    chunk_start: int
    slots: torch.Tensor
    prefill_idx: list[int]
    offsets: list[int]


@dataclass
class MLAMetadata:
    """Per-step MLA metadata (shared by all MLA layers).

    write_slots: int64 cache slots of the latent rows ``write_rows`` (None = rows ``0..len(write_slots)-1``).
    decode_rows: int64 ``[num_decodes]`` token rows of the decode requests; decode_slots: int64
    ``[num_decodes, max_len]`` cache slots per context position (padding repeats a valid slot); decode_mask: bool
    ``[num_decodes, 1, 1, max_len]`` (None = no padding).
    prefills: multi-token requests; context_chunks: the chunked reads of their cached prefixes.
    """

    num_actual_tokens: int
    write_slots: torch.Tensor
    write_rows: torch.Tensor | None
    num_decodes: int = 0
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[MLAPrefill] = field(default_factory=list)
    context_chunks: list[MLAContextChunk] = field(default_factory=list)


def context_workspace_tokens(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """Token capacity of the context-chunk workspace: ``max(min(max(8*max_model_len, 4*max_num_seqs*bs), 128Ki),
    max_num_seqs*bs)``."""
    return max(min(max(8 * max_model_len, 4 * max_num_seqs * block_size), MAX_WORKSPACE_TOKENS),
               max_num_seqs * block_size)


def _decode_slots(block_rows: torch.Tensor, lens: torch.Tensor, block_size: int,
                  max_len: int) -> torch.Tensor:
    """int64 ``[N, max_len]`` slots of positions ``0..max_len-1`` (positions past a request's length repeat its
    last valid slot)."""
    pos = torch.arange(max_len, device=block_rows.device).unsqueeze(0)
    pos = torch.minimum(pos, lens.unsqueeze(1) - 1)
    blocks = block_rows.to(torch.int64).gather(1, pos // block_size)
    return blocks * block_size + pos % block_size


class MLAMetadataBuilder(AttentionMetadataBuilder):
    """Builds ``MLAMetadata`` from host-side lengths.

    ``workspace_tokens`` caps the cached-context tokens gathered per chunk over all prefills (default: the
    :func:`context_workspace_tokens` formula); each prefill with context reads ``workspace // n`` tokens per
    chunk, rounded down to whole blocks (at least one block).
    """

    def __init__(self, max_model_len: int = 8192, max_num_seqs: int = 256,
                 workspace_tokens: int | None = None) -> None:
        if workspace_tokens is not None and workspace_tokens < 1:
            raise ValueError(f"workspace_tokens must be >= 1, got {workspace_tokens}")
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.workspace_tokens = workspace_tokens

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        qsl = common.query_start_loc_np[: common.num_reqs + 1].astype(np.int64)
        seq_lens = common.seq_lens_np[: common.num_reqs].astype(np.int64)
        computed = common.num_computed_tokens_np[: common.num_reqs].astype(np.int64)
        query_lens = np.diff(qsl)
        if np.any(computed + query_lens != seq_lens):
            raise ValueError(f"seq_lens {seq_lens.tolist()} != num_computed {computed.tolist()} + query lens "
                             f"{query_lens.tolist()}")
        valid = common.slot_mapping >= 0
        write_rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        write_slots = common.slot_mapping if write_rows is None else common.slot_mapping.index_select(0, write_rows)
        md = MLAMetadata(common.num_actual_tokens, write_slots.to(torch.int64), write_rows)
        decode_idx = np.flatnonzero(query_lens == 1)
        if len(decode_idx):
            self._plan_decodes(md, common, decode_idx, qsl, seq_lens)
        md.prefills = [MLAPrefill(int(i), int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(seq_lens[i]))
                       for i in np.flatnonzero(query_lens > 1)]
        md.context_chunks = self._plan_context(md.prefills, common)
        return md

    @staticmethod
    def _plan_decodes(md: MLAMetadata, common: CommonAttentionMetadata, decode_idx: np.ndarray, qsl: np.ndarray,
                      seq_lens: np.ndarray) -> None:
        device = common.block_table.device
        lens = seq_lens[decode_idx]
        max_len = int(lens.max())
        if -(-max_len // common.block_size) > common.block_table.shape[1]:
            raise ValueError(f"context of {max_len} tokens needs more than {common.block_table.shape[1]} blocks")
        lens_t = torch.from_numpy(lens).to(device)
        table = common.block_table.index_select(0, torch.from_numpy(decode_idx).to(device))
        md.num_decodes = len(decode_idx)
        md.decode_rows = torch.from_numpy(qsl[decode_idx]).to(device)
        md.decode_slots = _decode_slots(table, lens_t, common.block_size, max_len)
        if int(lens.min()) < max_len:
            mask = torch.arange(max_len, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
            md.decode_mask = mask.view(len(decode_idx), 1, 1, max_len)

    def _chunk_len(self, num_with_context: int, block_size: int) -> int:
        workspace = self.workspace_tokens or context_workspace_tokens(self.max_model_len, self.max_num_seqs,
                                                                      block_size)
        return max(block_size, workspace // num_with_context // block_size * block_size)

    def _plan_context(self, prefills: list[MLAPrefill], common: CommonAttentionMetadata) -> list[MLAContextChunk]:
        with_ctx = [j for j, p in enumerate(prefills) if p.num_computed > 0]
        if not with_ctx:
            return []
        chunk_len = self._chunk_len(len(with_ctx), common.block_size)
        device = common.block_table.device
        chunks = []
        for start in range(0, max(prefills[j].num_computed for j in with_ctx), chunk_len):
            idx = [j for j in with_ctx if prefills[j].num_computed > start]
            lens = [min(chunk_len, prefills[j].num_computed - start) for j in idx]
            rows = torch.tensor([prefills[j].req for j in idx], dtype=torch.int64, device=device)
            slots, _ = paged_slots(common.block_table.index_select(0, rows), lens, common.block_size,
                                   [start] * len(idx))
            chunks.append(MLAContextChunk(start, slots, idx, np.concatenate([[0], np.cumsum(lens)]).tolist()))
        return chunks


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence returning its log-sum-exp.

    q ``[Lq, H, D]``, k ``[Lk, H, D]``, v ``[Lk, H, Dv]``; ``causal``: bottom-right aligned (query i sees keys
    ``j <= Lk - Lq + i``; requires ``Lk >= Lq``). Computed in at least float32. Returns (out ``[Lq, H, Dv]``,
    lse ``[H, Lq]``), both in ``promote_types(q.dtype, float32)``.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    qh, kh, vh = (x.to(dtype).transpose(0, 1) for x in (q, k, v))
    scores = torch.bmm(qh, kh.transpose(1, 2)) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        if lk < lq:
            raise ValueError(f"causal attention needs at least as many keys ({lk}) as queries ({lq})")
        q_pos = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
        scores = scores.masked_fill(torch.arange(lk, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse.unsqueeze(-1)), vh)
    return out.transpose(0, 1), lse


def merge_attention_states(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint key sets: parts of (out ``[Lq, H, Dv]``, lse ``[H, Lq]``).

    ``lse* = logsumexp_i lse_i``, ``out = sum_i exp(lse_i - lse*) * out_i`` (in the parts' dtype, at least fp32).
    Returns (out, lse*).
    """
    if not parts:
        raise ValueError("merge_attention_states needs at least one partial result")
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    out = torch.zeros_like(parts[0][0], dtype=torch.promote_types(parts[0][0].dtype, torch.float32))
    for o, lse in parts:
        out += torch.exp(lse - total).transpose(0, 1).unsqueeze(-1) * o
    return out, total


class MLAImpl:
    """Per-layer MLA computation (see the module docstring).

    Shapes: H local heads, N = qk_nope_head_dim, R = qk_rope_head_dim, L = kv_lora_rank, V = v_head_dim.
    ``set_weights`` must be called once after loading with the ``kv_b_proj`` slices.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.w_uk: torch.Tensor | None = None
        self.w_uv_t: torch.Tensor | None = None
        self.up_proj: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_weights(self, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    up_proj: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """w_uk ``[H, N, L]``, w_uv ``[H, V, L]`` (slices of kv_b_proj viewed as ``[H, N+V, L]``). ``up_proj``
        maps latents ``[T, L]`` to ``[T, H*(N+V)]`` for prefill (default: a matmul with the same weights; the
        layer passes its ``kv_b_proj`` so quantized projections stay exact)."""
        expected = (self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank)
        if tuple(w_uk.shape) != expected or tuple(w_uv.shape) != (self.num_heads, self.v_head_dim, self.kv_lora_rank):
            raise ValueError(f"w_uk {tuple(w_uk.shape)} / w_uv {tuple(w_uv.shape)} do not match heads={self.num_heads}"
                             f", nope={self.qk_nope_head_dim}, v={self.v_head_dim}, kv_lora_rank={self.kv_lora_rank}")
        self.w_uk = w_uk.contiguous()
        self.w_uv_t = w_uv.transpose(1, 2).contiguous()
        if up_proj is None:
            full = torch.cat([w_uk, w_uv], dim=1).reshape(-1, self.kv_lora_rank)
            up_proj = lambda c: F.linear(c, full.to(c.dtype))  # noqa: E731
        self.up_proj = up_proj

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: MLAMetadata | None) -> torch.Tensor:
        """q_nope ``[T, H, N]``, q_pe ``[T, H, R]`` (roped), c_kv ``[T, L]`` (normalised), k_pe ``[T, R]`` (roped)
        -> ``[T, H*V]`` in q_nope's dtype. Rows past ``num_actual_tokens`` (padding) are zero.

        ``attn_metadata=None`` (dummy/profiling forward): all T rows form one causal sequence, no cache access.
        """
        if self.w_uk is None or self.w_uv_t is None:
            raise RuntimeError("MLAImpl.set_weights was not called (process_weights_after_loading missing)")
        num_tokens = q_nope.shape[0]
        if attn_metadata is None:
            return self._prefill_fresh(q_nope, q_pe, c_kv, k_pe).reshape(num_tokens, -1)
        if kv_cache.numel() == 0:
            raise RuntimeError("MLA layer has no KV cache allocated but attention metadata was given")
        cache = kv_cache.view(-1, self.kv_lora_rank + self.qk_rope_head_dim)
        self._write(c_kv, k_pe, cache, attn_metadata)
        out = q_nope.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        if attn_metadata.num_decodes:
            assert attn_metadata.decode_rows is not None
            out.index_copy_(0, attn_metadata.decode_rows, self._decode(q_nope, q_pe, cache, attn_metadata))
        if attn_metadata.prefills:
            self._prefill(q_nope, q_pe, c_kv, k_pe, cache, attn_metadata, out)
        if num_tokens > attn_metadata.num_actual_tokens:
            out[attn_metadata.num_actual_tokens :].zero_()
        return out.view(num_tokens, self.num_heads * self.v_head_dim)

    def _write(self, c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, md: MLAMetadata) -> None:
        latent = torch.cat([c_kv, k_pe], dim=-1)
        if md.write_rows is not None:
            latent = latent.index_select(0, md.write_rows)
        else:
            latent = latent[: md.write_slots.shape[0]]
        cache.index_copy_(0, md.write_slots, latent.to(cache.dtype))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                md: MLAMetadata) -> torch.Tensor:
        """Absorbed decode: ``[num_decodes, H, V]``."""
        assert md.decode_rows is not None and md.decode_slots is not None and self.w_uk is not None
        n, max_len = md.decode_slots.shape
        qn = q_nope.index_select(0, md.decode_rows)
        q_lat = torch.bmm(qn.transpose(0, 1), self.w_uk.to(qn.dtype)).transpose(0, 1)
        q = torch.cat([q_lat, q_pe.index_select(0, md.decode_rows)], dim=-1).unsqueeze(1)
        kv = cache.index_select(0, md.decode_slots.view(-1)).view(n, 1, max_len, -1).to(q.dtype)
        o = F.scaled_dot_product_attention(q, kv, kv[..., : self.kv_lora_rank], attn_mask=md.decode_mask,
                                           scale=self.scale)
        return torch.bmm(o[:, 0].transpose(0, 1), self.w_uv_t.to(o.dtype)).transpose(0, 1)

    def _up(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[t, L]`` + ``[t, R]`` -> per-head keys ``[t, H, N+R]`` and values ``[t, H, V]``."""
        assert self.up_proj is not None
        kv = self.up_proj(c_kv).view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_pe.unsqueeze(1).expand(-1, self.num_heads, -1).to(k_nope.dtype)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _prefill_fresh(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                       k_pe: torch.Tensor) -> torch.Tensor:
        """Causal attention of rows that form one whole sequence: ``[t, H, V]``."""
        k, v = self._up(c_kv, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale)
        return o[0].transpose(0, 1)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 cache: torch.Tensor, md: MLAMetadata, out: torch.Tensor) -> None:
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        queries: dict[int, torch.Tensor] = {}
        for j, p in enumerate(md.prefills):
            rows = slice(p.start, p.end)
            if p.num_computed == 0:
                out[rows] = self._prefill_fresh(q_nope[rows], q_pe[rows], c_kv[rows], k_pe[rows])
                continue
            queries[j] = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)
            k, v = self._up(c_kv[rows], k_pe[rows])
            parts[j] = [attention_with_lse(queries[j], k, v, self.scale, causal=True)]
        for chunk in md.context_chunks:
            latent = cache.index_select(0, chunk.slots).to(q_nope.dtype)
            k, v = self._up(*latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1))
            for j, a, b in zip(chunk.prefill_idx, chunk.offsets[:-1], chunk.offsets[1:]):
                parts[j].append(attention_with_lse(queries[j], k[a:b], v[a:b], self.scale, causal=False))
        for j, partials in parts.items():
            p = md.prefills[j]
            out[p.start : p.end] = merge_attention_states(partials)[0].to(out.dtype)


class MLABackend(AttentionBackend):
    """Latent-cache attention for DeepSeek-style MLA layers (``num_kv_heads`` 1, ``head_size`` L + R)."""

    @staticmethod
    def get_name() -> str:
        return "MLA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(f"MLA caches one latent per token: num_kv_heads must be 1, got {num_kv_heads}")
        return (num_blocks, block_size, 1, head_size)

    @staticmethod
    def kv_cache_block_dim() -> int:
        return 0

    @staticmethod
    def get_builder_cls() -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[MLAImpl]:  # type: ignore[override]
        return MLAImpl
