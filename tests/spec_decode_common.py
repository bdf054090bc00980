"""What the speculative-decoding test modules share: random prompts (two with a common
prefix, for prefix-cache hits), the engines they compare, and a generate that checks every
KV block came back."""

from __future__ import annotations

import random

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINES = {
    "plain": {"num_kv_blocks": 256},
    "chunked": {"num_kv_blocks": 256, "max_num_batched_tokens": 32},
    "preempting": {"num_kv_blocks": 24},
}
"""Engine settings every proposer is checked under: plain, chunked prefill, preempting."""


def random_prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    prompts += [shared + [rng.randrange(256) for _ in range(n)] for n in (2, 40)]
    return [{"prompt_token_ids": p} for p in prompts]


def generate(llm: LLM, prompts, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    """Output token ids per prompt; asserts every KV block is free afterwards."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return [o.outputs[0].token_ids for o in outputs]
