"""Contract points of a KV connector, on a random paged cache of two layers (no model): the
blocks a producer saved load back into other blocks bit for bit; asking for matched tokens
changes nothing; a finished request's blocks are released (at once, or once the worker reports
them sent).

The connector is built from ``pytest_tokenmill_kv_transfer_config(name, path)`` (default:
``{"kv_connector": name}``); its scheduler side and one worker side play an engine's steps
through the interface only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_utils import sha256_block_hash
from tokenmill.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.interfaces.kv_cache_spec import FullAttentionSpec
from tokenmill.interfaces.kv_connector import KVConnectorBase, KVConnectorRole
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, HEADS, HEAD_SIZE = 4, 16, 2, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PROMPT_BLOCKS = 3
"""Full blocks of the prompt (it has one token more, left to compute)."""
MAX_STEPS = 50
"""Steps an asynchronous load or send may take to be reported."""


@dataclass
class KitRequest:
    """A request as the scheduler side sees it."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = []
        for i in range(len(self.all_token_ids) // BLOCK_SIZE):
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            self.block_hashes.append(sha256_block_hash(parent, tokens))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Engine:
    """A connector's two sides over one random paged cache, stepped like the engine does."""

    def __init__(self, name: str, transfer: dict[str, Any]) -> None:
        config = EngineConfig.from_kwargs(block_size=BLOCK_SIZE, kv_transfer_config=transfer)
        specs = {n: FullAttentionSpec(BLOCK_SIZE, torch.float32, HEADS, HEAD_SIZE) for n in LAYERS}
        cls = plugins.get_registry("kv_connectors").load(name)
        self.scheduler_side: KVConnectorBase = cls(config, KVConnectorRole.SCHEDULER, 0, specs)
        self.worker: KVConnectorBase = cls(config, KVConnectorRole.WORKER, 0, specs)
        gen = torch.Generator().manual_seed(0)
        self.caches = {
            n: torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=gen) for n in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        self.sent: set[str] = set()
        self.received: set[str] = set()

    def step(self, scheduled: dict[str, tuple[KitRequest, list[int], int]], finished: set[str] = frozenset()) -> None:
        """One step: ``scheduled`` maps request id -> (request, its blocks, tokens run now)."""
        new = []
        for req, block_ids, n in scheduled.values():
            new.append(
                NewRequestData(req.request_id, req.prompt_token_ids, SamplingParams(), block_ids, req.num_computed_tokens, None)
            )
            req.num_computed_tokens += n
        out = SchedulerOutput(
            new,
            CachedRequestData(),
            {r: n for r, (_, _, n) in scheduled.items()},
            sum(n for _, _, n in scheduled.values()),
            finished_req_ids=set(finished),
        )
        meta = self.scheduler_side.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        for name in LAYERS:
            self.worker.wait_for_layer_load(name)
        if out.total_num_scheduled_tokens:
            for name in LAYERS:
                self.worker.save_kv_layer(name, self.caches[name], None)
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        self.worker.clear_connector_metadata()
        self.sent |= sending or set()
        self.received |= recving or set()

    def produce(self, req: KitRequest, block_ids: list[int]) -> None:
        """Compute ``req``'s prompt (as a producer) and finish it."""
        self.scheduler_side.update_state_after_alloc(req, block_ids, 0)
        self.step({req.request_id: (req, block_ids, req.num_tokens)})
        self.finish(req, block_ids)

    def finish(self, req: KitRequest, block_ids: list[int]) -> None:
        """Finish ``req``; when the connector delays the free, step until it reports the send."""
        delay_free, _ = self.scheduler_side.request_finished(req, block_ids)
        finished = {req.request_id}
        for _ in range(MAX_STEPS if delay_free else 0):
            if req.request_id in self.sent:
                return
            self.step({}, finished)
            finished = set()
        assert not delay_free or req.request_id in self.sent, (
            f"request_finished delayed freeing {req.request_id}'s blocks, and no worker reported "
            f"it sent within {MAX_STEPS} steps"
        )


@pytest.fixture
def engine(tokenmill_kv_connector: str, request, tmp_path) -> Engine:
    transfer = request.config.hook.pytest_tokenmill_kv_transfer_config(
        name=tokenmill_kv_connector, path=tmp_path
    ) or {"kv_connector": tokenmill_kv_connector}
    return Engine(tokenmill_kv_connector, transfer)


def _prompt(seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 1)]


def test_save_then_load_round_trips(engine):
    """blocks a request saved load into another request's blocks exactly, every layer"""
    producer_blocks = list(range(PROMPT_BLOCKS + 1))
    engine.produce(KitRequest("producer", _prompt(1)), producer_blocks)
    consumer = KitRequest("consumer", _prompt(1))
    num_tokens, load_async = engine.scheduler_side.get_num_new_matched_tokens(consumer, 0)
    assert num_tokens == PROMPT_BLOCKS * BLOCK_SIZE, (
        f"offered {num_tokens} tokens of a prompt whose {PROMPT_BLOCKS} full blocks were saved"
    )
    consumer_blocks = list(range(8, 8 + PROMPT_BLOCKS + 1))
    for name in LAYERS:
        engine.caches[name][consumer_blocks].zero_()
    engine.scheduler_side.update_state_after_alloc(consumer, consumer_blocks, num_tokens)
    consumer.num_computed_tokens = num_tokens
    if load_async:
        engine.step({})
        for _ in range(MAX_STEPS):
            if "consumer" in engine.received:
                break
            engine.step({})
        assert "consumer" in engine.received, f"the asynchronous load was not reported in {MAX_STEPS} steps"
    else:
        engine.step({"consumer": (consumer, consumer_blocks, 1)})
    for name in LAYERS:
        for src, dst in zip(producer_blocks[:PROMPT_BLOCKS], consumer_blocks):
            assert torch.equal(engine.caches[name][dst], engine.caches[name][src]), (
                f"{name}: block {dst} differs from the saved block {src}"
            )


def test_matching_has_no_side_effects(engine):
    """get_num_new_matched_tokens answers the same when asked again and loads nothing itself"""
    engine.produce(KitRequest("producer", _prompt(2)), list(range(PROMPT_BLOCKS + 1)))
    before = {n: c.clone() for n, c in engine.caches.items()}
    consumer = KitRequest("consumer", _prompt(2))
    answers = [engine.scheduler_side.get_num_new_matched_tokens(consumer, 0) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2], f"answers changed between calls: {answers}"
    assert answers[0][0] > 0, "the saved prompt was not matched"
    other = KitRequest("other", _prompt(3))
    assert engine.scheduler_side.get_num_new_matched_tokens(other, 0)[0] == 0, "an unseen prompt matched"
    engine.step({})
    for name in LAYERS:
        assert torch.equal(engine.caches[name], before[name]), (
            f"{name}: the cache changed in a step after matching alone"
        )


def test_blocks_released_after_request_finished(engine):
    """a finished request's blocks are released: at once, or once a worker reports them sent"""
    req = KitRequest("finishing", _prompt(4))
    engine.produce(req, list(range(PROMPT_BLOCKS + 1)))
    aborted = KitRequest("aborted", _prompt(5))
    engine.scheduler_side.update_state_after_alloc(aborted, [12, 13, 14, 15], 0)
    engine.finish(aborted, [12, 13, 14, 15])
