"""Regression tests for bugs found in the scheduler, the KV-cache manager and the engine core."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_checkpoint
from core.test_scheduler_stress import PagedStore, check_invariants, digest, expected_output

from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.outputs import CompletionOutput
from tokenmill.worker.input_batch import InputBatch

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), max_position_embeddings=2048)


def _run(llm: LLM, requests: list[tuple[list[int], SamplingParams, int]], add_second_after: int = 0, max_steps: int = 500):
    """Add the first request, step ``add_second_after`` times, add the rest, step to the end
    (at most ``max_steps``); return each request's completion."""
    engine = llm.llm_engine
    outputs: dict[str, CompletionOutput] = {}
    for i, (ids, params, priority) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params, priority=priority)
        if i == 0:
            for _ in range(add_second_after):
                for out in engine.step():
                    outputs[out.request_id] = out.outputs[0]
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    assert not engine.has_unfinished_requests(), "the engine stopped making progress"
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return [outputs[str(i)] for i in range(len(requests))]


def test_preempted_request_past_the_watermark_is_readmitted(tiny_llama):
    """A running request may grow past ``num_blocks - watermark``; once preempted it must still
    be admitted again, or it blocks the queue forever."""
    long_prompt = [(7 * i) % 200 + 1 for i in range(1180)]
    requests = [
        ([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), 0),
        (long_prompt, SamplingParams(temperature=0, max_tokens=19, ignore_eos=True), 0),
    ]
    llm = LLM(tiny_llama, num_kv_blocks=300, block_size=4)
    got = _run(llm, requests)
    assert llm.get_stats()["num_preemptions"] > 0
    roomy = LLM(tiny_llama, num_kv_blocks=1000, block_size=4, max_model_len=1200)
    assert [o.token_ids for o in got] == [o.token_ids for o in _run(roomy, requests)]


def test_victim_scheduled_earlier_in_the_step_leaves_no_uncomputed_block_cached():
    """Under priority scheduling the victim can be a request already scheduled this step: the
    blocks it had just indexed were never written and must not be hit later."""
    bs, num_blocks = 2, 12
    kv = KVCacheManager(num_blocks, bs, num_blocks * bs, enable_caching=True)
    s = Scheduler(SchedulerConfig(4, 64, num_blocks * bs, True, 8, "priority"), kv)
    store = PagedStore(s, bs)
    low = Request("low", list(range(10, 32)), SamplingParams(max_tokens=1), None, 1, arrival_time=0.0, priority=2, block_hasher=make_block_hasher(bs))
    high = Request("high", [1, 2], SamplingParams(max_tokens=30), None, 30, arrival_time=1.0, priority=1, block_hasher=make_block_hasher(bs))
    contents: dict = {}
    s.add_request(low)
    for step in range(80):
        if step == 1:
            s.add_request(high)
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, store.execute(out))
        for r in (low, high):
            for i, h in enumerate(r.block_hashes):
                contents[h] = [digest(r.all_token_ids[: i * bs + j + 1]) for j in range(bs)]
        check_invariants(s, store, contents)
    assert s.num_preemptions == 1
    assert low.output_token_ids == expected_output(low.prompt_token_ids, 1, num_blocks * bs)
    assert high.output_token_ids == expected_output(high.prompt_token_ids, 30, num_blocks * bs)


def test_priority_preemption_with_prefix_caching_same_outputs(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0)
    requests = [(list(range(10, 32)), params, 2), ([1, 2], params, 1)]
    common = dict(block_size=2, num_kv_blocks=12, long_prefill_token_threshold=8, scheduling_policy="priority", watermark=0.0)
    cached = LLM(tiny_llama, enable_prefix_caching=True, **common)
    got = _run(cached, requests, add_second_after=1)
    assert cached.get_stats()["num_preemptions"] > 0
    want = _run(LLM(tiny_llama, enable_prefix_caching=False, **common), requests, add_second_after=1)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert [v.logprob for d in a.logprobs for v in d.values()] == pytest.approx(
            [v.logprob for d in b.logprobs for v in d.values()], abs=1e-4
        )


def test_failed_step_does_not_poison_the_prefix_cache(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4)
    prompt = {"prompt_token_ids": list(range(30, 60))}
    executor = llm.llm_engine.engine_core.engine_core.executor

    def broken(scheduler_output):
        raise RuntimeError("kernel error")

    monkeypatch.setattr(executor, "execute_model", broken)
    with pytest.raises(RuntimeError, match="kernel error"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.get_num_unfinished_requests() == 0

    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    reference = LLM(tiny_llama, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == reference.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_long_prefill_threshold_without_chunked_prefill_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="needs enable_chunked_prefill=True"):
        LLM(tiny_llama, enable_chunked_prefill=False, long_prefill_token_threshold=8)


def test_prefix_cache_queries_count_each_admission_once():
    bs = 4
    kv = KVCacheManager(4, bs, 16, enable_caching=True)
    s = Scheduler(SchedulerConfig(4, 64, 16, True, 0, "fcfs"), kv)
    store = PagedStore(s, bs)
    first = Request("a", list(range(13)), SamplingParams(max_tokens=4), None, 4, block_hasher=make_block_hasher(bs))
    second = Request("b", list(range(12)) + [99, 98], SamplingParams(max_tokens=1), None, 1, block_hasher=make_block_hasher(bs))
    s.add_request(first)
    s.add_request(second)
    steps_waited = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        steps_waited += "b" not in s.requests or second in s.waiting
        s.update_from_output(out, store.execute(out))
    assert steps_waited > 1
    assert kv.stats.queries == first.num_prompt_tokens + second.num_prompt_tokens
    assert kv.stats.hits == 12


def test_input_batch_row_outlives_a_failed_add():
    """A request whose row failed to fill kept the row taken: after ``max_num_seqs`` of them
    every request failed with IndexError (issue 36, item 10). A ``top_k`` of at least the
    vocabulary size is off, as in vLLM, where 2**63 used to overflow the int64 row."""
    batch = InputBatch(1, 8, 2, 16, torch.device("cpu"))
    params = SamplingParams(top_k=2**63)
    for _ in range(3):
        with pytest.raises(ValueError):
            batch.add("too-long", list(range(9)), 9, [0], 0, params, [])
    state = batch.add("fits", [1, 2, 3], 3, [0], 0, params, [])
    assert state.row == 0 and batch.top_k[0] == 0 and batch.token_list(0) == [1, 2, 3]
    batch.remove("fits")
    state = batch.add("top-k", [4], 1, [1], 0, SamplingParams(top_k=15), [])
    assert batch.top_k[state.row] == 15
