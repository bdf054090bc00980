"""The scheduler on its own: token budget, chunking, preemption, policies, abort."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams

BS = 4


def _sched(num_blocks=64, budget=32, max_seqs=8, policy="fcfs", threshold=0, chunked=True, caching=True):
    max_model_len = min(128, num_blocks * BS)
    kv = KVCacheManager(num_blocks, BS, max_model_len, enable_caching=caching)
    cfg = SchedulerConfig(max_seqs, budget, max_model_len, chunked, threshold, policy)
    return Scheduler(cfg, kv)


def _req(i, n, priority=0, arrival=None, max_tokens=8):
    return Request(
        str(i), list(range(i * 1000, i * 1000 + n)), SamplingParams(max_tokens=max_tokens), None, max_tokens,
        arrival_time=float(i) if arrival is None else arrival, priority=priority, block_hasher=make_block_hasher(BS),
    )


def _run_step(s, token=7):
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        req = s.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            sampled[rid] = [token]
    s.update_from_output(out, sampled)
    return out


def test_budget_is_shared_and_prefill_is_chunked():
    s = _sched(budget=32)
    s.add_request(_req(1, 20))
    s.add_request(_req(2, 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"1": 20, "2": 12}
    assert out.total_num_scheduled_tokens == 32
    assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "2"]


def test_running_first_then_waiting_decode_and_prefill_mix():
    s = _sched(budget=16)
    s.add_request(_req(1, 10))
    _run_step(s)
    s.add_request(_req(2, 30))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"1": 1, "2": 15}
    assert out.scheduled_cached_reqs.req_ids == ["1"]


def test_long_prefill_threshold_and_no_chunking():
    s = _sched(budget=64, threshold=8)
    s.add_request(_req(1, 20))
    assert s.schedule().num_scheduled_tokens == {"1": 8}
    s2 = _sched(budget=16, chunked=False)
    s2.add_request(_req(1, 10))
    s2.add_request(_req(2, 10))
    assert s2.schedule().num_scheduled_tokens == {"1": 10}


def test_max_num_seqs():
    s = _sched(max_seqs=2)
    for i in range(1, 4):
        s.add_request(_req(i, 4))
    assert set(s.schedule().num_scheduled_tokens) == {"1", "2"}


def test_preempts_latest_arrival_and_resumes_it_first():
    s = _sched(num_blocks=6, budget=64, caching=False)
    s.add_request(_req(1, 8, max_tokens=20))
    s.add_request(_req(2, 8, max_tokens=20))
    _run_step(s)
    for _ in range(10):
        out = _run_step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"2"}
    assert s.requests["2"].status == RequestStatus.PREEMPTED
    assert s.requests["2"].num_computed_tokens == 0
    assert s.waiting.peek().request_id == "2"
    while s.has_unfinished_requests():
        out = _run_step(s)
        if "2" in out.scheduled_cached_reqs.req_ids:
            idx = out.scheduled_cached_reqs.req_ids.index("2")
            if out.scheduled_cached_reqs.resumed_from_preemption[idx]:
                assert len(out.scheduled_cached_reqs.new_block_ids[idx]) >= 3
    assert s.kv.get_num_free_blocks() == 6
    assert s.num_preemptions >= 1


def test_priority_policy_admits_and_preempts_by_priority():
    s = _sched(max_seqs=1, policy="priority")
    s.add_request(_req(1, 4, priority=5))
    s.add_request(_req(2, 4, priority=0))
    assert list(s.schedule().num_scheduled_tokens) == ["2"]
    s = _sched(num_blocks=5, budget=64, policy="priority", caching=False)
    s.add_request(_req(1, 8, priority=0, max_tokens=20))
    s.add_request(_req(2, 8, priority=9, arrival=0.0, max_tokens=20))
    _run_step(s)
    preempted = set()
    for _ in range(6):
        preempted |= _run_step(s).preempted_req_ids
    assert preempted == {"2"}


def test_abort_running_and_waiting_frees_blocks():
    s = _sched(max_seqs=1)
    s.add_request(_req(1, 10))
    s.add_request(_req(2, 10))
    _run_step(s)
    s.finish_requests(["1", "2"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.get_num_free_blocks() == 64
    assert s.schedule().finished_req_ids == {"1", "2"}


def test_stop_conditions():
    s = _sched()
    r = _req(1, 4, max_tokens=3)
    r.eos_token_id = 9
    s.add_request(r)
    _run_step(s, token=5)
    _run_step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.get_finished_reason() == "stop"
    r2 = _req(2, 4, max_tokens=2)
    s.add_request(r2)
    _run_step(s)
    _run_step(s)
    assert r2.get_finished_reason() == "length"


def test_requests_in_flight_are_neither_scheduled_again_nor_preempted():
    """With a batch queue, a prompt whose first chunk is in flight waits for that step's
    output, and preemption passes over in-flight requests; with ``send_token_ids`` the
    cached requests carry the tokens they run."""
    kv = KVCacheManager(8, BS, 32, enable_caching=False)
    s = Scheduler(SchedulerConfig(8, 8, 32, send_token_ids=True), kv)
    s.add_request(_req(1, 12))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"1": 8} and s.in_flight == {"1"}
    assert s.schedule().total_num_scheduled_tokens == 0
    s.update_from_output(first, {})
    assert not s.in_flight
    second = s.schedule()
    assert second.num_scheduled_tokens == {"1": 4}
    assert second.scheduled_cached_reqs.new_token_ids == [list(range(1008, 1012))]
    s.update_from_output(second, {"1": [5]})
    third = s.schedule()
    assert third.scheduled_cached_reqs.new_token_ids == [[5]]
    s.update_from_output(third, {"1": [6]})


def test_preemption_passes_over_requests_in_flight():
    """Two steps in flight (1 and 2, then 3): when 1 needs a block, 2 is preempted, not the
    later 3 whose step is still running."""
    s = _sched(num_blocks=4, budget=8)
    s.add_request(_req(1, 4))
    s.add_request(_req(2, 4))
    first = s.schedule()
    s.add_request(_req(3, 8))
    second = s.schedule()
    assert list(first.num_scheduled_tokens) == ["1", "2"] and list(second.num_scheduled_tokens) == ["3"]
    s.update_from_output(first, {"1": [5], "2": [5]})
    third = s.schedule()
    assert third.preempted_req_ids == {"2"} and third.num_scheduled_tokens == {"1": 1}
    assert s.in_flight == {"1", "3"}


def test_draft_lengths_stop_at_what_max_tokens_leaves_room_for():
    """With 3 drafts per step, a request of ``max_tokens=4`` gets 2 after its prefill (the
    step emits its first token; drafts past its last would be cut unverified) and none
    once the step may emit its last."""
    kv = KVCacheManager(64, BS, 128)
    s = Scheduler(SchedulerConfig(8, 32, 128, num_speculative_tokens=3), kv)
    s.add_request(_req(1, 8, max_tokens=4))
    s.add_request(_req(2, 8, max_tokens=2))
    s.add_request(_req(3, 8, max_tokens=100))
    out = s.schedule()
    assert out.draft_lengths == {"1": 2, "3": 3}
