"""KV connectors that load and send asynchronously, through the engine: a request whose KV is
loading waits (WAITING_FOR_REMOTE_KVS) without holding up the others and runs once a worker
reports the load; a finished request's blocks stay held until a worker reports them sent; a
request aborted while loading keeps its blocks until the load is reported; outputs equal those
without a connector. The connector is the storage connector reporting its loads and sends two
steps late, registered at run time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams, plugins
from tokenmill.kv_connectors.storage import StorageConnector, StorageMetadata

BLOCK = 16
LATE_STEPS = 2
STORED = [[(p * 37 + i * 11) % 250 + 3 for i in range(70)] for p in range(2)]
FRESH = [(i * 5) % 250 + 3 for i in range(40)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0)


@dataclass
class LateMetadata(StorageMetadata):
    recving: list[str] = field(default_factory=list)
    sending: list[str] = field(default_factory=list)


class LateConnector(StorageConnector):
    """Storage, but loads are asynchronous and freeing waits for a send: both reported by the
    worker ``LATE_STEPS`` steps after the metadata named them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loading: list[str] = []
        self.finished: list[str] = []
        self.countdown: dict[tuple[str, str], int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        num_tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return num_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            self.loading.append(request.request_id)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        late = LateMetadata(meta.loads, meta.saves, self.loading, self.finished)
        self.loading, self.finished = [], []
        return late

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.finished.append(request.request_id)
        return True, {"remote_block_ids": list(block_ids)}

    def start_load_kv(self) -> None:
        super().start_load_kv()
        meta = self._get_connector_metadata()
        for kind, ids in (("recv", meta.recving), ("send", meta.sending)):
            for req_id in ids:
                self.countdown[(kind, req_id)] = LATE_STEPS

    def get_finished(self, finished_req_ids):
        done: dict[str, set[str]] = {"send": set(), "recv": set()}
        for key in list(self.countdown):
            self.countdown[key] -= 1
            if self.countdown[key] <= 0:
                del self.countdown[key]
                done[key[0]].add(key[1])
        return done["send"], done["recv"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def late(monkeypatch) -> str:
    monkeypatch.setattr(plugins, "_runtime", [])
    plugins.register_kv_connector("late", "test_async_connector:LateConnector")
    yield "late"
    monkeypatch.undo()
    plugins.reload_plugins()


def _llm(tiny: str, connector: str, path) -> LLM:
    config = {"kv_connector": connector, "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    return LLM(tiny, num_kv_blocks=64, block_size=BLOCK, kv_transfer_config=config)


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in (*STORED, FRESH)]


def test_async_loads_and_delayed_frees(tiny, late, tmp_path):
    baseline = LLM(tiny, num_kv_blocks=64, block_size=BLOCK).generate(_prompts(), PARAMS, use_tqdm=False)
    _llm(tiny, "storage", tmp_path).generate(_prompts()[:2], PARAMS, use_tqdm=False)
    llm = _llm(tiny, late, tmp_path)
    core = llm.llm_engine.engine_core.engine_core
    steps: list[tuple[set[str], set[str]]] = []
    params: dict[str, Any] = {}
    schedule, update = core.scheduler.schedule, core.scheduler.update_from_output

    def spy_schedule():
        out = schedule()
        steps.append((set(out.num_scheduled_tokens), set(core.scheduler.loading)))
        return out

    def spy_update(*args, **kwargs):
        outputs = update(*args, **kwargs)
        params.update({o.req_id: o.kv_transfer_params for o in outputs if o.finish_reason})
        return outputs

    core.scheduler.schedule, core.scheduler.update_from_output = spy_schedule, spy_update
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    scheduled, loading = steps[0]
    assert len(loading) == 2 and len(scheduled) == 1, steps[:3]
    assert all(not (ran & waiting) for ran, waiting in steps), "a loading request was scheduled"
    assert core.get_stats()["external_prefix_cache_hit_tokens"] == 2 * 64
    assert all(p is not None and "remote_block_ids" in p for p in params.values()) and len(params) == 3
    assert core.get_stats()["kv_blocks_held_for_transfer"] > 0
    while core.has_unfinished_requests():
        core.step()
    stats = core.get_stats()
    assert stats["kv_blocks_held_for_transfer"] == 0 and stats["kv_blocks_free"] == 64


def test_abort_while_loading_holds_blocks_until_loaded(tiny, late, tmp_path):
    _llm(tiny, "storage", tmp_path).generate(_prompts()[:1], PARAMS, use_tqdm=False)
    llm = _llm(tiny, late, tmp_path)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    engine.add_request("r", _prompts()[0], PARAMS)
    core.step()
    assert len(core.scheduler.loading) == 1 and core.get_stats()["kv_blocks_free"] < 64
    engine.abort_request("r")
    assert core.get_stats()["kv_blocks_held_for_transfer"] == 4
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    assert steps >= LATE_STEPS - 1
    assert core.get_stats()["kv_blocks_free"] == 64 and not core.scheduler.held


class FailingLoads(StorageConnector):
    """Storage whose loads fail on the worker."""

    def start_load_kv(self) -> None:
        if self._get_connector_metadata().loads:
            raise RuntimeError("the KV store went away")


def test_failed_load_leaves_nothing_in_the_prefix_cache(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(plugins, "_runtime", [])
    plugins.register_kv_connector("failing", "test_async_connector:FailingLoads")
    try:
        _llm(tiny, "storage", tmp_path).generate(_prompts()[:1], PARAMS, use_tqdm=False)
        llm = _llm(tiny, "failing", tmp_path)
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        engine.add_request("r", _prompts()[0], PARAMS)
        with pytest.raises(RuntimeError, match="the KV store went away"):
            core.step()
        assert core.failed_req_ids and not core.kv_cache_manager.pool.cached
        assert core.get_stats()["kv_blocks_free"] == 64
    finally:
        monkeypatch.undo()
        plugins.reload_plugins()
