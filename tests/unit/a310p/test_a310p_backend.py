"""Compatibility (310P-style) attention backend vs a float64 softmax(QK^T)V over gathered contiguous K/V, and vs the
SDPA backend on the same inputs. Batches: prefill-only, decode-only, chunked prefill on cached prefixes (mixed with
decodes and fresh prefills), uniform speculative verification; fp16 and fp32; plain and compressed splitfuse masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ascent.attention.backends.a310p import A310PAttentionState, A310PBackend, A310PMetadataBuilder, attention_state
from ascent.attention.backends.sdpa import SDPABackend
from tests.fixtures.paged_case import make_paged_case

NUM_HEADS, NUM_KV_HEADS, HEAD = 8, 2, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 48
SENTINEL = 77.0
SCALE = 1 / math.sqrt(HEAD) * 0.9

BATCHES = {
    "prefill_only": [(0, 7), (0, 1), (0, 12), (0, 3)],
    "decode_only": [(11, 1), (4, 1), (17, 1), (1, 1)],
    "chunked_mixed": [(11, 1), (0, 7), (5, 1), (9, 6), (0, 1), (3, 4), (17, 1)],
    "chunked_prefix": [(8, 5), (16, 3), (2, 9)],
    "spec_uniform": [(6, 4), (13, 4), (9, 4)],
}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int,
              window: int | None = None) -> torch.Tensor:
    """float64 softmax(q k^T * scale + causal) v for one request; k/v are its full contiguous context."""
    n, length, group = q.shape[0], k.shape[0], NUM_HEADS // NUM_KV_HEADS
    qh = q.double().view(n, NUM_HEADS, HEAD).transpose(0, 1)
    kh = k.double().view(length, NUM_KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    vh = v.double().view(length, NUM_KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    scores = qh @ kh.transpose(1, 2) * SCALE
    for i in range(n):
        pos = num_computed + i
        for j in range(length):
            if j > pos or (window is not None and j <= pos - window):
                scores[:, i, j] = float("-inf")
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(n, NUM_HEADS * HEAD)


def make_case(reqs: list[tuple[int, int]], dtype: torch.dtype, pad: int, seed: int):
    """Random block tables; cached prefixes written beforehand; new K/V rows plus ``pad`` padding rows (slot -1)."""
    return make_paged_case(reqs, dtype, pad, np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                           num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                           num_heads=NUM_HEADS, head=HEAD, sentinel=SENTINEL)


def run_backend(backend, builder, common, cache, q, k, v, window=None):
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD, SCALE, NUM_KV_HEADS, sliding_window=window)
    return impl.forward(q, k, v, cache, builder.build(common))


EXPECTED_STATES = {
    "prefill_only": A310PAttentionState.PREFILL_NO_CACHE,
    "decode_only": A310PAttentionState.DECODE_ONLY,
    "chunked_mixed": A310PAttentionState.CHUNKED_PREFILL,
    "chunked_prefix": A310PAttentionState.CHUNKED_PREFILL,
    "spec_uniform": A310PAttentionState.SPEC_DECODING,
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("compressed", [False, True])
def test_matches_float64_reference_and_sdpa(batch: str, dtype: torch.dtype, tol: float, compressed: bool) -> None:
    reqs = BATCHES[batch]
    common, cache, q, k_new, v_new, full_k, full_v = make_case(reqs, dtype, pad=2, seed=len(batch))
    sdpa_cache = cache.clone()
    before = cache.clone()
    builder = A310PMetadataBuilder(max_model_len=64, compressed_mask=compressed, num_spec_tokens=3)
    md = builder.build(common)
    assert md.state == EXPECTED_STATES[batch]
    out = A310PBackend.get_impl_cls()(NUM_HEADS, HEAD, SCALE, NUM_KV_HEADS).forward(q, k_new, v_new, cache, md)
    assert out.shape == q.shape and out.dtype == dtype
    qsl = common.query_start_loc_np
    for i, (c, _) in enumerate(reqs):
        expected = reference(q[qsl[i] : qsl[i + 1]], full_k[i], full_v[i], c)
        got = out[qsl[i] : qsl[i + 1]].double()
        assert (got - expected).abs().max() <= tol * max(1.0, expected.abs().max()), (batch, i)
    assert torch.all(out[common.num_actual_tokens :] == 0)
    sdpa_out = run_backend(SDPABackend, SDPABackend.get_builder_cls()(), common, sdpa_cache, q, k_new, v_new)
    assert (out.double() - sdpa_out.double()).abs().max() <= 5e-3
    assert torch.equal(cache, sdpa_cache)
    written = common.slot_mapping[: common.num_actual_tokens]
    flat, flat_before = cache.view(2, -1, NUM_KV_HEADS * HEAD), before.view(2, -1, NUM_KV_HEADS * HEAD)
    assert torch.equal(flat[0, written], k_new[: common.num_actual_tokens])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


@pytest.mark.parametrize("batch", ["chunked_mixed", "prefill_only", "decode_only"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
def test_sliding_window_matches_reference(batch: str, dtype: torch.dtype, tol: float) -> None:
    reqs, window = BATCHES[batch], 5
    common, cache, q, k_new, v_new, full_k, full_v = make_case(reqs, dtype, pad=0, seed=3)
    out = run_backend(A310PBackend, A310PMetadataBuilder(compressed_mask=True), common, cache, q, k_new, v_new,
                      window)
    qsl = common.query_start_loc_np
    for i, (c, _) in enumerate(reqs):
        expected = reference(q[qsl[i] : qsl[i + 1]], full_k[i], full_v[i], c, window)
        assert (out[qsl[i] : qsl[i + 1]].double() - expected).abs().max() <= tol * max(1.0, expected.abs().max())


def test_host_query_lens_and_states() -> None:
    builder = A310PMetadataBuilder(max_num_seqs=2)
    common, *_ = make_case(BATCHES["chunked_mixed"], torch.float32, pad=0, seed=5)
    md = builder.build(common)
    assert isinstance(md.query_lens_cpu, np.ndarray) and md.query_lens_cpu.dtype == np.int32
    assert md.query_lens_cpu.tolist() == [n for _, n in BATCHES["chunked_mixed"]]
    drafted = builder.build_for_drafting(common)
    assert not np.shares_memory(drafted.query_lens_cpu, builder._query_lens_buf)
    assert np.shares_memory(builder.build(common).query_lens_cpu, builder._query_lens_buf)
    prefill, *_ = make_case(BATCHES["prefill_only"], torch.float32, pad=0, seed=5)
    assert builder.build(prefill).query_lens_cpu is None
    ones, zeros = np.ones(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    assert attention_state(ones * 4, ones, chunked_prefill=False) == A310PAttentionState.PREFILL_CACHE_HIT
    assert attention_state(ones * 4, ones, num_spec_tokens=3) == A310PAttentionState.SPEC_DECODING
    assert attention_state(ones * 4, ones, num_spec_tokens=2) == A310PAttentionState.CHUNKED_PREFILL
    assert attention_state(ones, zeros) == A310PAttentionState.PREFILL_NO_CACHE
    with pytest.raises(ValueError, match="num_spec_tokens must be >= 0, got -1"):
        A310PMetadataBuilder(num_spec_tokens=-1)


def test_inconsistent_lengths_and_missing_cache_are_rejected() -> None:
    common, cache, q, k_new, v_new, *_ = make_case(BATCHES["chunked_prefix"], torch.float32, pad=0, seed=6)
    md = A310PMetadataBuilder().build(common)
    impl = A310PBackend.get_impl_cls()(NUM_HEADS, HEAD, SCALE, NUM_KV_HEADS)
    with pytest.raises(RuntimeError, match="no KV cache"):
        impl.forward(q, k_new, v_new, torch.empty(0), md)
    common.seq_lens_np = common.seq_lens_np + 1
    with pytest.raises(ValueError, match="seq_lens"):
        A310PMetadataBuilder().build(common)


def test_no_metadata_is_one_causal_sequence_and_backend_surface() -> None:
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(9, NUM_HEADS * HEAD, generator=gen)
    k, v = torch.randn(9, NUM_KV_HEADS * HEAD, generator=gen), torch.randn(9, NUM_KV_HEADS * HEAD, generator=gen)
    impl = A310PBackend.get_impl_cls()(NUM_HEADS, HEAD, SCALE, NUM_KV_HEADS)
    assert (impl.forward(q, k, v, torch.empty(0), None).double() - reference(q, k, v, 0)).abs().max() < 1e-5
    assert A310PBackend.get_name() == "compat310p"
    assert A310PBackend.get_kv_cache_shape(7, 16, 2, 64) == SDPABackend.get_kv_cache_shape(7, 16, 2, 64)
    assert A310PBackend.get_supported_kernel_block_sizes() == (128, 64)
