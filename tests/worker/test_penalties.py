"""Penalties, logit bias and allowed_token_ids through the engine, against torch on HF logits
(observed through ``logprobs_mode="processed_logprobs"``)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams

PROMPT = [5, 6, 7, 5, 9, 6, 5]
STEPS = 12


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return LLM(
        model=tiny_path,
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        logprobs_mode="processed_logprobs",
    )


@pytest.fixture(scope="module")
def hf(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def reference_logprobs(hf, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """``[len(output), V]`` log-probabilities of each step's adjusted logits, computed directly."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    rows = []
    for step, row in enumerate(logits):
        row = row.clone()
        if params.allowed_token_ids is not None:
            keep = torch.zeros_like(row, dtype=torch.bool)
            keep[params.allowed_token_ids] = True
            row[~keep] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            row[token] += bias
        seen_output = output[:step]
        seen = set(prompt) | set(seen_output)
        for token in seen:
            r = params.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
        for token in set(seen_output):
            count = seen_output.count(token)
            row[token] -= params.frequency_penalty * count + params.presence_penalty
        rows.append(row.log_softmax(-1))
    return torch.stack(rows)


def check_against_reference(llm, hf, params: SamplingParams, others: int = 0) -> list[int]:
    """Run PROMPT (in a batch with ``others`` plain greedy requests) and compare each step's
    returned logprobs with the reference; return the output tokens."""
    plain = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [40 + i, 41, 42]} for i in range(others)]
    prompts.insert(1 if others else 0, {"prompt_token_ids": PROMPT})
    all_params = [plain] * len(prompts)
    all_params[1 if others else 0] = params
    out = llm.generate(prompts, all_params, use_tqdm=False)[1 if others else 0].outputs[0]
    assert len(out.token_ids) == STEPS
    ref = reference_logprobs(hf, PROMPT, out.token_ids, params)
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token == int(ref[step].argmax()), f"step {step}"
        for tok, value in logprobs.items():
            assert value.logprob == pytest.approx(float(ref[step, tok]), abs=1e-4), f"step {step} token {tok}"
    return out.token_ids


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.7},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"presence_penalty": 1.0, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
        {"logit_bias": {3: 5.0, 200: 8.0, 7: -100.0}},
        {"allowed_token_ids": [1, 2, 3, 5, 8, 13, 21]},
    ],
    ids=["repetition", "repetition-below-1", "frequency", "presence", "all-penalties", "logit-bias", "allowed"],
)
def test_adjusted_distribution_matches_torch(tiny, hf, kwargs):
    plain = tiny.generate({"prompt_token_ids": PROMPT}, _params(), use_tqdm=False)[0].outputs[0]
    ours = check_against_reference(tiny, hf, _params(**kwargs))
    assert ours != plain.token_ids
    check_against_reference(tiny, hf, _params(**kwargs), others=3)


def test_penalty_rows_do_not_leak_into_other_rows(tiny):
    plain = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [40 + i, 41, 42]} for i in range(3)]
    alone = [o.outputs[0].token_ids for o in tiny.generate(prompts, plain, use_tqdm=False)]
    penalised = _params(repetition_penalty=2.0, frequency_penalty=2.0, logit_bias={3: 50.0},
                        allowed_token_ids=[3, 4])
    mixed = tiny.generate(prompts[:1] + [{"prompt_token_ids": PROMPT}] + prompts[1:],
                          [plain, penalised, plain, plain], use_tqdm=False)
    assert [o.outputs[0].token_ids for i, o in enumerate(mixed) if i != 1] == alone
    # After the penalised request's row is freed, a plain request reusing it is unaffected.
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, plain, use_tqdm=False)] == alone


def test_penalties_survive_preemption(tiny_path):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.3)
    prompt = {"prompt_token_ids": PROMPT}
    roomy = LLM(model=tiny_path, num_kv_blocks=128, block_size=8, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in roomy.generate([prompt] * 4, params, use_tqdm=False)]
    tight = LLM(model=tiny_path, num_kv_blocks=14, block_size=8, max_model_len=96, watermark=0.0)
    got = [o.outputs[0].token_ids for o in tight.generate([prompt] * 4, params, use_tqdm=False)]
    assert got == expected
    assert tight.get_stats()["num_preemptions"] > 0


def test_token_ids_outside_the_vocab_are_refused(tiny):
    for kwargs, name in (({"logit_bias": {256: 1.0}}, "logit_bias"), ({"allowed_token_ids": [0, 300]}, "allowed_token_ids")):
        with pytest.raises(ValueError, match=name):
            tiny.generate({"prompt_token_ids": PROMPT}, SamplingParams(**kwargs), use_tqdm=False)


def test_greedy_under_repetition_penalty_matches_hf(default_llm, hf_default_model, default_tokenizer):
    llm = default_llm
    prompts = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = default_tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf_default_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
            do_sample=False, repetition_penalty=1.3, pad_token_id=default_tokenizer.eos_token_id,
        )[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_bad_words_are_never_generated(default_llm, default_tokenizer):
    """A one-token bad word is never sampled (the runner-up takes its place); of a two-token
    one, the second token is banned right after the first."""
    llm = default_llm
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    ref = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    first, second = ref.token_ids[:2]
    runner_up = next(t for t, lp in ref.logprobs[0].items() if lp.rank == 2)

    word = default_tokenizer.decode([first])
    assert default_tokenizer.encode(word.lstrip(), add_special_tokens=False) == [first] or \
        default_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False) == [first]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, bad_words=[word]), use_tqdm=False)
    ids = banned[0].outputs[0].token_ids
    assert first not in ids and ids[0] == runner_up

    pair = default_tokenizer.decode([first, second])
    pair_ids = [default_tokenizer.encode(w, add_special_tokens=False) for w in (pair.lstrip(), " " + pair.lstrip())]
    assert [first, second] in pair_ids, "the two tokens re-tokenize as themselves"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, bad_words=[pair]), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert ids[0] == first and ids[1] != second
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_bad_words_hold_for_every_completion_of_n(default_llm, default_tokenizer):
    """Each of the ``n`` completions avoids the bad word exactly as the ``n == 1`` request does
    (``top_k=1`` makes sampling deterministic, so every field must match; logprobs up to the
    rounding of a batch of two rows against one)."""
    llm = default_llm
    prompt = "The capital of France is"
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    word = default_tokenizer.decode(first[0].outputs[0].token_ids)
    kwargs = dict(temperature=0.7, top_k=1, max_tokens=8, logprobs=2, bad_words=[word])
    single = llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)[0].outputs[0]
    assert first[0].outputs[0].token_ids[0] not in single.token_ids
    pair = llm.generate([prompt], SamplingParams(n=2, **kwargs), use_tqdm=False)[0].outputs
    assert [c.index for c in pair] == [0, 1]
    for completion in pair:
        for name in ("text", "token_ids", "finish_reason", "stop_reason"):
            assert getattr(completion, name) == getattr(single, name), name
        assert completion.cumulative_logprob == pytest.approx(single.cumulative_logprob, abs=1e-4)
        for ours, ref in zip(completion.logprobs, single.logprobs, strict=True):
            assert ours.keys() == ref.keys()
            for token, lp in ours.items():
                assert (lp.rank, lp.decoded_token) == (ref[token].rank, ref[token].decoded_token)
                assert lp.logprob == pytest.approx(ref[token].logprob, abs=1e-4)


def test_bad_words_need_a_tokenizer(tiny):
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        tiny.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(bad_words=["x"]), use_tqdm=False)
