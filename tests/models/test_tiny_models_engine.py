"""Whole-engine greedy generation on tiny random Llama, Mistral and Qwen2 models against HF."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_greedy_close, hf_greedy, make_tiny_checkpoint
from tokenmill import LLM, SamplingParams

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-qkv-bias": ("qwen2", {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_matches_hf(tmp_path, case):
    arch, overrides = CASES[case]
    path = make_tiny_checkpoint(tmp_path / case, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 33, 64)]
    llm = LLM(model=path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=40, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref, scores = hf_greedy(hf, prompt, 20)
        assert_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, scores)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
