"""Process-group reuse registry: keying (sorted ranks, backend, normalised options, reuse domain), reference counts,
fail-closed cases, the non-member sentinel and clearing. Handles are plain objects; real gloo groups are covered by
tests/integration/test_distributed_comm.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ascent.distributed.pg_registry import (
    SHARED_DOMAIN,
    ProcessGroupRegistry,
    make_key,
    normalize_options,
    reuse_domain_for,
)

SENTINEL = object()


class Handle:
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)


class Recorder:
    """create/destroy callbacks that record what the registry asked for."""

    def __init__(self) -> None:
        self.created: list[Handle] = []
        self.destroyed: list[object] = []

    def create(self, ranks: list[int]):
        def make() -> Handle:
            handle = Handle(ranks)
            self.created.append(handle)
            return handle

        return make

    def registry(self, check_ranks: bool = True) -> ProcessGroupRegistry:
        return ProcessGroupRegistry(destroy_fn=self.destroyed.append,
                                    ranks_of=(lambda h: h.ranks) if check_ranks else None,
                                    is_sentinel=lambda h: h is SENTINEL)


def test_same_key_reuses_one_group_and_counts_references() -> None:
    rec = Recorder()
    reg = rec.registry()
    a = reg.acquire([1, 0], "gloo", None, "shared", rec.create([0, 1]))
    b = reg.acquire([0, 1], "GLOO", {}, "shared", rec.create([0, 1]))
    assert a.handle is b.handle and len(rec.created) == 1
    assert (reg.hits, reg.misses, len(reg)) == (1, 1, 1)
    key = make_key([0, 1], "gloo")
    assert a.key == key and reg.refcount(key) == 2
    reg.release(a)
    assert rec.destroyed == [] and reg.refcount(key) == 1
    reg.release(b)
    assert rec.destroyed == [a.handle] and len(reg) == 0
    with pytest.raises(ValueError, match="already released"):
        reg.release(b)


@pytest.mark.parametrize("other", [
    dict(ranks=[0, 2]),
    dict(backend="nccl"),
    dict(options={"timeout": timedelta(seconds=5)}),
    dict(domain="eplb"),
])
def test_any_key_field_difference_creates_a_new_group(other) -> None:
    rec = Recorder()
    reg = rec.registry()
    base = reg.acquire([0, 1], "gloo", None, "shared", rec.create([0, 1]))
    ranks = other.get("ranks", [0, 1])
    lease = reg.acquire(ranks, other.get("backend", "gloo"), other.get("options"), other.get("domain", "shared"),
                        rec.create(ranks))
    assert lease.handle is not base.handle and len(rec.created) == 2 and len(reg) == 2


def test_options_are_normalised_and_identity_fields_ignored() -> None:
    a = normalize_options({"b": 2, "a": [1, {"y": 1, "x": 2}], "group_name": "tp"})
    b = normalize_options({"group_name": "world", "a": (1, {"x": 2, "y": 1}), "b": 2})
    assert a == b == (("a", (1, (("x", 2), ("y", 1)))), ("b", 2))
    assert normalize_options(None) == () and normalize_options({"group_desc": "x"}) == ()
    assert normalize_options({"timeout": timedelta(seconds=3)}) == (("timeout", ("timedelta", 3.0)),)


def test_unnormalisable_options_fail_closed() -> None:
    rec = Recorder()
    reg = rec.registry()
    opts = {"hook": object()}
    assert normalize_options(opts) is None and normalize_options(42) is None
    a = reg.acquire([0, 1], "gloo", opts, "shared", rec.create([0, 1]))
    b = reg.acquire([0, 1], "gloo", opts, "shared", rec.create([0, 1]))
    assert a.key is None and b.key is None and a.handle is not b.handle and len(reg) == 0
    reg.release(a)
    assert rec.destroyed == [a.handle]


def test_group_whose_members_differ_fails_closed() -> None:
    rec = Recorder()
    reg = rec.registry()
    wrong = reg.acquire([0, 1], "gloo", None, "shared", rec.create([0, 3]))
    again = reg.acquire([0, 1], "gloo", None, "shared", rec.create([0, 1]))
    assert wrong.key is None and again.key is not None and again.handle is not wrong.handle
    assert len(rec.created) == 2


def test_isolated_reuse_domains() -> None:
    assert reuse_domain_for("tp") == SHARED_DOMAIN == reuse_domain_for("world")
    assert reuse_domain_for("eplb") == "eplb" and reuse_domain_for("eplb_swap") == "eplb_swap"
    assert reuse_domain_for("mc2") == "mc2"
    rec = Recorder()
    reg = rec.registry()
    tp = reg.acquire([0, 1], "gloo", None, reuse_domain_for("tp"), rec.create([0, 1]))
    world = reg.acquire([0, 1], "gloo", None, reuse_domain_for("world"), rec.create([0, 1]))
    eplb = reg.acquire([0, 1], "gloo", None, reuse_domain_for("eplb"), rec.create([0, 1]))
    assert tp.handle is world.handle and eplb.handle is not tp.handle


def test_sentinel_is_cached_but_never_destroyed() -> None:
    rec = Recorder()
    reg = rec.registry()
    first = reg.acquire([2, 3], "gloo", None, "shared", lambda: SENTINEL)
    second = reg.acquire([2, 3], "gloo", None, "shared", rec.create([2, 3]))
    assert first.handle is SENTINEL and second.handle is SENTINEL and rec.created == []
    reg.release(first)
    reg.release(second)
    assert rec.destroyed == [] and len(reg) == 0


def test_failed_creation_leaves_nothing_behind() -> None:
    rec = Recorder()
    reg = rec.registry()

    def boom():
        raise RuntimeError("rendezvous failed")

    with pytest.raises(RuntimeError, match="rendezvous failed"):
        reg.acquire([0, 1], "gloo", None, "shared", boom)
    assert len(reg) == 0
    lease = reg.acquire([0, 1], "gloo", None, "shared", rec.create([0, 1]))
    assert reg.refcount(lease.key) == 1


def test_per_group_destroy_fn_and_clear() -> None:
    rec = Recorder()
    reg = rec.registry(check_ranks=False)
    kept: list[object] = []
    world = reg.acquire([0, 1], "gloo", None, "shared", rec.create([0, 1]), destroy_fn=kept.append)
    other = reg.acquire([0, 1, 2], "gloo", None, "shared", rec.create([0, 1, 2]))
    unshared = reg.acquire([0, 1], "gloo", {"x": object()}, "shared", rec.create([0, 1]))
    reg.clear()
    assert kept == [world.handle]
    assert set(map(id, rec.destroyed)) == {id(other.handle), id(unshared.handle)}
    assert len(reg) == 0
    reg.release(other)  # a lease voided by clear() releases nothing
    assert len(rec.destroyed) == 2


@pytest.mark.parametrize("ranks, backend, match", [([], "gloo", "ranks"), ([0, 0], "gloo", "ranks"),
                                                   ([0, 1], "", "backend")])
def test_bad_keys_are_value_errors(ranks, backend, match) -> None:
    with pytest.raises(ValueError, match=match):
        make_key(ranks, backend)
