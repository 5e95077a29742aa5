"""DeviceAdaptor: the stateless operator facade of specs/device_ops.md §2, with torch bodies.

``get_device_adaptor(profile)`` picks the class by ``profile.device_adaptor``: STANDARD -> :class:`DeviceAdaptor`,
FP8_OPTIMIZED -> :class:`A5DeviceAdaptor`, COMPATIBILITY -> :class:`A310PDeviceAdaptor`. Overrides change the
algorithm, never the result (except the MX quant path, which only A5 has).

Conventions: T tokens, N requests, Hq/Hkv query/kv heads, D head size, paged caches ``[num_blocks, block_size, Hkv,
D]`` (one tensor for K, one for V; contiguous), slots ``block * block_size + offset`` with -1 = padding. Per-request
lengths may be lists, numpy arrays or tensors (tensors are read on the host).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ascent.platform.ops_utils import (
    IntSeq,
    attend,
    gather_slots,
    group_ranges,
    paged_slots,
    swiglu,
    symmetric_quant,
    to_int_list,
)
from ascent.platform.profile import DeviceAdaptorFamily, HardwareProfile, WeightLayoutPolicy

MXFP_BLOCK = 32
_FP8_E4M3_EMAX = 8
_MXFP_ONLY_A5 = "MXFP MoE quantization is only supported on Ascend A5."


class MoERouting(NamedTuple):
    """Result of :meth:`DeviceAdaptor.moe_init_routing` (R = kept rows, E = local experts)."""

    expanded_x: torch.Tensor  # [R, H] token rows sorted by expert (stable: token-major within an expert)
    expanded_row_idx: torch.Tensor  # int32 [T*k]: row of (t, j) in expanded_x, -1 when dropped
    expert_tokens: torch.Tensor  # int64 [E]: rows per expert (type 1) or their cumulative sum (type 0)
    expanded_scale: torch.Tensor | None  # float32 [R] per-row dequant scale, or None


def _check_cache_io(key: torch.Tensor, cache: torch.Tensor) -> None:
    if key.dim() != 3 or cache.dim() != 4 or key.shape[1:] != cache.shape[2:]:
        raise ValueError(f"key {tuple(key.shape)} must be [T, Hkv, D] matching cache {tuple(cache.shape)} "
                         f"[num_blocks, block_size, Hkv, D]")
    if not cache.is_contiguous():
        raise ValueError("KV cache tensors must be contiguous (writes go through a flat view)")


class DeviceAdaptor:
    """Reference (STANDARD) implementations; every method is a pure function of its arguments."""

    family = DeviceAdaptorFamily.STANDARD

    # ----- KV cache -----
    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write K/V rows into the paged caches: for each row t with ``s = slot_mapping[t] >= 0``,
        ``cache[s // bs, s % bs] = key[t]``. key/value ``[T, Hkv, D]``; slot_mapping int ``[S]`` (S <= T; rows
        past S are padding); values are cast to the cache dtype."""
        _check_cache_io(key, key_cache)
        _check_cache_io(value, value_cache)
        slots = slot_mapping.reshape(-1).to(key_cache.device)
        rows = (slots >= 0).nonzero().squeeze(1)
        dst = slots.index_select(0, rows).to(torch.int64)
        for src, cache in ((key, key_cache), (value, value_cache)):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst, src.index_select(0, rows.to(src.device)).to(cache.dtype).to(cache.device))

    def gather_paged_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: IntSeq, seq_starts: IntSeq | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Paged -> dense (TND): tokens ``[start_i, start_i + len_i)`` of each request, concatenated.

        Returns (k ``[sum(len), Hkv, D]``, v ``[sum(len), Hkv, Dv]``, cu_seqlens int32 ``[N+1]``).
        """
        lens = to_int_list(seq_lens, "seq_lens")
        starts = to_int_list(seq_starts, "seq_starts") if seq_starts is not None else None
        slots, cu = paged_slots(block_table, lens, key_cache.shape[1], starts)
        return gather_slots(key_cache, slots), gather_slots(value_cache, slots), cu

    def kv_cache_load(self, cache_a: torch.Tensor, cache_b: torch.Tensor, block_table: torch.Tensor,
                      lens: IntSeq, seq_starts: IntSeq | None = None, out_a: torch.Tensor | None = None,
                      out_b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked-prefill context load (MLA: latent + rope caches ``[num_blocks, bs, *rest]``): tokens
        ``[start_i, start_i + len_i)`` of each request into dense ``[sum(len), *rest]`` buffers (written into
        ``out_a`` / ``out_b`` when given; their first ``sum(len)`` rows)."""
        a, b, _ = self.gather_paged_kv(cache_a, cache_b, block_table, lens, seq_starts)
        if out_a is not None:
            out_a[: a.shape[0]].copy_(a)
            a = out_a[: a.shape[0]]
        if out_b is not None:
            out_b[: b.shape[0]].copy_(b)
            b = out_b[: b.shape[0]]
        return a, b

    def index_fill(self, x: torch.Tensor, dim: int, index: torch.Tensor, value: float) -> torch.Tensor:
        """In-place ``x.index_fill_(dim, index, value)``; returns x. Negative indices count from the end."""
        idx = index.reshape(-1).to(device=x.device, dtype=torch.int64)
        idx = torch.where(idx < 0, idx + x.shape[dim], idx)
        return x.index_fill_(dim, idx, value)

    # ----- attention -----
    def paged_attention_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: IntSeq, scale: float) -> torch.Tensor:
        """One query token per request over its whole cached context (no mask beyond the length).

        query ``[N, Hq, D]``; block_table int ``[N, max_blocks]``; seq_lens ``[N]`` (>= 1, context incl. the
        query token, already in the cache) -> ``[N, Hq, Dv]`` in query's dtype. GQA when Hq > Hkv.
        """
        lens = to_int_list(seq_lens, "seq_lens")
        n, bs = query.shape[0], key_cache.shape[1]
        if len(lens) != n or min(lens, default=1) < 1:
            raise ValueError(f"seq_lens {lens} must hold one length >= 1 per query row ({n})")
        device = block_table.device
        max_len = max(lens, default=1)
        if -(-max_len // bs) > block_table.shape[1]:
            raise ValueError(f"seq_len {max_len} needs more than {block_table.shape[1]} blocks of {bs}")
        lens_t = torch.tensor(lens, device=device)
        pos = torch.minimum(torch.arange(max_len, device=device).unsqueeze(0), lens_t.unsqueeze(1) - 1)
        slots = block_table[:n].to(torch.int64).gather(1, pos // bs) * bs + pos % bs
        k = gather_slots(key_cache, slots.reshape(-1)).view(n, max_len, *key_cache.shape[2:]).transpose(1, 2)
        v = gather_slots(value_cache, slots.reshape(-1)).view(n, max_len, *value_cache.shape[2:]).transpose(1, 2)
        mask = (torch.arange(max_len, device=device).unsqueeze(0) < lens_t.unsqueeze(1)).view(n, 1, 1, max_len)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.unsqueeze(2), k.to(query.dtype), v.to(query.dtype), attn_mask=mask.to(query.device), scale=scale,
            enable_gqa=query.shape[1] != k.shape[1])
        return out.squeeze(2)

    def large_head_prefill_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                     query_start_loc: IntSeq, scale: float, seq_lens: IntSeq | None = None,
                                     key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
                                     block_table: torch.Tensor | None = None, causal: bool = True,
                                     prefill_no_cache: bool = False, query_chunk: int = 1024) -> torch.Tensor:
        """Varlen prefill for head sizes the fused kernels lack (head size 512): gather the paged KV into dense
        tensors, then chunked SDPA per request.

        query ``[T, Hq, D]`` (rows past ``query_start_loc[-1]`` are padding and dropped), key/value ``[T, Hkv, D]``
        (this step's tokens); query_start_loc ``[N+1]`` cumulative. With ``prefill_no_cache`` or no cache /
        seq_lens, each request attends over its own new K/V; otherwise over its whole context
        ``[0, seq_lens[i])`` gathered from the caches (which already hold this step's K/V). ``causal``:
        bottom-right aligned. Returns ``[query_start_loc[-1], Hq, Dv]`` in query's dtype.
        """
        qsl = to_int_list(query_start_loc, "query_start_loc")
        use_cache = not prefill_no_cache and key_cache is not None and value_cache is not None and seq_lens is not None
        if use_cache:
            if block_table is None:
                raise ValueError("block_table is required when attending over the paged cache")
            k_all, v_all, cu = self.gather_paged_kv(key_cache, value_cache, block_table, seq_lens)
            cu_kv = to_int_list(cu, "cu_seqlens")
        else:
            k_all, v_all, cu_kv = key[: qsl[-1]], value[: qsl[-1]], qsl
        out = query.new_empty(qsl[-1], query.shape[1], v_all.shape[-1])
        for i in range(len(qsl) - 1):
            out[qsl[i]: qsl[i + 1]] = attend(query[qsl[i]: qsl[i + 1]], k_all[cu_kv[i]: cu_kv[i + 1]],
                                             v_all[cu_kv[i]: cu_kv[i + 1]], scale, causal, query_chunk)
        return out

    # ----- MoE -----
    def moe_gating_top_k(self, x: torch.Tensor, *, k: int, k_group: int = 1, group_count: int = 1,
                         group_select_mode: int = 1, renorm: bool = True, norm_type: int = 0,
                         routed_scaling_factor: float = 1.0, eps: float = 1e-20, bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router top-k. x ``[T, E]`` logits. scores = softmax (norm_type 0) or sigmoid (1) in fp32; ``bias``
        ``[E]`` is added for selection only; with ``group_count`` > 1 only the ``k_group`` best groups (score =
        sum of the group's top-2 for mode 1, max for mode 0) stay eligible; top-k among them; ``renorm`` divides
        by (sum + eps); then × routed_scaling_factor. Returns (weights fp32 ``[T, k]``, ids int32 ``[T, k]``,
        scores fp32 ``[T, E]``)."""
        scores, ids = self._select_experts(x, k, k_group, group_count, group_select_mode, norm_type, bias)
        weights = scores.gather(1, ids)
        if renorm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        return weights * routed_scaling_factor, ids.to(torch.int32), scores

    def _select_experts(self, x: torch.Tensor, k: int, k_group: int, group_count: int, group_select_mode: int,
                        norm_type: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts = x.shape[-1]
        if norm_type not in (0, 1) or group_select_mode not in (0, 1):
            raise ValueError(f"norm_type={norm_type} / group_select_mode={group_select_mode} must be 0 or 1")
        if group_count < 1 or num_experts % group_count or not 1 <= k_group <= group_count:
            raise ValueError(f"group_count={group_count}, k_group={k_group} invalid for {num_experts} experts")
        if not 1 <= k <= k_group * (num_experts // group_count):
            raise ValueError(f"k={k} must be in [1, {k_group * (num_experts // group_count)}]")
        xf = x.float()
        scores = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
        choice = scores + bias.float() if bias is not None else scores
        if group_count > 1:
            grouped = choice.view(x.shape[0], group_count, -1)
            if group_select_mode == 1:
                group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            else:
                group_score = grouped.amax(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(k_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        return scores, choice.topk(k, dim=-1).indices

    def moe_init_routing(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: int,
                         active_num: int | None = None, expert_tokens_num_type: int = 1,
                         active_expert_range: tuple[int, int] | None = None, quant: bool = False,
                         scale: torch.Tensor | None = None) -> MoERouting:
        """Expand ``hidden_states [T, H]`` to one row per (token, choice) of ``topk_ids [T, k]``, sorted by
        expert id (stable, so token-major within an expert). Rows whose expert lies outside
        ``active_expert_range = [start, end)`` (expert parallelism) are dropped, then at most ``active_num`` rows
        are kept. ``expert_tokens`` counts rows per local expert (type 1) or cumulates them (type 0). ``quant``:
        per-row dynamic int8 quant of the expanded rows; ``scale [T]`` (already-quantized input): expanded per
        row. See :class:`MoERouting`."""
        start, end = active_expert_range if active_expert_range is not None else (0, num_experts)
        if not 0 <= start < end <= num_experts or expert_tokens_num_type not in (0, 1):
            raise ValueError(f"active_expert_range={active_expert_range} / expert_tokens_num_type="
                             f"{expert_tokens_num_type} invalid for {num_experts} experts")
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).to(torch.int64)
        local = (flat >= start) & (flat < end)
        order = torch.sort(torch.where(local, flat, torch.full_like(flat, num_experts)), stable=True).indices
        rows = order[: int(local.sum())]
        if active_num is not None:
            rows = rows[:active_num]
        token = rows // k
        row_idx = torch.full_like(flat, -1, dtype=torch.int32)
        row_idx[rows] = torch.arange(rows.numel(), device=flat.device, dtype=torch.int32)
        counts = torch.bincount(flat[rows] - start, minlength=end - start)
        expert_tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
        expanded = hidden_states.index_select(0, token)
        expanded_scale = scale.reshape(-1).index_select(0, token).float() if scale is not None else None
        if quant:
            expanded, expanded_scale = self.dynamic_quant(expanded)
        return MoERouting(expanded, row_idx, expert_tokens, expanded_scale)

    def moe_token_unpermute(self, expanded: torch.Tensor, expanded_row_idx: torch.Tensor,
                            probs: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`moe_init_routing`: ``out[t] = sum_j probs[t, j] * expanded[row(t, j)]`` (dropped rows
        contribute 0). expanded ``[R, H]``, expanded_row_idx ``[T*k]``, probs ``[T, k]`` -> ``[T, H]`` in
        expanded's dtype (fp32 accumulation)."""
        t, k = probs.shape
        rows = expanded_row_idx.reshape(t, k).to(torch.int64)
        valid = rows >= 0
        gathered = expanded.index_select(0, rows.clamp(min=0).reshape(-1)).view(t, k, -1).float()
        weights = torch.where(valid, probs.float(), torch.zeros_like(probs, dtype=torch.float32))
        return (gathered * weights.unsqueeze(-1)).sum(dim=1).to(expanded.dtype)

    # ----- quantization and grouped matmul -----
    def dynamic_quant(self, x: torch.Tensor, scale: torch.Tensor | None = None, *,
                      quant_dtype: torch.dtype = torch.int8, use_mxfp_quant: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token symmetric quant over the last dim: scale = max|x| / qmax (int8 127, fp8-e4m3 448), q =
        round(x / scale) (int8) or cast (fp8). x ``[..., H]`` -> (q ``[..., H]``, scale fp32 ``[...]``). Passthrough
        ``(x, scale)`` when ``scale`` is given. MX quant exists only on A5 (ValueError here)."""
        if use_mxfp_quant:
            raise ValueError(_MXFP_ONLY_A5)
        if scale is not None:
            return x, scale
        return symmetric_quant(x, quant_dtype)

    def maybe_normalize_mxfp_scale_layout(self, scale: torch.Tensor | None) -> torch.Tensor | None:
        """Identity outside A5."""
        return scale

    def grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor, group_list: IntSeq, *,
                       group_list_type: int = 1, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of group e (consecutive ranges from ``group_list``: counts for type 1, cumulative ends for type 0)
        times ``weight[e]``. x ``[R, K]``, weight ``[E, K, N]``, bias ``[E, N]`` -> ``[R, N]`` (rows after the last
        group are 0)."""
        out = x.new_zeros(x.shape[0], weight.shape[-1])
        for e, (s, t) in enumerate(group_ranges(group_list, group_list_type, weight.shape[0], x.shape[0])):
            if t > s:
                out[s:t] = x[s:t] @ weight[e] + (bias[e] if bias is not None else 0)
        return out

    def grouped_matmul_swiglu(self, x: torch.Tensor, weight: torch.Tensor, group_list: IntSeq, *,
                              group_list_type: int = 1, swiglu_limit: float = 0.0) -> torch.Tensor:
        """Fused gate/up projection: ``swiglu(grouped_matmul(x, weight))``; weight ``[E, K, 2I]`` (gate | up) ->
        ``[R, I]``."""
        return swiglu(self.grouped_matmul(x, weight, group_list, group_list_type=group_list_type), swiglu_limit)

    def _int_grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor, group_list: IntSeq,
                            group_list_type: int, weight_scale: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """int8 ``[R, K]`` x int8 ``[E, K, N]`` with exact integer accumulation, dequantized by
        ``x_scale [R] * weight_scale [E, N]`` -> fp32 ``[R, N]``."""
        if x.dtype != torch.int8 or weight.dtype != torch.int8:
            raise ValueError(f"x/weight dtypes {x.dtype}/{weight.dtype} must be int8")
        acc = self.grouped_matmul(x.double(), weight.double(), group_list, group_list_type=group_list_type)
        out = acc.float() * x_scale.reshape(-1, 1).float()
        for e, (s, t) in enumerate(group_ranges(group_list, group_list_type, weight.shape[0], x.shape[0])):
            out[s:t] *= weight_scale[e].float()
        return out

    def grouped_matmul_swiglu_quant(self, x: torch.Tensor, weight: torch.Tensor, group_list: IntSeq,
                                    weight_scale: torch.Tensor, x_scale: torch.Tensor, *, group_list_type: int = 1,
                                    swiglu_limit: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """W8A8 gate/up: h = dequant(x·W_e) (x_scale ``[R]`` per token, weight_scale ``[E, 2I]`` per channel) ->
        SwiGLU (optional clamp) -> dynamic int8 re-quant. Returns (q int8 ``[R, I]``, scale fp32 ``[R]``)."""
        h = self._int_grouped_matmul(x, weight, group_list, group_list_type, weight_scale, x_scale)
        return symmetric_quant(swiglu(h, swiglu_limit), torch.int8)

    def grouped_matmul_dequant(self, x: torch.Tensor, weight: torch.Tensor, group_list: IntSeq,
                               weight_scale: torch.Tensor, per_token_scale: torch.Tensor, *,
                               input_dtype: torch.dtype, group_list_type: int = 1) -> torch.Tensor:
        """W8A8 down projection (gmm2): dequant(x·W_e) with per-token and per-channel scales; x int8 ``[R, K]``,
        weight int8 ``[E, K, N]``, weight_scale ``[E, N]``, per_token_scale ``[R]`` -> ``[R, N]`` in
        ``input_dtype`` if that is bf16/fp16, else bf16."""
        out_dtype = input_dtype if input_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        h = self._int_grouped_matmul(x, weight, group_list, group_list_type, weight_scale, per_token_scale)
        return h.to(out_dtype)

    # ----- weight layout -----
    @staticmethod
    def nz_eligible(weight: torch.Tensor) -> bool:
        """FORCE_NZ applies to >= 2-D, non-fp32, non-meta weights that are not vectors stored as matrices."""
        return (weight.dim() >= 2 and weight.dtype != torch.float32 and weight.device.type != "meta"
                and weight.shape[-1] != 1 and weight.shape[-2] != 1)

    def format_cast(self, weight: torch.Tensor, policy: WeightLayoutPolicy, enable_nz: bool = False) -> torch.Tensor:
        """Weight-layout hook (npu_format_cast stand-in). Under FORCE_NZ (or CONFIGURABLE with ``enable_nz``) an
        eligible weight is re-laid out column-major (same shape and values, transposed storage); otherwise it is
        returned unchanged. Numerics never change."""
        use_nz = policy == WeightLayoutPolicy.FORCE_NZ or (policy == WeightLayoutPolicy.CONFIGURABLE and enable_nz)
        if not use_nz or not self.nz_eligible(weight):
            return weight
        return weight.mT.contiguous().mT


class A5DeviceAdaptor(DeviceAdaptor):
    """A5 (FP8_OPTIMIZED): MX quantization, in-op renorm of softmax routing, direct paged large-head prefill."""

    family = DeviceAdaptorFamily.FP8_OPTIMIZED

    def moe_gating_top_k(self, x: torch.Tensor, *, k: int, k_group: int = 1, group_count: int = 1,
                         group_select_mode: int = 1, renorm: bool = True, norm_type: int = 0,
                         routed_scaling_factor: float = 1.0, eps: float = 1e-20, bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As the base op; softmax + renorm is computed as a softmax over the selected logits."""
        if not (renorm and norm_type == 0):
            return super().moe_gating_top_k(x, k=k, k_group=k_group, group_count=group_count,
                                            group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
                                            routed_scaling_factor=routed_scaling_factor, eps=eps, bias=bias)
        scores, ids = self._select_experts(x, k, k_group, group_count, group_select_mode, norm_type, bias)
        weights = torch.softmax(x.float().gather(1, ids), dim=-1)
        return weights * routed_scaling_factor, ids.to(torch.int32), scores

    def dynamic_quant(self, x: torch.Tensor, scale: torch.Tensor | None = None, *,
                      quant_dtype: torch.dtype = torch.int8, use_mxfp_quant: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``use_mxfp_quant``: MXFP8 — per 32-element block along the last dim of x ``[R, H]`` (H % 64 == 0), shared
        exponent ``e = floor(log2(max|x|)) - 8`` (clamped to [-127, 127]; all-zero block -> -127), q = fp8-e4m3(x /
        2^e) saturated at ±448. Returns (q fp8 ``[R, H]``, scale e8m0 bytes (uint8 ``e + 127``) laid out
        ``[R, H/64, 2]``). Otherwise as the base op."""
        if not use_mxfp_quant or scale is not None:
            return super().dynamic_quant(x, scale, quant_dtype=quant_dtype)
        if x.dim() != 2 or x.shape[1] % MXFP_BLOCK:
            raise ValueError(f"MXFP quant input shape {tuple(x.shape)} must be [R, H] with H % {MXFP_BLOCK} == 0")
        blocks = x.float().view(x.shape[0], -1, MXFP_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        _, exp = torch.frexp(amax)
        shared = torch.where(amax > 0, exp - 1 - _FP8_E4M3_EMAX, torch.full_like(exp, -127)).clamp(-127, 127)
        q = (blocks / torch.ldexp(torch.ones_like(amax), shared).unsqueeze(-1)).clamp(-448.0, 448.0)
        scale_bytes = (shared + 127).to(torch.uint8)
        return q.view_as(x).to(torch.float8_e4m3fn), self.maybe_normalize_mxfp_scale_layout(scale_bytes)

    def maybe_normalize_mxfp_scale_layout(self, scale: torch.Tensor | None) -> torch.Tensor | None:
        """A 2-D MX scale ``[rows, 2n]`` -> ``[rows, n, 2]``; other ranks unchanged; odd last dim -> ValueError."""
        if scale is None or scale.dim() != 2:
            return scale
        if scale.shape[1] % 2:
            raise ValueError(f"Invalid MXFP scale shape: {tuple(scale.shape)} (last dim must be even)")
        return scale.reshape(scale.shape[0], scale.shape[1] // 2, 2)

    def large_head_prefill_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                     query_start_loc: IntSeq, scale: float, seq_lens: IntSeq | None = None,
                                     key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
                                     block_table: torch.Tensor | None = None, causal: bool = True,
                                     prefill_no_cache: bool = False, query_chunk: int = 1024) -> torch.Tensor:
        """A5 attends each request straight from the paged cache (no batch-wide dense gather); same result."""
        use_cache = not prefill_no_cache and key_cache is not None and value_cache is not None and seq_lens is not None
        if not use_cache:
            return super().large_head_prefill_attention(
                query, key, value, query_start_loc=query_start_loc, scale=scale, causal=causal,
                prefill_no_cache=True, query_chunk=query_chunk)
        if block_table is None:
            raise ValueError("block_table is required when attending over the paged cache")
        qsl, lens = to_int_list(query_start_loc, "query_start_loc"), to_int_list(seq_lens, "seq_lens")
        out = query.new_empty(qsl[-1], query.shape[1], value_cache.shape[-1])
        for i in range(len(qsl) - 1):
            slots, _ = paged_slots(block_table[i: i + 1], [lens[i]], key_cache.shape[1])
            out[qsl[i]: qsl[i + 1]] = attend(query[qsl[i]: qsl[i + 1]], gather_slots(key_cache, slots),
                                             gather_slots(value_cache, slots), scale, causal, query_chunk)
        return out


class A310PDeviceAdaptor(DeviceAdaptor):
    """310P (COMPATIBILITY): host-planned cache writes, an emulated NZ KV layout, boolean-mask index_fill, and the
    chunked router (<= 1024 tokens per call)."""

    family = DeviceAdaptorFamily.COMPATIBILITY
    ROUTER_CHUNK = 1024

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """As the base op, with the (block, offset) pairs computed on the host with numpy."""
        _check_cache_io(key, key_cache)
        _check_cache_io(value, value_cache)
        slots = slot_mapping.reshape(-1).cpu().numpy().astype(np.int64)
        rows = np.flatnonzero(slots >= 0)
        bs = key_cache.shape[1]
        block = torch.from_numpy(slots[rows] // bs).to(key_cache.device)
        offset = torch.from_numpy(slots[rows] % bs).to(key_cache.device)
        rows_t = torch.from_numpy(rows)
        for src, cache in ((key, key_cache), (value, value_cache)):
            cache[block, offset] = src.index_select(0, rows_t.to(src.device)).to(cache.dtype).to(cache.device)

    @staticmethod
    def kv_cache_to_nz(cache: torch.Tensor) -> torch.Tensor:
        """Portable ``[num_blocks, bs, Hkv, D]`` -> 310P NZ ``[num_blocks, Hkv*D/16, bs, 16]`` (bs % 16 == 0)."""
        nb, bs, h, d = cache.shape
        if (h * d) % 16 or bs % 16:
            raise ValueError(f"NZ cache needs Hkv*D and block_size multiples of 16, got {tuple(cache.shape)}")
        return cache.reshape(nb, bs, h * d // 16, 16).transpose(1, 2).contiguous()

    @staticmethod
    def kv_cache_from_nz(nz: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
        """Inverse of :meth:`kv_cache_to_nz`."""
        nb, _, bs, _ = nz.shape
        return nz.transpose(1, 2).reshape(nb, bs, num_kv_heads, head_size).contiguous()

    def reshape_and_cache_nz(self, key: torch.Tensor, value: torch.Tensor, key_cache_nz: torch.Tensor,
                             value_cache_nz: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache into NZ caches ``[num_blocks, Hkv*D/16, bs, 16]``: token t's flattened hidden
        ``key[t].reshape(-1)`` lands at ``cache[s // bs, c // 16, s % bs, c % 16]``."""
        t = key.shape[0]
        slots = slot_mapping.reshape(-1).cpu().numpy().astype(np.int64)
        rows = np.flatnonzero(slots[:t] >= 0)
        bs = key_cache_nz.shape[2]
        device = key_cache_nz.device
        block = torch.from_numpy(slots[rows] // bs).to(device).unsqueeze(1)
        offset = torch.from_numpy(slots[rows] % bs).to(device).unsqueeze(1)
        for src, cache in ((key, key_cache_nz), (value, value_cache_nz)):
            fractals = torch.arange(cache.shape[1], device=device).unsqueeze(0)
            rows_src = src.index_select(0, torch.from_numpy(rows).to(src.device)).reshape(len(rows), -1, 16)
            cache[block, fractals, offset] = rows_src.to(cache.dtype).to(device)

    def index_fill(self, x: torch.Tensor, dim: int, index: torch.Tensor, value: float) -> torch.Tensor:
        """Boolean-mask emulation of ``index_fill_`` along ``dim`` (any rank, negative indices normalized, empty
        index = no-op)."""
        if index.numel() == 0:
            return x
        dim = dim % x.dim()
        idx = index.reshape(-1).to(device=x.device, dtype=torch.int64)
        idx = torch.where(idx < 0, idx + x.shape[dim], idx)
        hit = torch.zeros(x.shape[dim], dtype=torch.bool, device=x.device)
        hit[idx] = True
        shape = [1] * x.dim()
        shape[dim] = x.shape[dim]
        return x.masked_fill_(hit.view(shape), value)

    def moe_gating_top_k(self, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As the base op, computed over at most ``ROUTER_CHUNK`` tokens per call."""
        if x.shape[0] <= self.ROUTER_CHUNK:
            return super().moe_gating_top_k(x, **kwargs)
        parts = [super(A310PDeviceAdaptor, self).moe_gating_top_k(x[s: s + self.ROUTER_CHUNK], **kwargs)
                 for s in range(0, x.shape[0], self.ROUTER_CHUNK)]
        return tuple(torch.cat(p, dim=0) for p in zip(*parts))  # type: ignore[return-value]


_ADAPTORS: dict[DeviceAdaptorFamily, DeviceAdaptor] = {
    DeviceAdaptorFamily.STANDARD: DeviceAdaptor(),
    DeviceAdaptorFamily.FP8_OPTIMIZED: A5DeviceAdaptor(),
    DeviceAdaptorFamily.COMPATIBILITY: A310PDeviceAdaptor(),
}


def get_device_adaptor(profile: HardwareProfile) -> DeviceAdaptor:
    """The (stateless, shared) adaptor for ``profile.device_adaptor``."""
    try:
        return _ADAPTORS[DeviceAdaptorFamily(profile.device_adaptor)]
    except (KeyError, ValueError):
        raise ValueError(f"device_adaptor={profile.device_adaptor!r} has no adaptor implementation") from None
