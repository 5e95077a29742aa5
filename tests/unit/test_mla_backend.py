"""MLA backend vs a float64, non-absorbed recomputation (explicit per-head K/V from the latents).

Random block tables, requests in random order mixing absorbed decodes, fresh prefills and prefills on a cached prefix
(read in several context chunks), padding rows with slot -1; unwritten cache slots hold NaN so any stray read
poisons the result. The log-sum-exp merge is checked for exactness on its own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ascent.attention.backend import CommonAttentionMetadata, make_metadata_builder
from ascent.attention.backends.mla import (
    MLABackend,
    MLAImpl,
    MLAMetadataBuilder,
    attention_with_lse,
    context_workspace_tokens,
    merge_attention_states,
)

HEADS, NOPE, ROPE, LORA, VDIM = 4, 16, 8, 32, 12
BLOCK_SIZE, NUM_BLOCKS = 4, 48
REQS = [(11, 1), (0, 7), (5, 1), (9, 6), (0, 1), (3, 4), (17, 1), (14, 9)]


def reference(q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor, num_computed: int, scale: float) -> torch.Tensor:
    """float64 MLA of n queries at positions num_computed.. over the full context latents c ``[L_ctx, LORA]``."""
    d = torch.float64
    k_nope = torch.einsum("tl,hnl->htn", c.to(d), w_uk.to(d))
    v = torch.einsum("tl,hvl->htv", c.to(d), w_uv.to(d))
    k = torch.cat([k_nope, k_pe.to(d).unsqueeze(0).expand(HEADS, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).to(d).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    q_pos = torch.arange(num_computed, num_computed + q.shape[1]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(c.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[1], HEADS * VDIM)


def make_case(rng: np.random.Generator, dtype: torch.dtype, pad: int):
    """Requests as (num_computed, num_new); cached prefixes are written into a NaN-filled cache beforehand."""
    reqs = [REQS[i] for i in rng.permutation(len(REQS))]
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, 1, LORA + ROPE), float("nan"), dtype=dtype)
    flat = cache.view(-1, LORA + ROPE)
    width = max(-(-(c + n) // BLOCK_SIZE) for c, n in reqs) + 2
    table = np.zeros((len(reqs), width), dtype=np.int32)
    latents, slots = [], []
    for i, (c, n) in enumerate(reqs):
        nblocks = -(-(c + n) // BLOCK_SIZE)
        table[i, :nblocks] = [free.pop() for _ in range(nblocks)]
        req_slots = [int(table[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c + n)]
        lat = torch.randn(c + n, LORA + ROPE).to(dtype)
        flat[req_slots[:c]] = lat[:c]
        latents.append(lat)
        slots += req_slots[c:]
    new_lens = [n for _, n in reqs]
    qsl = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    total = int(qsl[-1])
    new = torch.cat([lat[c:] for lat, (c, _) in zip(latents, reqs)] + [torch.randn(pad, LORA + ROPE).to(dtype)])
    q_nope = torch.randn(total + pad, HEADS, NOPE).to(dtype)
    q_pe = torch.randn(total + pad, HEADS, ROPE).to(dtype)
    computed = np.array([c for c, _ in reqs], dtype=np.int32)
    seq_lens = computed + np.array(new_lens, dtype=np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        num_computed_tokens=torch.from_numpy(computed), block_table=torch.from_numpy(table),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64), query_start_loc_np=qsl,
        seq_lens_np=seq_lens, num_computed_tokens_np=computed, num_reqs=len(reqs), num_actual_tokens=total,
        max_query_len=max(new_lens), max_seq_len=int(seq_lens.max()), block_size=BLOCK_SIZE,
    )
    return reqs, common, cache, q_nope, q_pe, new, latents


def make_impl(dtype: torch.dtype, scale: float) -> tuple[MLAImpl, torch.Tensor, torch.Tensor]:
    w_uk = (torch.randn(HEADS, NOPE, LORA) / math.sqrt(LORA)).to(dtype)
    w_uv = (torch.randn(HEADS, VDIM, LORA) / math.sqrt(LORA)).to(dtype)
    impl = MLABackend.get_impl_cls()(HEADS, LORA, NOPE, ROPE, VDIM, scale)
    impl.set_weights(w_uk, w_uv)
    return impl, w_uk, w_uv


@pytest.mark.parametrize(
    "dtype,tol,workspace,pad",
    [(torch.float32, 2e-5, None, 3), (torch.float32, 2e-5, 8, 0), (torch.float32, 2e-5, 5, 1),
     (torch.bfloat16, 4e-2, 8, 2)],
)
def test_mla_matches_float64_reference(dtype: torch.dtype, tol: float, workspace: int | None, pad: int) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    reqs, common, cache, q_nope, q_pe, new, latents = make_case(rng, dtype, pad)
    before = cache.clone()
    scale = (NOPE + ROPE) ** -0.5 * 1.3
    impl, w_uk, w_uv = make_impl(dtype, scale)
    metadata = MLAMetadataBuilder(max_model_len=64, max_num_seqs=8, workspace_tokens=workspace).build(common)
    if workspace is not None:
        assert len(metadata.context_chunks) > 1
    out = impl.forward(q_nope, q_pe, new[:, :LORA], new[:, LORA:], cache, metadata)
    assert out.shape == (q_nope.shape[0], HEADS * VDIM) and out.dtype == dtype
    qsl = common.query_start_loc_np
    for i, (c, n) in enumerate(reqs):
        rows = slice(qsl[i], qsl[i + 1])
        lat = latents[i]
        expected = reference(q_nope[rows], q_pe[rows], lat[:, :LORA], lat[:, LORA:], w_uk, w_uv, c, scale)
        err = (out[rows].double() - expected).abs().max()
        assert err <= tol * max(1.0, expected.abs().max()), (i, c, n, float(err))
    assert torch.all(out[common.num_actual_tokens :] == 0)
    written = common.slot_mapping[: common.num_actual_tokens]
    flat, flat_before = cache.view(-1, LORA + ROPE), before.view(-1, LORA + ROPE)
    assert torch.equal(flat[written], new[: common.num_actual_tokens])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched].isnan(), flat_before[untouched].isnan())


def test_context_chunks_cover_prefix_in_block_multiples() -> None:
    rng = np.random.default_rng(3)
    reqs, common, *_ = make_case(rng, torch.float32, 0)
    builder = MLAMetadataBuilder(workspace_tokens=17)
    md = builder.build(common)
    with_ctx = [p for p in md.prefills if p.num_computed > 0]
    chunk_len = 17 // len(with_ctx) // BLOCK_SIZE * BLOCK_SIZE or BLOCK_SIZE
    covered: dict[int, int] = {}
    for chunk in md.context_chunks:
        assert chunk.chunk_start % chunk_len == 0
        for j, a, b in zip(chunk.prefill_idx, chunk.offsets[:-1], chunk.offsets[1:]):
            assert covered.get(j, 0) == chunk.chunk_start and 0 < b - a <= chunk_len
            covered[j] = chunk.chunk_start + b - a
        assert chunk.slots.shape[0] == chunk.offsets[-1]
    assert covered == {j: p.num_computed for j, p in enumerate(md.prefills) if p.num_computed > 0}
    assert md.num_decodes == sum(1 for _, n in reqs if n == 1)


def test_dummy_forward_is_one_causal_sequence() -> None:
    torch.manual_seed(1)
    scale = (NOPE + ROPE) ** -0.5
    impl, w_uk, w_uv = make_impl(torch.float32, scale)
    q_nope, q_pe, lat = torch.randn(9, HEADS, NOPE), torch.randn(9, HEADS, ROPE), torch.randn(9, LORA + ROPE)
    out = impl.forward(q_nope, q_pe, lat[:, :LORA], lat[:, LORA:], torch.empty(0), None)
    expected = reference(q_nope, q_pe, lat[:, :LORA], lat[:, LORA:], w_uk, w_uv, 0, scale)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("cuts", [[3], [1, 5, 6], [2, 4, 7, 10]])
def test_lse_merge_is_exact(cuts: list[int]) -> None:
    torch.manual_seed(2)
    q = torch.randn(5, HEADS, 24, dtype=torch.float64)
    k = torch.randn(11, HEADS, 24, dtype=torch.float64)
    v = torch.randn(11, HEADS, 7, dtype=torch.float64)
    full, full_lse = attention_with_lse(q, k, v, 0.3, causal=False)
    bounds = [0, *cuts, 11]
    parts = [attention_with_lse(q, k[a:b], v[a:b], 0.3, causal=False) for a, b in zip(bounds[:-1], bounds[1:])]
    merged, lse = merge_attention_states(parts[::-1])
    assert merged.dtype == torch.float64
    assert (merged - full).abs().max() < 1e-13 and (lse - full_lse).abs().max() < 1e-13
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    assert (full_lse - torch.logsumexp(scores, -1)).abs().max() < 1e-13
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             scale=0.3)
    assert (full - sdpa.transpose(0, 1)).abs().max() < 1e-13


def test_causal_lse_is_bottom_right_aligned() -> None:
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(7, 2, 8, dtype=torch.float64), \
        torch.randn(7, 2, 5, dtype=torch.float64)
    out, _ = attention_with_lse(q, k, v, 0.5, causal=True)
    for i in range(3):
        ref, _ = attention_with_lse(q[i : i + 1], k[: 5 + i], v[: 5 + i], 0.5, causal=False)
        assert (out[i] - ref[0]).abs().max() < 1e-13
    with pytest.raises(ValueError, match="at least as many keys"):
        attention_with_lse(k, q, q, 0.5, causal=True)
    with pytest.raises(ValueError, match="at least one"):
        merge_attention_states([])


def test_backend_surface_and_validation() -> None:
    assert MLABackend.get_name() == "MLA"
    assert MLABackend.get_kv_cache_shape(7, 16, 1, LORA + ROPE) == (7, 16, 1, LORA + ROPE)
    with pytest.raises(ValueError, match="num_kv_heads must be 1, got 2"):
        MLABackend.get_kv_cache_shape(7, 16, 2, 64)
    builder = make_metadata_builder(MLABackend, max_model_len=100, max_num_seqs=3, chunked_prefill=True)
    assert isinstance(builder, MLAMetadataBuilder) and builder.max_model_len == 100 and builder.max_num_seqs == 3
    assert context_workspace_tokens(100, 3, 16) == 800
    assert context_workspace_tokens(10**6, 4, 16) == 128 * 1024
    assert context_workspace_tokens(10, 10**5, 16) == 16 * 10**5
    with pytest.raises(ValueError, match="workspace_tokens must be >= 1, got 0"):
        MLAMetadataBuilder(workspace_tokens=0)
    impl = MLAImpl(HEADS, LORA, NOPE, ROPE, VDIM, 1.0)
    with pytest.raises(RuntimeError, match="set_weights"):
        impl.forward(torch.randn(1, HEADS, NOPE), torch.randn(1, HEADS, ROPE), torch.randn(1, LORA),
                     torch.randn(1, ROPE), torch.empty(0), None)
    with pytest.raises(ValueError, match="w_uk"):
        impl.set_weights(torch.randn(HEADS, NOPE + 1, LORA), torch.randn(HEADS, VDIM, LORA))
    with pytest.raises(ValueError, match="kv_lora_rank must be >= 1, got 0"):
        MLAImpl(HEADS, 0, NOPE, ROPE, VDIM, 1.0)


def test_missing_cache_raises() -> None:
    rng = np.random.default_rng(5)
    _, common, _, q_nope, q_pe, new, _ = make_case(rng, torch.float32, 0)
    impl, *_ = make_impl(torch.float32, 1.0)
    md = MLAMetadataBuilder().build(common)
    with pytest.raises(RuntimeError, match="no KV cache"):
        impl.forward(q_nope, q_pe, new[:, :LORA], new[:, LORA:], torch.empty(0), md)
