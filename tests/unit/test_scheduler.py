"""Scheduler invariants under random workloads (hypothesis), with the real KV cache manager and a fake runner."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.config import CacheConfig, SchedulerConfig
from ascent.core.kv_cache.hashing import make_block_hasher
from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request, RequestStatus
from ascent.core.sched_output import ModelRunnerOutput
from ascent.core.scheduler import Scheduler
from ascent.sampling_params import SamplingParams

BS = 4
MAX_LEN = 64


class FakeRunner:
    """Tracks what the runner would hold; samples a random token when a request reaches its last known token."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def execute(self, so) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.computed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.computed[new.req_id] = new.num_computed_tokens
            self.tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for req_id, c in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            assert self.computed[req_id] == c, "runner and scheduler disagree on computed tokens"
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            assert n > 0
            self.computed[req_id] += n
            assert self.computed[req_id] <= self.tokens[req_id], "scheduled beyond the known tokens"
            req_ids.append(req_id)
            if self.computed[req_id] == self.tokens[req_id]:
                tok = self.rng.randrange(3, 50)
                self.tokens[req_id] += 1
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def _run_workload(seed: int, num_reqs: int, num_blocks: int, budget: int, max_seqs: int, policy: str,
                  caching: bool, abort_some: bool) -> None:
    rng = random.Random(seed)
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BS, max_model_len=MAX_LEN, enable_caching=caching)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduling_policy=policy),
        CacheConfig(block_size=BS), MAX_LEN, mgr)
    hasher = make_block_hasher(BS)
    runner = FakeRunner(rng)
    shared = [rng.randrange(3, 50) for _ in range(9)]
    requests = []
    for i in range(num_reqs):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)
        req = Request(f"r{i}", prompt, params, arrival_time=float(i), priority=rng.randint(0, 3),
                      block_hasher=hasher if caching else None)
        requests.append(req)
        sched.add_request(req)
    finished: set[str] = set()
    for step in range(2000):
        if not sched.has_unfinished_requests():
            break
        if abort_some and step == 3:
            victims = [r.request_id for r in requests[::3]]
            sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
            finished.update(victims)
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs
        assert not (set(so.num_scheduled_tokens) & finished), "finished request scheduled"
        outs = sched.update_from_output(so, runner.execute(so))
        finished.update(o.request_id for o in outs if o.finished)
        held = [set(mgr.get_block_ids(r.request_id)) for r in sched.running]
        assert len(set().union(*held)) <= num_blocks - 1 and all(0 not in h for h in held)
    assert not sched.has_unfinished_requests(), "workload did not drain"
    capacity = (num_blocks - 1) * BS
    for req in requests:
        if req.status == RequestStatus.FINISHED_ABORTED:
            continue
        if req.num_output_tokens < req.max_tokens:  # capped only when the cache cannot hold it
            assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_tokens + 1 > capacity
        else:
            assert req.num_output_tokens == req.max_tokens
    assert mgr.num_free_blocks == num_blocks - 1 and mgr.usage == 0.0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_reqs=st.integers(1, 12),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    abort_some=st.booleans(),
)
def test_scheduler_invariants(seed, num_reqs, num_blocks, budget, max_seqs, policy, caching, abort_some):
    _run_workload(seed, num_reqs, num_blocks, budget, max_seqs, policy, caching, abort_some)


def test_fcfs_preempts_most_recent_and_requeues_first():
    mgr = KVCacheManager(num_blocks=5, block_size=BS, max_model_len=MAX_LEN, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(block_size=BS),
                      MAX_LEN, mgr)
    a = Request("a", list(range(3, 10)), SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", list(range(3, 10)), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(random.Random(0))
    preempted = []
    for _ in range(30):
        so = sched.schedule()
        preempted += list(so.preempted_req_ids)
        sched.update_from_output(so, runner.execute(so))
        if preempted:
            break
    assert preempted == ["b"]
    assert sched.waiting.peek() is b and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


def test_duplicate_request_id_rejected():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=MAX_LEN, enable_caching=False)
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS), MAX_LEN, mgr)
    sched.add_request(Request("x", [5, 6], SamplingParams()))
    try:
        sched.add_request(Request("x", [5, 6], SamplingParams()))
    except ValueError as exc:
        assert "x" in str(exc)
    else:
        raise AssertionError("duplicate id accepted")


def test_waiting_request_larger_than_the_cache_is_capped_not_waited_on_forever():
    mgr = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=MAX_LEN, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(block_size=BS),
                      MAX_LEN, mgr)
    big = Request("big", list(range(3, 23)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    small = Request("small", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=1.0)
    for req in (big, small):
        sched.add_request(req)
    runner = FakeRunner(random.Random(0))
    finished = {}
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert "big" not in so.num_scheduled_tokens
        finished.update({o.request_id: o.finish_reason for o in sched.update_from_output(so, runner.execute(so))
                         if o.finished})
    assert finished == {"big": "length", "small": "length"} and small.num_output_tokens == 2
    assert mgr.num_free_blocks == 3


def test_preempting_an_earlier_request_does_not_skip_the_next_one():
    """Priority policy, running [a, b, c]: b needs a block and the victim is a (earlier in the list, already
    scheduled this step); c, after b, must still be scheduled in the same step."""
    mgr = KVCacheManager(num_blocks=7, block_size=BS, max_model_len=MAX_LEN, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"),
                      CacheConfig(block_size=BS), MAX_LEN, mgr)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runner = FakeRunner(random.Random(0))

    def step():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        return so

    sched.add_request(Request("a", list(range(3, 9)), params, arrival_time=0.0, priority=5))  # admitted first
    step()
    sched.add_request(Request("b", list(range(3, 11)), params, arrival_time=1.0, priority=0))  # full blocks
    sched.add_request(Request("c", list(range(3, 10)), params, arrival_time=2.0, priority=0))
    so = step()
    assert set(so.num_scheduled_tokens) == {"a", "b", "c"} and mgr.num_free_blocks == 0
    so = step()  # a fits its next token, b needs a block: a (lowest priority) is preempted
    assert so.preempted_req_ids == {"a"}
    assert set(so.num_scheduled_tokens) == {"b", "c"}
