"""The default model's own GGUF file (Q4_1 layers, Q8_0 embedding and tied head) loaded by the
gguf method: its logits with float32 activations against HF transformers on the float weights
the same blocks dequantize to, its teacher-forced tokens with int8 activation blocks (the
default) against llama.cpp's on the same file, and the errors for what it cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.default_model import gguf_path
from tokenmill.quant.gguf import GEMV_MAX_ROWS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
LLAMACPP_FIXTURE = Path(__file__).parents[1] / "support" / "gguf_llamacpp_tokens.json"


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Steps of at most GEMV_MAX_ROWS tokens, so every product, prompts' too, is the block
    kernel's (with activations in int8 blocks)."""
    return LLM(
        quantization="gguf",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        max_num_batched_tokens=GEMV_MAX_ROWS,
    )


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model


def test_blocks_are_kept_as_stored(llm):
    model = model_of(llm)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and int(qkv.qweight_type) == 3  # Q4_1: 20 bytes / 32
    assert qkv.qweight.shape == (576 + 2 * 192, 576 // 32 * 20)
    assert int(model.lm_head.qweight_type) == 8 and model.lm_head.qweight.shape == (49152, 576 // 32 * 34)
    linear_bytes = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("qweight") and "layers" in n)
    linear_weights = sum(m.input_size * m.output_size for m in model.modules() if hasattr(m, "qweight") and m is not model.lm_head)
    assert linear_bytes == linear_weights * 4 * 20 // 128  # 5 bits a weight: 5/32 of float32


def test_logits_equal_float_reference(hf_default_model, monkeypatch):
    """With float32 activations (``TOKENMILL_GGUF_FLOAT_ACTIVATIONS=1``; by default they are
    rounded to int8 blocks as llama.cpp does, which the llama.cpp test below covers), every
    sampled position's logits, prefill and decode, against HF on the dequantized weights (the
    default model's float conversion of this file) within 1e-3."""
    monkeypatch.setenv("TOKENMILL_GGUF_FLOAT_ACTIVATIONS", "1")
    llm = LLM(quantization="gguf", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    model = model_of(llm)
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())
        return logits

    model.compute_logits = recording
    for prompt in PROMPTS:
        recorded.clear()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf_default_model(input_ids=torch.tensor([ids])).logits[0].float()
        n = len(out.prompt_token_ids)
        ours = torch.cat(recorded)
        assert ours.shape == (6, 49152)
        torch.testing.assert_close(ours, ref[n - 1 : n + 5], atol=1e-3, rtol=0)


def test_model_file_path_loads_with_gguf(tmp_path):
    config = resolve_config(EngineConfig(model=str(gguf_path())))
    assert config.quantization == "gguf" and config.weights_path == str(gguf_path())
    assert (Path(config.model_path) / "tokenizer.json").is_file()
    assert config.hf_config.tie_word_embeddings and config.hf_config.num_hidden_layers == 30
    with pytest.raises(ValueError, match=r"is a GGUF file, which loads with quantization='gguf', not 'int8'"):
        resolve_config(EngineConfig(model=str(gguf_path()), quantization="int8"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not gguf")
    with pytest.raises(FileNotFoundError, match=r"weights.bin' is not a GGUF file"):
        resolve_config(EngineConfig(model=str(other)))
    with pytest.raises(ValueError, match=r"quantization='gguf' loads GGUF files; .* is a model directory"):
        resolve_config(EngineConfig(model=str(tmp_path), quantization="gguf"))


def test_teacher_forced_tokens_agree_with_llamacpp(llm):
    """At >= 95 % of positions the argmax equals llama.cpp's on the same file and tokens
    (``benchmarks/gguf_llamacpp_tokens.py`` computed llama.cpp's with llama-cpp-python), the
    prompts run through the block kernel as decode steps do."""
    fixture = json.loads(LLAMACPP_FIXTURE.read_text())
    assert fixture["gguf"] == gguf_path().name
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    cases = fixture["cases"]
    outs = llm.generate([{"prompt_token_ids": c["tokens"]} for c in cases], params, use_tqdm=False)
    agree = total = 0
    for case, out in zip(cases, outs):
        forced = case["argmax"]
        # prompt_logprobs[j] scores token j; its rank-1 entry is the argmax given tokens < j.
        ours = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in out.prompt_logprobs[-len(forced) :]]
        agree += sum(a == b for a, b in zip(ours, forced))
        total += len(forced)
    assert total == fixture["num_positions"]
    assert agree / total >= 0.95, f"{agree}/{total} positions agree with llama.cpp"


def test_decode_graphs_give_the_eager_tokens(llm):
    """The CPU decode graphs (``platforms/cpu_graph.py``) capture the block kernels' decode steps,
    and their tokens are the eager engine's."""
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == list(range(1, GEMV_MAX_ROWS + 1))
    eager = LLM(
        quantization="gguf",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        max_num_batched_tokens=GEMV_MAX_ROWS,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompts in (PROMPTS[:1], PROMPTS):
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
