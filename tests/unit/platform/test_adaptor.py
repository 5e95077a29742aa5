"""DeviceAdaptor ops (base, A5, 310P) against naive Python-loop / float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ascent.platform.adaptor import A5DeviceAdaptor, A310PDeviceAdaptor, DeviceAdaptor
from ascent.platform.ops_utils import from_fractal_nz, to_fractal_nz

ADAPTORS = [DeviceAdaptor(), A5DeviceAdaptor(), A310PDeviceAdaptor()]
IDS = ["base", "a5", "310p"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _paged_fixture(seed: int, num_blocks: int = 8, bs: int = 4, hkv: int = 2, d: int = 8):
    g = _gen(seed)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    return g, kc, vc


# ----- reshape_and_cache -----
@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_loop(adaptor: DeviceAdaptor, cache_dtype: torch.dtype) -> None:
    g = _gen(0)
    nb, bs, hkv, d, t = 5, 4, 2, 3, 9
    key, value = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    kc = torch.zeros(nb, bs, hkv, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    slots = [7, -1, 0, 19, 3, -1, 12, 13]  # 8 < t: row 8 is padding too
    adaptor.reshape_and_cache(key, value, kc, vc, torch.tensor(slots, dtype=torch.int32))
    ek, ev = torch.zeros_like(kc), torch.zeros_like(vc)
    for row, s in enumerate(slots):
        if s >= 0:
            for h in range(hkv):
                for i in range(d):
                    ek[s // bs, s % bs, h, i] = key[row, h, i].item()
                    ev[s // bs, s % bs, h, i] = value[row, h, i].item()
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_reshape_and_cache_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="must be \\[T, Hkv, D\\]"):
        DeviceAdaptor().reshape_and_cache(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4, 2, 4),
                                          torch.zeros(2, 4, 2, 4), torch.tensor([0, 1]))


def test_310p_nz_cache_layout_and_write() -> None:
    g = _gen(1)
    nb, bs, hkv, d, t = 3, 16, 2, 16, 5
    key, value = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    slots = torch.tensor([3, 17, -1, 40, 31])
    a = A310PDeviceAdaptor()
    knz = torch.zeros(nb, hkv * d // 16, bs, 16)
    vnz = torch.zeros_like(knz)
    a.reshape_and_cache_nz(key, value, knz, vnz, slots)
    expected = torch.zeros_like(knz)
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            flat = key[row].reshape(-1)
            for c in range(hkv * d):
                expected[s // bs, c // 16, s % bs, c % 16] = flat[c]
    assert torch.equal(knz, expected)
    kc, vc = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    a.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(a.kv_cache_to_nz(kc), knz) and torch.equal(a.kv_cache_to_nz(vc), vnz)
    assert torch.equal(a.kv_cache_from_nz(knz, hkv, d), kc)
    with pytest.raises(ValueError, match="multiples of 16"):
        a.kv_cache_to_nz(torch.zeros(2, 8, 2, 16))


def test_fractal_nz_round_trip_and_mask_corner() -> None:
    x = torch.arange(20 * 35, dtype=torch.float32).view(20, 35)
    nz = to_fractal_nz(x)
    assert nz.shape == (3, 32, 16)
    for m in range(20):
        for n in range(35):
            assert nz[n // 16, m, n % 16] == x[m, n]
    assert torch.equal(from_fractal_nz(nz, 20, 35), x)
    L = 64
    mask = torch.triu(torch.full((L, L), float("-inf"), dtype=torch.float16), diagonal=1)
    nzm = to_fractal_nz(mask).unsqueeze(0)
    assert nzm.shape == (1, L // 16, L, 16) and nzm[0][-1][0][-1] == float("-inf")


# ----- index_fill -----
@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_fill(adaptor: DeviceAdaptor, dim: int) -> None:
    x = torch.randn(4, 5, 3, generator=_gen(2))
    idx = torch.tensor([0, -1, 2])
    out = adaptor.index_fill(x.clone(), dim, idx, 7.0)
    expected = x.clone()
    size = x.shape[dim]
    chosen = {i % size for i in idx.tolist()}
    for a in range(4):
        for b in range(5):
            for c in range(3):
                pos = (a, b, c)[dim]
                if pos in chosen:
                    expected[a, b, c] = 7.0
    assert torch.equal(out, expected)
    y = x.clone()
    assert torch.equal(adaptor.index_fill(y, dim, torch.tensor([], dtype=torch.int64), 1.0), x)


# ----- paged gathers -----
@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_gather_paged_kv_and_kv_cache_load(adaptor: DeviceAdaptor) -> None:
    g, kc, vc = _paged_fixture(3)
    bs = kc.shape[1]
    block_table = torch.tensor([[5, 2, 7, 0], [1, 3, 0, 0], [6, 4, 0, 0]], dtype=torch.int32)
    lens, starts = [9, 5, 0], [2, 0, 3]
    k, v, cu = adaptor.gather_paged_kv(kc, vc, block_table, lens, starts)
    ek, ev = [], []
    for i, (n, s) in enumerate(zip(lens, starts)):
        for p in range(s, s + n):
            blk = int(block_table[i, p // bs])
            ek.append(kc[blk, p % bs])
            ev.append(vc[blk, p % bs])
    assert torch.equal(k, torch.stack(ek)) and torch.equal(v, torch.stack(ev))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 14, 14]
    out_a, out_b = torch.full((20, *kc.shape[2:]), -5.0), torch.full((20, *vc.shape[2:]), -5.0)
    a, b = adaptor.kv_cache_load(kc, vc, block_table, np.array(lens), torch.tensor(starts), out_a, out_b)
    assert torch.equal(a, torch.stack(ek)) and torch.equal(out_a[:14], torch.stack(ek))
    assert torch.equal(out_b[:14], torch.stack(ev)) and bool((out_a[14:] == -5).all())
    with pytest.raises(ValueError, match="blocks"):
        adaptor.gather_paged_kv(kc, vc, block_table, [17, 1, 1])


# ----- attention -----
def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """float64 loop: q [Lq, Hq, D], k/v [Lk, Hkv, D], bottom-right causal."""
    lq, hq, _ = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    for i in range(lq):
        for h in range(hq):
            kh = h // (hq // hkv)
            visible = [j for j in range(lk) if not causal or j <= lk - lq + i]
            logits = [float((qd[i, h] * kd[j, kh]).sum()) * scale for j in visible]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            total = sum(w)
            for wj, j in zip(w, visible):
                out[i, h] += (wj / total) * vd[j, kh]
    return out


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_paged_attention_decode(adaptor: DeviceAdaptor) -> None:
    g, kc, vc = _paged_fixture(4, hkv=2, d=8)
    hq, scale = 4, 0.37
    block_table = torch.tensor([[5, 2, 7], [1, 3, 0], [6, 0, 0]])
    lens = [10, 5, 1]
    q = torch.randn(3, hq, 8, generator=g)
    out = adaptor.paged_attention_decode(q, kc, vc, block_table, torch.tensor(lens), scale)
    for i, n in enumerate(lens):
        k, v, _ = DeviceAdaptor().gather_paged_kv(kc, vc, block_table[i: i + 1], [n])
        ref = _attention_ref(q[i: i + 1], k, v, scale, causal=False)[0]
        torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)


def _large_head_case(seed: int, d: int, hq: int, hkv: int, computed: list[int], q_lens: list[int], bs: int = 4):
    """Random per-request context + new tokens; the cache holds all of them (new K/V written first)."""
    g = _gen(seed)
    seq_lens = [c + n for c, n in zip(computed, q_lens)]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    nb = max_blocks * len(q_lens) + 1
    perm = torch.randperm(nb - 1, generator=g)[: max_blocks * len(q_lens)] + 1
    block_table = perm.view(len(q_lens), max_blocks)
    kc, vc = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    full_k = [torch.randn(s, hkv, d, generator=g) for s in seq_lens]
    full_v = [torch.randn(s, hkv, d, generator=g) for s in seq_lens]
    for i, s in enumerate(seq_lens):
        slots = torch.tensor([int(block_table[i, p // bs]) * bs + p % bs for p in range(s)])
        DeviceAdaptor().reshape_and_cache(full_k[i], full_v[i], kc, vc, slots)
    t = sum(q_lens)
    q = torch.randn(t + 2, hq, d, generator=g)  # 2 padding rows
    new_k = torch.cat([fk[c:] for fk, c in zip(full_k, computed)] + [torch.zeros(2, hkv, d)])
    new_v = torch.cat([fv[c:] for fv, c in zip(full_v, computed)] + [torch.zeros(2, hkv, d)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, new_k, new_v, kc, vc, block_table, seq_lens, qsl, full_k, full_v


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_large_head_prefill_with_cache_head512(adaptor: DeviceAdaptor, causal: bool) -> None:
    d, hq, hkv, scale = 512, 4, 2, 512 ** -0.5
    computed, q_lens = [5, 0, 3], [3, 4, 1]
    q, nk, nv, kc, vc, bt, seq_lens, qsl, full_k, full_v = _large_head_case(5, d, hq, hkv, computed, q_lens)
    out = adaptor.large_head_prefill_attention(q, nk, nv, query_start_loc=torch.from_numpy(qsl), scale=scale,
                                               seq_lens=seq_lens, key_cache=kc, value_cache=vc, block_table=bt,
                                               causal=causal, query_chunk=2)
    assert out.shape == (sum(q_lens), hq, d)
    for i in range(len(q_lens)):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        qi = q[rows].transpose(0, 1).unsqueeze(0)
        ki = full_k[i].transpose(0, 1).unsqueeze(0).repeat_interleave(hq // hkv, dim=1)
        vi = full_v[i].transpose(0, 1).unsqueeze(0).repeat_interleave(hq // hkv, dim=1)
        lq, lk = q_lens[i], seq_lens[i]
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            mask = torch.tensor([[j <= lk - lq + r for j in range(lk)] for r in range(lq)])
        dense = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        torch.testing.assert_close(out[rows], dense, atol=1e-5, rtol=1e-5)
    ref = _attention_ref(q[int(qsl[0]): int(qsl[1])], full_k[0], full_v[0], scale, causal)
    torch.testing.assert_close(out[: q_lens[0]].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("adaptor", ADAPTORS, ids=IDS)
def test_large_head_prefill_no_cache(adaptor: DeviceAdaptor) -> None:
    d, hq, hkv, scale = 512, 2, 1, 0.05
    q, nk, nv, kc, vc, bt, seq_lens, qsl, full_k, full_v = _large_head_case(6, d, hq, hkv, [0, 0], [5, 3])
    out = adaptor.large_head_prefill_attention(q, nk, nv, query_start_loc=qsl.tolist(), scale=scale,
                                               key_cache=kc, value_cache=vc, block_table=bt, seq_lens=seq_lens,
                                               prefill_no_cache=True)
    for i in range(2):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        dense = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), full_k[i].transpose(0, 1).expand(hq, -1, -1),
            full_v[i].transpose(0, 1).expand(hq, -1, -1), is_causal=True, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[rows], dense, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_table"):
        adaptor.large_head_prefill_attention(q, nk, nv, query_start_loc=qsl, scale=scale, seq_lens=seq_lens,
                                             key_cache=kc, value_cache=vc)
