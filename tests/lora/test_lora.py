"""LoRA adapters on the default model: greedy tokens equal PEFT's over HF transformers, mixed
batches give every request its solo tokens (also with fewer slots than adapters, chunked
prefill and preemption), prefix caching keeps adapters apart, the engine process carries the
adapter, n-gram speculative decoding keeps the tokens."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from conftest import assert_greedy_close, hf_greedy
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.output_processor import RequestOutputKind

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The three primary colors are",
    "In 1969, humans",
    "The quick brown fox",
    "Water boils at",
    "My favorite food is",
]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=ALL),
}
B_STD = 0.15
"""PEFT starts B at zero; a random B this large moves the greedy tokens off the base model's."""
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_default_model, default_tokenizer):
    """The three adapters saved by PEFT, and PEFT's greedy tokens and scores for the first
    three prompts under each."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    requests, reference = {}, {}
    generator = torch.Generator().manual_seed(0)
    for i, (name, kwargs) in enumerate(ADAPTERS.items(), start=1):
        model = get_peft_model(copy.deepcopy(hf_default_model), LoraConfig(**kwargs))
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.data = torch.randn(param.shape, generator=generator) * B_STD
        model.save_pretrained(str(root / name))
        requests[name] = LoRARequest(name, i, str(root / name))
        reference[name] = [hf_greedy(model, default_tokenizer.encode(p), NUM_TOKENS) for p in PROMPTS[:3]]
    return requests, reference


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_lora=True, max_loras=4, max_lora_rank=16, kv_cache_memory_bytes=256 << 20)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def solo(llm, adapters):
    """Each (prompt, adapter or None) generated alone."""
    requests, _ = adapters
    return {
        (prompt, name): llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=requests.get(name))[0]
        for prompt in PROMPTS
        for name in (None, *ADAPTERS)
    }


def test_greedy_tokens_equal_peft(adapters, solo):
    _, reference = adapters
    for name in ADAPTERS:
        for prompt, (ref, scores) in zip(PROMPTS, reference[name]):
            out = solo[(prompt, name)].outputs[0]
            assert_greedy_close(out.token_ids, out.logprobs, ref, scores)
            assert out.token_ids == ref, (name, prompt)
    for name in ADAPTERS:
        differ = [solo[(p, name)].outputs[0].token_ids != solo[(p, None)].outputs[0].token_ids for p in PROMPTS]
        assert sum(differ) >= len(PROMPTS) // 2, (name, differ)


def _interleaved(adapters):
    requests, _ = adapters
    names = [None, *ADAPTERS]
    pairs = [(PROMPTS[i % len(PROMPTS)], names[(i + i // len(PROMPTS)) % 4]) for i in range(32)]
    assert len(set(pairs)) == 32
    return pairs, [requests.get(name) for _, name in pairs]


def test_mixed_batch_gives_each_request_its_solo_tokens(llm, adapters, solo):
    pairs, loras = _interleaved(adapters)
    outputs = llm.generate([p for p, _ in pairs], GREEDY, use_tqdm=False, lora_request=loras)
    assert tokens(outputs) == tokens(solo[pair] for pair in pairs)


def test_fewer_slots_than_adapters_chunked_prefill_and_preemption(adapters, solo):
    """max_loras=2 with four adapters' worth of requests (the third adapter waits), a small
    token budget (prompts are chunked) and a KV cache of 12 blocks of 8 tokens, which the
    requests outgrow (they are preempted)."""
    pairs, loras = _interleaved(adapters)
    llm = LLM(
        enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
        block_size=8, num_kv_blocks=12, max_num_batched_tokens=40, max_model_len=96,
    )
    engine = llm.llm_engine
    for i, ((prompt, _), lora) in enumerate(zip(pairs, loras)):
        engine.add_request(str(i), prompt, GREEDY, lora_request=lora)
    finished = {}
    max_running = 0
    saw_waiting = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        stats = engine.get_stats()
        max_running = max(max_running, stats["num_running_loras"])
        saw_waiting |= stats["num_waiting_loras"] > 0 and stats["num_running_loras"] == 2
    assert max_running == 2 and saw_waiting
    assert engine.get_stats()["num_preemptions"] > 0
    assert [finished[str(i)] for i in range(32)] == tokens(solo[pair] for pair in pairs)


def test_prefix_cache_hits_within_an_adapter_not_across(llm, adapters):
    requests, _ = adapters
    prompt = "A long shared prefix that fills more than two blocks of sixteen tokens: " * 2
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits(lora):
        before = llm.get_stats()["prefix_cache_hit_tokens"]
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return llm.get_stats()["prefix_cache_hit_tokens"] - before

    assert hits(requests["attn"]) == 0
    assert hits(requests["attn"]) > 0
    assert hits(requests["mlp"]) == 0
    assert hits(None) == 0
    assert hits(None) > 0


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llm, adapters, solo, tmp_path):
    requests, _ = adapters
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_dora": true}')
    with pytest.raises(ValueError, match="LoRA adapter 'dora': use_dora=true"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'attn'"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, requests["mlp"].lora_path))
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=requests["attn"])
    assert tokens(out) == tokens([solo[(PROMPTS[0], "attn")]])
    base_only = copy.copy(llm.llm_engine.input_processor)
    base_only.config = copy.copy(base_only.config)
    base_only.config.enable_lora = False
    with pytest.raises(ValueError, match="LoRA adapter 'attn' requested but the engine runs with enable_lora=False"):
        base_only.process("x", PROMPTS[0], GREEDY, lora_request=requests["attn"])


def test_engine_process_carries_the_adapter(adapters, solo):
    requests, _ = adapters

    async def run():
        engine = AsyncLLM.from_engine_args(enable_lora=True, max_lora_rank=16, num_kv_blocks=64, max_model_len=256)
        try:
            results = []
            for name in ("all", None):
                async for out in engine.generate(
                    PROMPTS[1], GREEDY, output_kind=RequestOutputKind.FINAL_ONLY, lora_request=requests.get(name)
                ):
                    results.append(out.outputs[0].token_ids)
            return results
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == [solo[(PROMPTS[1], "all")].outputs[0].token_ids, solo[(PROMPTS[1], None)].outputs[0].token_ids]


def test_ngram_speculative_decoding_keeps_the_adapter_tokens(adapters, solo):
    requests, _ = adapters
    llm = LLM(
        enable_lora=True, max_lora_rank=16, num_kv_blocks=64, max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    names = ["mlp", None, "mlp", None]
    outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False, lora_request=[requests.get(n) for n in names])
    assert tokens(outputs) == tokens(solo[(p, n)] for p, n in zip(PROMPTS[:4], names))
