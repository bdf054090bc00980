"""The one input processor: a prompt is validated and tokenized once, into engine-core
requests that carry everything the core needs; nothing outside the core reaches into the
scheduler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint, save_byte_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.engine.input_processor import InputProcessor

FRAMEWORK = Path(__file__).resolve().parents[2] / "framework"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), eos_token_id=2)
    save_byte_tokenizer(path)
    Path(path, "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    return path


def test_process_prepares_child_requests(tiny_dir):
    config = resolve_config(EngineConfig.from_kwargs(model=tiny_dir))
    processor = InputProcessor(config, None, max_model_len=100, max_prompt_tokens=99)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=None, stop_token_ids=[4])
    request = processor.process(
        "r", {"prompt_token_ids": [1, 2, 3], "cache_salt": "t"}, params, priority=3
    )
    assert [c.request_id for c in request.core_requests] == ["0_r", "1_r"]
    assert [c.sampling_params.seed for c in request.core_requests] == [5, 6]
    for child in request.core_requests:
        assert child.sampling_params.n == 1
        assert child.sampling_params.stop_token_ids == [4, 7, 9]
        assert child.max_tokens == 97
        assert (child.priority, child.cache_salt, child.eos_token_id) == (3, "t", 2)
        assert child.prompt_token_ids == [1, 2, 3]
    assert params.stop_token_ids == [4], "the caller's params are not modified"
    with pytest.raises(ValueError, match="at most 99"):
        processor.process("long", {"prompt_token_ids": [1] * 100})


def test_generate_validates_each_prompt_once(tiny_dir, monkeypatch):
    llm = LLM(model=tiny_dir, num_kv_blocks=32, block_size=8, max_model_len=128)
    processor = llm.llm_engine.input_processor
    calls = []
    real = processor.validate_prompt_ids
    monkeypatch.setattr(processor, "validate_prompt_ids", lambda ids: calls.append(ids) or real(ids))
    outs = llm.generate(["ab", {"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(calls) == 2 and calls[1] == [5, 6]
    assert all(o.finished for o in outs)


def test_nothing_outside_the_core_reaches_into_the_scheduler():
    offenders = [
        f"{path.relative_to(FRAMEWORK)}:{n}"
        for path in FRAMEWORK.rglob("*.py")
        if path.parent.name != "core" and path.name != "engine_core.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.scheduler\.", line)
    ]
    assert not offenders
