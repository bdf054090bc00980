"""The weight-quantization methods on the default model against float32: teacher-forced top-1
agreement on float32's greedy continuations, perplexity on a fixed English text, and the
weight memory of the loaded linear layers."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import LinearBase

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The best way to learn a new language is",
    "Water boils at a temperature of",
    "My favorite book is about",
    "To make a cup of tea, first",
    "The sun rises in the east and",
    "In computer science, a linked list is",
    "The three primary colors are",
    "Yesterday I went to the market and bought",
    "A healthy breakfast usually includes",
    "The history of the Roman Empire",
    "Photosynthesis is the process by which",
    "Dear friend, I am writing to tell you",
    "The most important rule of driving is",
    "Mountains are formed when",
]
CONTINUATION = 32
TEXT = (Path(__file__).parents[1] / "support" / "quant_text.txt").read_text()

METHODS = {
    # method: (top-1 agreement at least, perplexity within this fraction of float32's,
    #          weight bytes of the quantized linears / their float32 bytes at most)
    "int8": (0.95, 0.02, 0.26),
    "w8a8": (0.90, 0.05, 0.26),
    "fp8": (0.90, 0.02, 0.26),
    "int4": (0.70, 0.10, 0.19),
}


def _llm(**kwargs) -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=160, **kwargs)


def _teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[list[dict]]:
    """Each sequence's prompt logprobs (its own token and the top-1 at every position) from one
    prefill."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def _perplexity(logprobs: list[dict], ids: list[int]) -> float:
    return math.exp(-sum(logprobs[p][ids[p]].logprob for p in range(1, len(ids))) / (len(ids) - 1))


@pytest.fixture(scope="module")
def reference():
    """float32's prompts + greedy continuations, and its perplexity on the text."""
    llm = _llm()
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    text_ids = tokenizer.encode(TEXT)
    ppl = _perplexity(_teacher_forced(llm, [text_ids])[0], text_ids)
    del llm
    gc.collect()
    return sequences, text_ids, ppl


def _linear_bytes(llm: LLM) -> tuple[int, int]:
    """Bytes of the linear layers' weights (not biases) as loaded, and as float32."""
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    held = full = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            held += sum(
                p.numel() * p.element_size() for n, p in module.named_parameters(recurse=False) if n != "bias"
            )
            full += module.input_size * module.output_size * 4
    return held, full


@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_default_model_tracks_float32(reference, method):
    min_agreement, ppl_slack, max_bytes = METHODS[method]
    sequences, text_ids, ref_ppl = reference
    llm = _llm(quantization=method)
    held, full = _linear_bytes(llm)
    assert held / full <= max_bytes, f"{method}: linear weights take {held / full:.3f} of float32"
    logprobs = _teacher_forced(llm, [p + c for p, c in sequences] + [text_ids])
    agree = total = 0
    for (prompt, cont), lp in zip(sequences, logprobs):
        for i, token in enumerate(cont):
            top1 = next(t for t, v in lp[len(prompt) + i].items() if v.rank == 1)
            agree += top1 == token
            total += 1
    ppl = _perplexity(logprobs[-1], text_ids)
    print(f"{method}: top-1 agreement {agree / total:.3f}, perplexity {ppl:.3f} vs {ref_ppl:.3f}, "
          f"weights {held / full:.3f} of float32")
    assert agree / total >= min_agreement, f"{method}: top-1 agreement {agree}/{total}"
    assert abs(ppl / ref_ppl - 1) <= ppl_slack, f"{method}: perplexity {ppl:.3f}, float32 {ref_ppl:.3f}"
    del llm
    gc.collect()
