"""SDPA paged attention vs a float64 recomputation over contiguous K/V.

Random block tables, requests in random order mixing decodes, fresh prefills and prefills on a cached prefix, GQA,
padding rows with slot -1, optional sliding window; the cache must hold exactly the written rows afterwards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ascent.attention.backends.sdpa import SDPABackend
from ascent.attention.layer import Attention, get_attn_backend
from ascent.forward_context import get_forward_context, set_forward_context
from tests.fixtures.paged_case import make_paged_case

NUM_HEADS, NUM_KV_HEADS, HEAD = 8, 2, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 40
SENTINEL = 1234.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int, scale: float,
              window: int | None) -> torch.Tensor:
    """float64 attention of q ``[n, H*d]`` over the full context k/v ``[L, Hkv*d]``, query i at num_computed+i."""
    n, length, group = q.shape[0], k.shape[0], NUM_HEADS // NUM_KV_HEADS
    qh = q.double().view(n, NUM_HEADS, HEAD).transpose(0, 1)
    kh = k.double().view(length, NUM_KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    vh = v.double().view(length, NUM_KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    scores = qh @ kh.transpose(1, 2) * scale
    q_pos = torch.arange(num_computed, num_computed + n).unsqueeze(1)
    k_pos = torch.arange(length).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(n, NUM_HEADS * HEAD)


def make_case(rng: np.random.Generator, dtype: torch.dtype, pad: int):
    """Requests as (num_computed, num_new), in random order; the cached prefixes are written into the cache."""
    reqs = [(11, 1), (0, 7), (5, 1), (9, 6), (0, 1), (3, 4), (17, 1)]
    reqs = [reqs[i] for i in rng.permutation(len(reqs))]
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    case = make_paged_case(reqs, dtype, pad, rng, gen, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                           num_kv_heads=NUM_KV_HEADS, num_heads=NUM_HEADS, head=HEAD, sentinel=SENTINEL,
                           spare_blocks=2)
    return (reqs, *case)


@pytest.mark.parametrize(
    "dtype,tol,window,pad",
    [(torch.float32, 2e-5, None, 3), (torch.float32, 2e-5, 3, 0), (torch.bfloat16, 3e-2, None, 2),
     (torch.float16, 5e-3, 6, 1)],
)
def test_paged_attention_matches_float64(dtype: torch.dtype, tol: float, window: int | None, pad: int) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    reqs, common, cache, q, k_new, v_new, full_k, full_v = make_case(rng, dtype, pad)
    before = cache.clone()
    scale = 1 / math.sqrt(HEAD) * 0.9
    impl = SDPABackend.get_impl_cls()(NUM_HEADS, HEAD, scale, NUM_KV_HEADS, sliding_window=window)
    metadata = SDPABackend.get_builder_cls()().build(common)
    out = impl.forward(q, k_new, v_new, cache, metadata)
    assert out.shape == q.shape and out.dtype == dtype
    qsl = common.query_start_loc_np
    for i, (c, n) in enumerate(reqs):
        expected = reference(q[qsl[i] : qsl[i + 1]], full_k[i], full_v[i], c, scale, window)
        got = out[qsl[i] : qsl[i + 1]].double()
        assert (got - expected).abs().max() <= tol * max(1.0, expected.abs().max()), (i, c, n)
    assert torch.all(out[common.num_actual_tokens :] == 0)
    written = common.slot_mapping[: common.num_actual_tokens]
    flat, flat_before = cache.view(2, -1, NUM_KV_HEADS * HEAD), before.view(2, -1, NUM_KV_HEADS * HEAD)
    assert torch.equal(flat[0, written], k_new[: common.num_actual_tokens])
    assert torch.equal(flat[1, written], v_new[: common.num_actual_tokens])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_no_metadata_is_one_causal_sequence() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(9, NUM_HEADS * HEAD), torch.randn(9, NUM_KV_HEADS * HEAD), torch.randn(9, NUM_KV_HEADS * HEAD)
    layer = Attention(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, prefix="model.layers.0.self_attn.attn")
    with set_forward_context(None):
        out = layer(q, k, v)
    assert (out.double() - reference(q, k, v, 0, HEAD**-0.5, None)).abs().max() < 1e-5


def test_layer_reads_context_and_validates() -> None:
    rng = np.random.default_rng(2)
    reqs, common, cache, q, k_new, v_new, full_k, full_v = make_case(rng, torch.float32, 0)
    layer = Attention(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, prefix="layer0")
    assert layer.layer_name == "layer0" and layer.backend is SDPABackend and layer.kv_cache.numel() == 0
    metadata = SDPABackend.get_builder_cls()().build(common)
    with set_forward_context({"layer0": metadata}):
        with pytest.raises(RuntimeError, match="no KV cache"):
            layer(q, k_new, v_new)
        layer.kv_cache = cache
        out = layer(q, k_new, v_new)
    i = 0
    expected = reference(q[: common.query_start_loc_np[1]], full_k[i], full_v[i], reqs[i][0], HEAD**-0.5, None)
    assert (out[: common.query_start_loc_np[1]].double() - expected).abs().max() < 2e-5
    with pytest.raises(RuntimeError, match="forward context"):
        get_forward_context()
    with pytest.raises(ValueError, match="flash"):
        get_attn_backend("flash")
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        Attention(8, HEAD, 1.0, 3)
    assert SDPABackend.get_kv_cache_shape(7, 16, 2, 64) == (2, 7, 16, 2, 64)


@pytest.mark.parametrize("single_gather_rows", [0, 1 << 20])
def test_decode_paths_are_bitwise_equal(monkeypatch: pytest.MonkeyPatch, single_gather_rows: int) -> None:
    """A decode-only step (direct return, fused K/V write from adjacent columns of one tensor, either gather
    strategy) gives the same output and cache bitwise as the general path with separate k/v tensors."""
    import ascent.attention.backends.sdpa as sdpa

    monkeypatch.setattr(sdpa, "SINGLE_GATHER_MAX_ROWS", single_gather_rows)
    rng = np.random.default_rng(3)
    reqs = [(11, 1), (5, 1), (0, 1), (17, 1), (2, 1)]
    gen = torch.Generator().manual_seed(3)
    common, cache, q, k_new, v_new, full_k, full_v = make_paged_case(
        reqs, torch.bfloat16, 0, rng, gen, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
        num_heads=NUM_HEADS, head=HEAD, sentinel=SENTINEL)
    impl = SDPABackend.get_impl_cls()(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS)
    metadata = SDPABackend.get_builder_cls()().build(common)
    fused = torch.cat([q, k_new, v_new], dim=1)
    qf, kf, vf = fused.split([q.shape[1], k_new.shape[1], v_new.shape[1]], dim=1)
    assert sdpa._adjacent_pair(kf, vf) is not None and sdpa._adjacent_pair(k_new, v_new) is None
    cache_fused = cache.clone()
    out_fused = impl.forward(qf, kf, vf, cache_fused, metadata)
    out = impl.forward(q, k_new.clone(), v_new.clone(), cache, metadata)
    assert torch.equal(out_fused, out) and torch.equal(cache_fused, cache)
    for i, (c, _) in enumerate(reqs):
        expected = reference(q[i : i + 1], full_k[i], full_v[i], c, HEAD**-0.5, None)
        assert (out[i : i + 1].double() - expected).abs().max() <= 3e-2 * max(1.0, expected.abs().max())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_batched_short_queries_match_per_request_path(monkeypatch: pytest.MonkeyPatch, window: int | None,
                                                      fused: bool) -> None:
    """Short cached-prefix queries (speculative verification) run as one batched SDPA call, or (with the fused CPU
    decode kernel) as one decode row per query token; the result equals the per-request path (batching disabled)
    to rounding, and the float64 reference."""
    import ascent.attention.backends.sdpa as sdpa

    if not fused:
        monkeypatch.setenv("ASCENT_CPU_FUSED_OPS", "0")
    rng = np.random.default_rng(5)
    reqs = [(11, 4), (5, 1), (9, 2), (0, 6), (17, 4), (2, 3)]
    gen = torch.Generator().manual_seed(5)
    common, cache, q, k_new, v_new, full_k, full_v = make_paged_case(
        reqs, torch.float32, 2, rng, gen, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
        num_heads=NUM_HEADS, head=HEAD, sentinel=SENTINEL)
    impl = SDPABackend.get_impl_cls()(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, sliding_window=window)
    metadata = SDPABackend.get_builder_cls()().build(common)
    if fused:  # every token of the short queries and the decode is its own decode row, in token order
        assert metadata.multi is None and metadata.num_decodes == 4 + 1 + 2 + 4 + 3
        qsl = common.query_start_loc_np
        want_rows = [r for i, (c, n) in enumerate(reqs) if c > 0 for r in range(qsl[i], qsl[i] + n)]
        assert metadata.decode_rows.tolist() == want_rows
        want_lens = [c + j + 1 for c, n in reqs if c > 0 for j in range(n)]
        assert metadata.decode_seq_lens.tolist() == want_lens
    else:
        assert metadata.multi is not None and metadata.multi.n == 4 and metadata.multi.q_max == 4
    assert [p.num_computed for p in metadata.prefills] == [0]
    out = impl.forward(q, k_new, v_new, cache.clone(), metadata)
    monkeypatch.setattr(sdpa, "MULTI_QUERY_MAX_LEN", 1)
    per_request = SDPABackend.get_builder_cls()().build(common)
    assert per_request.multi is None and len(per_request.prefills) == 5
    expected_all = impl.forward(q, k_new, v_new, cache.clone(), per_request)
    torch.testing.assert_close(out, expected_all, rtol=1e-5, atol=1e-5)
    qsl = common.query_start_loc_np
    for i, (c, _) in enumerate(reqs):
        expected = reference(q[qsl[i]: qsl[i + 1]], full_k[i], full_v[i], c, HEAD**-0.5, window)
        assert (out[qsl[i]: qsl[i + 1]].double() - expected).abs().max() <= 2e-5 * max(1.0, expected.abs().max())


@pytest.mark.parametrize("pad", [0, 2])
def test_decode_only_metadata_equals_the_general_plan(pad: int) -> None:
    """A step of one token per request takes ``build``'s decode-only shortcut; its metadata equals the general
    per-kind plan field by field (lengths differ, so the padded-slot mask is exercised), and it still validates."""
    import dataclasses

    rng = np.random.default_rng(4)
    gen = torch.Generator().manual_seed(4)
    common = make_paged_case([(11, 1), (5, 1), (0, 1), (17, 1)], torch.float32, pad, rng, gen, num_blocks=NUM_BLOCKS,
                             block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, num_heads=NUM_HEADS, head=HEAD,
                             sentinel=SENTINEL)[0]
    builder = SDPABackend.get_builder_cls()()
    fast = builder.build(common)
    general = builder._build_general(common, common.seq_lens_np.astype(np.int64),
                                     common.num_computed_tokens_np.astype(np.int64))
    for field in dataclasses.fields(fast):
        a, b = getattr(fast, field.name), getattr(general, field.name)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    assert fast.num_decodes == 4 and fast.decode_mask is not None and (fast.write_rows is not None) == (pad > 0)
    bad = dataclasses.replace(common, seq_lens_np=common.seq_lens_np + 1)
    with pytest.raises(ValueError, match="seq_lens"):
        builder.build(bad)


@pytest.mark.parametrize("stride_pad", [0, 3])
def test_context_slots_kernel_equals_the_torch_ops(stride_pad: int) -> None:
    """``_context_slots`` with the fused kernels (the SDPA builder's) runs ``context_slots``; it gives the torch ops'
    slots (block id * block size + offset, positions past a row's length repeating its first slot) for a row-strided
    table view, with and without lengths, and rejects a context longer than the table."""
    from ascent.attention.backends import sdpa
    from ascent.layers.cpu_kernels import fused_ops

    ops = fused_ops()
    assert ops is not None, "the CPU profile must build the fused kernels (a C++ compiler is a test requirement)"
    assert SDPABackend.get_builder_cls()()._fused is ops
    gen = torch.Generator().manual_seed(7)
    table = torch.randint(0, 1000, (5, 9 + stride_pad), generator=gen, dtype=torch.int32)[:, :9]
    lens = torch.tensor([1, 16, 40, 7, 33], dtype=torch.int64)
    block_size, length = 5, 40
    kernel = [sdpa._context_slots(table, block_size, length, lens, ops),
              sdpa._context_slots(table, block_size, length, None, ops)]
    reference = [sdpa._context_slots(table, block_size, length, lens), sdpa._context_slots(table, block_size, length)]
    for got, want in zip(kernel, reference):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    positions = torch.arange(length)
    expected = table.long()[:, positions // block_size] * block_size + positions % block_size
    assert torch.equal(kernel[1], expected)
    assert torch.equal(kernel[0][3, 7:], expected[3, :1].expand(length - 7)) and torch.equal(kernel[0][2], expected[2])
    with pytest.raises(ValueError, match="46 tokens needs 10 blocks"):
        sdpa._context_slots(table, block_size, 46, None, ops)
