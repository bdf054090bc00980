"""The ``storage`` connector on a tiny random model: outputs equal those without it; a second
engine with the same directory loads the prefix instead of computing it; tenants (cache_salt)
stay apart; a corrupt or truncated block file is a miss with a warning, never wrong tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import assert_same_completions, make_tiny_checkpoint
from tokenmill import LLM, RequestOutput, SamplingParams

BLOCK = 16
PROMPTS = [[(p * 37 + i * 11) % 250 + 3 for i in range(n)] for p, n in enumerate((40, 70, 101))]
"""Three prompts with different first blocks (no local prefix sharing between them)."""
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
EXTERNAL = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
"""Tokens a second engine loads: every full block but the one holding the last token."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _run(llm: LLM, salt: str | None = None) -> list[RequestOutput]:
    prompts = [{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})} for p in PROMPTS]
    return llm.generate(prompts, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def baseline(tiny) -> list[RequestOutput]:
    return _run(LLM(tiny, num_kv_blocks=64, block_size=BLOCK))


def _storage(tiny: str, path: Path) -> LLM:
    config = {"kv_connector": "storage", "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    return LLM(tiny, num_kv_blocks=64, block_size=BLOCK, kv_transfer_config=config)


def _files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvblock"))


def test_second_engine_loads_what_the_first_saved(tiny, baseline, tmp_path):
    first = _storage(tiny, tmp_path)
    assert_same_completions(_run(first), baseline)
    assert first.get_stats()["external_prefix_cache_hit_tokens"] == 0
    assert len(_files(tmp_path)) == sum(len(p) // BLOCK for p in PROMPTS)
    second = _storage(tiny, tmp_path)
    assert_same_completions(_run(second), baseline)
    stats = second.get_stats()
    assert stats["external_prefix_cache_hit_tokens"] == EXTERNAL
    assert stats["prefix_cache_hit_tokens"] == 0
    other_tenant = _storage(tiny, tmp_path)
    assert_same_completions(_run(other_tenant, salt="tenant-b"), baseline)
    assert other_tenant.get_stats()["external_prefix_cache_hit_tokens"] == 0


def test_corrupt_and_truncated_files_are_misses(tiny, baseline, tmp_path, caplog):
    _run(_storage(tiny, tmp_path))
    files = _files(tmp_path)
    flipped, truncated = files[0], files[-1]
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        llm = _storage(tiny, tmp_path)
        assert_same_completions(_run(llm), baseline)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "payload digest mismatch" in warned and "truncated" in warned
    assert llm.get_stats()["external_prefix_cache_hit_tokens"] < EXTERNAL
