"""The first-party connectors on the default model: greedy tokens and logprobs equal those of
an engine without a connector, with the blocks loaded (storage: by a second engine; offload:
after the device cache evicted them)."""

from __future__ import annotations

import pytest

from conftest import assert_same_completions
from tokenmill import LLM, RequestOutput, SamplingParams

pytestmark = pytest.mark.slow
"""Five default-model engines: minutes on two shared cores (tests/kv_connectors/ covers the
same on tiny models in the fast suite)."""

BLOCKS = 24
PROMPT = [(i * 7919) % 40000 + 100 for i in range(200)]
FILLER = [(i * 104729) % 40000 + 100 for i in range(200)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
LOADED = (len(PROMPT) - 1) // 16 * 16


def _run(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def baseline() -> list[RequestOutput]:
    return _run(LLM(num_kv_blocks=BLOCKS), [PROMPT, FILLER, PROMPT])


def test_storage_connector_equal(baseline, tmp_path):
    config = {"kv_connector": "storage", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    assert_same_completions(_run(LLM(num_kv_blocks=BLOCKS, kv_transfer_config=config), [PROMPT]), baseline[:1])
    consumer = LLM(num_kv_blocks=BLOCKS, kv_transfer_config=config)
    assert_same_completions(_run(consumer, [PROMPT]), baseline[:1])
    assert consumer.get_stats()["external_prefix_cache_hit_tokens"] == LOADED


def test_offload_connector_equal(baseline):
    config = {"kv_connector": "offload", "kv_connector_extra_config": {"host_gib": 0.5}}
    llm = LLM(num_kv_blocks=BLOCKS, kv_transfer_config=config)
    out = [*_run(llm, [PROMPT]), *_run(llm, [FILLER]), *_run(llm, [PROMPT])]
    assert_same_completions(out, baseline)
    assert llm.get_stats()["external_prefix_cache_hit_tokens"] > 0
