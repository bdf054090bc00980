"""The ``offload`` connector on a tiny random model with a small device cache: a shared prefix
evicted by other prompts comes back from the host tier, or from the disk tier, also after a
restart (a new engine on the same directory); a corrupt disk file is a miss with a warning;
outputs always equal those of an engine without the connector."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import assert_same_completions, make_tiny_checkpoint
from tokenmill import LLM, RequestOutput, SamplingParams
from tokenmill.core.kv_cache_utils import sha256_block_hash

BLOCK = 16
NUM_BLOCKS = 14
SHARED = [(i * 13) % 250 + 3 for i in range(96)]
"""A six-block prefix two conversations share."""
TURNS = [{"prompt_token_ids": SHARED + [200 + i, 7]} for i in range(2)]
FILLERS = [{"prompt_token_ids": [(7 * p + j) % 250 + 3 for j in range(150)]} for p in range(3)]
"""Prompts that, one by one, evict the shared prefix from a 14-block device cache."""
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _workload(llm: LLM) -> list[RequestOutput]:
    """The turns, each filler on its own (so the prefix is evicted), the turns again."""
    out = []
    for batch in (TURNS, *[[f] for f in FILLERS], TURNS):
        out += llm.generate(batch, PARAMS, use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def baseline(tiny) -> list[RequestOutput]:
    return _workload(LLM(tiny, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK))


def _offload(tiny: str, **extra) -> LLM:
    config = {"kv_connector": "offload", "kv_connector_extra_config": extra}
    return LLM(tiny, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=config)


def test_evicted_prefix_comes_back_from_the_host_tier(tiny, baseline):
    llm = _offload(tiny, host_gib=0.01)
    assert_same_completions(_workload(llm), baseline)
    stats = llm.get_stats()
    assert stats["external_prefix_cache_hit_tokens"] == len(SHARED)


def test_disk_tier_survives_a_restart(tiny, baseline, tmp_path):
    first = _offload(tiny, host_gib=0, disk_gib=0.01, disk_path=str(tmp_path))
    assert_same_completions(_workload(first), baseline)
    assert first.get_stats()["external_prefix_cache_hit_tokens"] == len(SHARED)
    del first
    restarted = _offload(tiny, host_gib=0, disk_gib=0.01, disk_path=str(tmp_path))
    assert_same_completions(restarted.generate(TURNS, PARAMS, use_tqdm=False), baseline[-2:])
    stats = restarted.get_stats()
    assert stats["external_prefix_cache_hit_tokens"] == len(SHARED)
    assert stats["prefix_cache_hit_tokens"] == len(SHARED)


def test_host_tier_spills_to_a_bounded_disk_tier(tiny, baseline, tmp_path):
    llm = _offload(tiny, host_gib=0.00004, disk_gib=0.00008, disk_path=str(tmp_path))
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    assert connector.block_bytes == 8192
    assert (connector.host_capacity, connector.disk_capacity) == (5, 10)
    assert_same_completions(_workload(llm), baseline)
    assert len(list(Path(tmp_path).rglob("*.kvblock"))) == len(connector.disk) == 10


def _block_file(root: Path, index: int) -> Path:
    """The disk tier's file of block ``index`` of ``SHARED``."""
    block_hash = None
    for i in range(index + 1):
        block_hash = sha256_block_hash(block_hash, SHARED[i * BLOCK : (i + 1) * BLOCK])
    [path] = root.rglob(block_hash.hex() + ".kvblock")
    return path


def test_corrupt_disk_file_is_a_miss(tiny, baseline, tmp_path, caplog):
    first = _offload(tiny, host_gib=0, disk_gib=0.01, disk_path=str(tmp_path))
    first.generate(TURNS[:1], PARAMS, use_tqdm=False)
    del first
    path = _block_file(tmp_path, 2)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        restarted = _offload(tiny, host_gib=0, disk_gib=0.01, disk_path=str(tmp_path))
        assert_same_completions(restarted.generate(TURNS[1:], PARAMS, use_tqdm=False), baseline[-1:])
    assert any("header digest mismatch" in r.getMessage() for r in caplog.records)
    assert restarted.get_stats()["external_prefix_cache_hit_tokens"] == 2 * BLOCK
