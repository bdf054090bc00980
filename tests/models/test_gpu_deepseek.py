"""DeepSeek-V3 (MLA + MoE) through the whole engine on the GPU: the Triton MLA decode kernel and
the Triton fused-MoE kernel give HF's greedy tokens."""

from __future__ import annotations

import random

import pytest

from conftest import assert_greedy_close, hf_greedy
from support.deepseek_checkpoints import COMMON, save_deepseek
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton_mla", "torch_mla"])
def test_v3_greedy_matches_hf_on_gpu(tmp_path, backend):
    path, hf = save_deepseek(tmp_path, "v3")
    rng = random.Random(0)
    prompts = [[rng.randrange(COMMON["vocab_size"]) for _ in range(n)] for n in (3, 17, 40, 57)]
    llm = LLM(
        model=path, attention_backend=backend, dtype="float32", num_kv_blocks=64, block_size=16,
        max_model_len=256, max_num_batched_tokens=32,
    )
    assert llm.get_stats()["kv_blocks_total"] == 64
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref, scores = hf_greedy(hf, prompt, 16)
        assert_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, scores)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
