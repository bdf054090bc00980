"""Scheduling features change nothing in greedy outputs, and never leak KV blocks."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts(tokenizer) -> list[dict]:
    rng = random.Random(0)
    texts = [
        "The history of the Roman Empire",
        "Photosynthesis is the process by which",
        "A good recipe for pancakes needs",
        "The theory of relativity says",
        "Rust and Python differ in",
        "The tallest mountain in the world",
    ]
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    prompts += [{"prompt_token_ids": shared + [rng.randrange(100, 40000) for _ in range(n)]} for n in (3, 25, 60)]
    return prompts


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return _prompts(default_tokenizer)


@pytest.fixture(scope="module")
def reference(prompts):
    llm = LLM(enable_prefix_caching=False, num_kv_blocks=512, max_model_len=2048)
    return _generate(llm, prompts)


def test_prefix_caching_same_outputs(prompts, reference):
    llm = LLM(enable_prefix_caching=True, num_kv_blocks=512, max_model_len=2048)
    assert _generate(llm, prompts) == reference
    assert _generate(llm, prompts) == reference
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] > 0


def test_chunked_prefill_small_budget_same_outputs(prompts, reference):
    llm = LLM(max_num_batched_tokens=32, num_kv_blocks=512, max_model_len=2048)
    assert _generate(llm, prompts) == reference


def test_preemption_same_outputs(prompts, reference):
    llm = LLM(num_kv_blocks=16, max_model_len=256, enable_prefix_caching=False, watermark=0.0)
    assert _generate(llm, prompts) == reference
    assert llm.get_stats()["num_preemptions"] > 0


def test_preemption_with_prefix_caching_same_outputs(prompts, reference):
    llm = LLM(num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=48, watermark=0.0)
    assert _generate(llm, prompts) == reference
    assert llm.get_stats()["num_preemptions"] > 0


def test_shared_512_token_prefix_is_cached(default_llm):
    llm = default_llm
    hits_before = llm.get_stats()["prefix_cache_hit_tokens"]
    rng = random.Random(1)
    prefix = [rng.randrange(100, 40000) for _ in range(512)]
    first = llm.generate({"prompt_token_ids": prefix + [11, 12, 13]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate({"prompt_token_ids": prefix + [21, 22]}, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 512
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] - hits_before >= 512
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_abort_mid_flight_frees_blocks(default_llm):
    llm = default_llm
    finished_before = llm.get_stats()["num_requests_finished"]
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": list(range(100, 160 + i))}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    aborted = engine.abort_request(["1", "3"])
    assert {o.request_id for o in aborted} == {"1", "3"}
    assert all(o.outputs[0].finish_reason == "abort" and o.finished for o in aborted)
    engine.abort_request("0")
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_finished"] - finished_before == 4


def test_abort_waiting_request_frees_nothing_twice():
    llm = LLM(num_kv_blocks=64, max_model_len=512, max_num_seqs=1)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [100] * 40}, SamplingParams(max_tokens=8))
    engine.add_request("b", {"prompt_token_ids": [101] * 40}, SamplingParams(max_tokens=8))
    engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
