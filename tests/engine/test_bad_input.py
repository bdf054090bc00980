"""Invalid input raises a clear error and leaves the engine serving."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=tiny_dir, num_kv_blocks=64, block_size=8, max_model_len=128)


GOOD = {"prompt_token_ids": [1, 2, 3]}


def _still_serving(llm):
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path))


def test_unknown_architecture(tmp_path, tiny_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM"):
        LLM(model=str(bad))


def test_unknown_backend_and_platform(tiny_dir):
    with pytest.raises(ValueError, match="no-such-backend"):
        LLM(model=tiny_dir, attention_backend="no-such-backend", num_kv_blocks=8)
    with pytest.raises(ValueError, match="no-such-platform"):
        LLM(model=tiny_dir, platform="no-such-platform", num_kv_blocks=8)


def test_unknown_engine_argument(tiny_dir):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(model=tiny_dir, max_num_sequences=4)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -2}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 256, 2]}, "256"),
        ({"prompt_token_ids": [-1]}, "-1"),
        ({"prompt_token_ids": list(range(1, 200))}, "199 tokens"),
        ({"prompt_token_ids": "abc"}, "list of integers"),
        ({"text": "x"}, "prompt"),
        (42, "str or a dict"),
    ],
)
def test_invalid_prompts_leave_engine_serving(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    _still_serving(llm)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", use_tqdm=False)
    _still_serving(llm)


def test_stop_strings_without_tokenizer_are_refused(llm):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(stop=["x"]), use_tqdm=False)
    _still_serving(llm)


def test_mismatched_sampling_params_count(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([GOOD], [SamplingParams(), SamplingParams()], use_tqdm=False)
    _still_serving(llm)


@pytest.mark.parametrize(
    "params, got",
    [
        ({"temperature": 0, "max_tokens": 2}, "got dict"),
        ([{"max_tokens": 2}], "got a list holding a dict"),
        ("greedy", "got str"),
    ],
)
def test_sampling_params_of_the_wrong_type(llm, params, got):
    with pytest.raises(
        TypeError, match=f"^sampling_params must be a SamplingParams or a list of them, {got}$"
    ):
        llm.generate(GOOD, params, use_tqdm=False)
    _still_serving(llm)


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request("dup", GOOD, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", GOOD, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    _still_serving(llm)


def test_empty_text_prompt(default_llm):
    llm = default_llm
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    out = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
