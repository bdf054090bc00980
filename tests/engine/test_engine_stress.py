"""Randomized workloads through the whole engine on a tiny random Llama: the real model runner
(persistent batch, preempted state, backends) under tiny caches, chunking, priorities, prefix
sharing, aborts and failed steps. Every request that finishes normally must match the same
prompt generated with room to spare (greedy; at a first divergence, each side's token in the
other's top-5), and no block may leak."""

from __future__ import annotations

import random

import pytest
from conftest import make_tiny_checkpoint

from tokenmill import LLM, SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=512, block_size=16, enable_prefix_caching=False)


def _close(ours, ref) -> bool:
    """Equal tokens, or at the first divergence each side's token in the other's top-5."""
    for k, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a != b:
            return a in ref.logprobs[k] and b in ours.logprobs[k]
    return len(ours.token_ids) == len(ref.token_ids)


def _broken_execute(scheduler_output):
    raise RuntimeError("injected")


def run_case(seed: int, model: str, roomy: LLM) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_blocks = rng.randint(96 // block_size, 400 // block_size)
    chunked = rng.random() < 0.8
    llm = LLM(
        model,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.choice([8, 32, 512]) if chunked else None,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([0, 12]) if chunked else 0,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_prefix_caching=rng.random() < 0.7,
        watermark=rng.choice([0.0, 0.05]),
        attention_backend=rng.choice(["torch", "cpu_sdpa"]),
    )
    engine = llm.llm_engine
    max_prompt = engine.engine_core.max_prompt_tokens
    shared = [rng.randrange(VOCAB) for _ in range(48)]
    prompts, params = {}, {}
    for i in range(rng.randint(3, 8)):
        ids = shared[: rng.randint(0, 48)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        prompts[str(i)] = ids[:max_prompt]
        params[str(i)] = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True, logprobs=5)
    fail_at = rng.choice([None, rng.randint(1, 10)])
    executor = engine.engine_core.engine_core.executor
    real_execute = executor.execute_model

    pending, finished, step = list(prompts), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and (rng.random() < 0.5 or not engine.has_unfinished_requests()):
            rid = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, params[rid], priority=rng.randint(0, 2))
        if rng.random() < 0.05:
            engine.abort_request(rng.choice(list(prompts)))
        step += 1
        assert step < 5000, f"seed {seed}: no progress"
        if step == fail_at:
            executor.execute_model = _broken_execute
        try:
            outputs = engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            executor.execute_model = real_execute
            engine.abort_request([r for r in prompts if r not in finished])
            continue
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], f"seed {seed}: blocks leaked"

    done = [r for r, c in finished.items() if c.finish_reason == "length"]
    refs = roomy.generate([{"prompt_token_ids": prompts[r]} for r in done], [params[r] for r in done], use_tqdm=False)
    for rid, ref in zip(done, refs):
        assert _close(finished[rid], ref.outputs[0]), f"seed {seed}: request {rid} differs"


@pytest.mark.parametrize("seed", range(12))
def test_random_engine_workloads(seed, tiny_llama, roomy):
    run_case(seed, tiny_llama, roomy)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 60))
def test_random_engine_workloads_long(seed, tiny_llama, roomy):
    run_case(seed, tiny_llama, roomy)
