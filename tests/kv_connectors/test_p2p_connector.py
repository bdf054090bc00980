"""The ``p2p`` KV connector's two sides, in process over real ZMQ sockets: a producer holds a
finished request's blocks until a consumer pulls them (or a timeout), a consumer pulls only
blocks whose hashes match its own prompt's, and a failed pull is a local recompute (counted)
or, with ``on_load_failure="fail"``, a ``KVLoadError``."""

from __future__ import annotations

import socket

import pytest
import torch

from conftest import assert_same_completions

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request
from tokenmill.interfaces import KVConnectorRole, KVLoadError
from tokenmill.kv_connectors.p2p import P2pConnector, P2pMetadata
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
LAYERS = ("layers.0.attn", "layers.1.attn")
NUM_BLOCKS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector(role: KVConnectorRole, kv_role: str, **extra) -> P2pConnector:
    config = EngineConfig.from_kwargs(
        block_size=BLOCK,
        kv_transfer_config={
            "kv_connector": "p2p",
            "kv_role": kv_role,
            "kv_connector_extra_config": extra,
        },
    )
    return P2pConnector(config, role)


def caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 4, generator=gen) for name in LAYERS}


def request(req_id: str, tokens: list[int], params: dict | None = None, salt: str | None = None):
    extra = {"kv_transfer_params": params} if params else None
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=4, extra_args=extra),
        eos_token_id=None,
        max_tokens=4,
        cache_salt=salt,
        block_hasher=make_block_hasher(BLOCK),
        kv_transfer_params=params,
    )


class Producer:
    def __init__(self, **extra) -> None:
        self.port = free_port()
        self.scheduler = connector(
            KVConnectorRole.SCHEDULER, "kv_producer", port=self.port, **extra
        )
        self.worker = connector(KVConnectorRole.WORKER, "kv_producer", port=self.port, **extra)
        self.worker.register_kv_caches(caches(0))

    def finish(self, req: Request, block_ids: list[int]) -> dict:
        req.num_computed_tokens = req.num_tokens
        delay_free, params = self.scheduler.request_finished(req, block_ids)
        assert delay_free and params is not None
        self.step()
        return params

    def step(self) -> tuple[set[str] | None, set[str] | None]:
        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(None))
        self.worker.start_load_kv()
        finished = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        return finished


class Consumer:
    def __init__(self, **extra) -> None:
        self.scheduler = connector(KVConnectorRole.SCHEDULER, "kv_consumer", **extra)
        self.worker = connector(KVConnectorRole.WORKER, "kv_consumer", **extra)
        self.worker.register_kv_caches(caches(1))

    def load(self, req: Request, block_ids: list[int]) -> int:
        tokens, load_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert not load_async
        again, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert again == tokens
        self.scheduler.update_state_after_alloc(req, block_ids, tokens)
        meta = self.scheduler.build_connector_meta(None)
        assert isinstance(meta, P2pMetadata)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        self.worker.clear_connector_metadata()
        return tokens


PROMPT = list(range(100, 100 + 3 * BLOCK + 5))
ALL_BUT_LAST = len(PROMPT) - 1
"""The tokens a consumer pulls: three full blocks and four tokens of the partial fourth."""


def test_consumer_pulls_all_but_the_last_prompt_token_and_the_producer_frees_them():
    producer, consumer = Producer(), Consumer()
    sent = request("a", PROMPT, {"do_remote_decode": True})
    params = producer.finish(sent, [7, 2, 9, 4])
    assert params["remote_request_id"] == "a" and params["remote_block_ids"] == [7, 2, 9, 4]
    assert params["block_hashes"] == [h.hex() for h in sent.block_hashes[:3]]
    got = request("b", PROMPT, params)
    assert consumer.load(got, [1, 5, 3, 0]) == ALL_BUT_LAST
    for name in LAYERS:
        assert torch.equal(
            consumer.worker.kv_caches[name][[1, 5, 3, 0]],
            producer.worker.kv_caches[name][[7, 2, 9, 4]],
        )
    assert producer.step() == ({"a"}, None)
    assert consumer.scheduler.get_stats() == {"kv_transfer_recomputed": 0}


def test_the_partial_block_goes_only_to_a_prompt_with_the_same_tokens_in_it():
    producer, consumer = Producer(), Consumer()
    params = producer.finish(request("a", PROMPT, {"do_remote_decode": True}), [7, 2, 9, 4])
    before = consumer.worker.kv_caches[LAYERS[0]][0].clone()
    other_tail = [*PROMPT[: 3 * BLOCK], *(t + 1 for t in PROMPT[3 * BLOCK :])]
    assert consumer.load(request("b", other_tail, params), [1, 5, 3, 0]) == 3 * BLOCK
    assert torch.equal(consumer.worker.kv_caches[LAYERS[0]][0], before)
    # a prompt whose tokens short of the last end on a block boundary has no partial block
    aligned = PROMPT[: 3 * BLOCK + 1]
    params = producer.finish(request("c", aligned, {"do_remote_decode": True}), [7, 2, 9, 4])
    assert params["remote_block_ids"] == [7, 2, 9]
    assert consumer.load(request("d", aligned, params), [1, 5, 3, 0]) == 3 * BLOCK


def test_a_request_finished_before_its_prompt_was_computed_holds_only_computed_blocks():
    producer = Producer()
    aborted = request("a", PROMPT, {"do_remote_decode": True})
    assert producer.scheduler.request_finished(aborted, [7, 2, 9, 4]) == (False, None)
    aborted.num_computed_tokens = BLOCK + 3
    _, params = producer.scheduler.request_finished(aborted, [7, 2, 9, 4])
    assert params["remote_block_ids"] == [7, 2] and len(params["block_hashes"]) == 1


def test_forged_params_get_no_block_of_another_prompt_or_salt():
    producer, consumer = Producer(), Consumer()
    params = producer.finish(request("victim", PROMPT, {"do_remote_decode": True}), [7, 2, 9, 4])
    before = {name: kv.clone() for name, kv in consumer.worker.kv_caches.items()}
    other = [t + 1 for t in PROMPT]
    assert consumer.load(request("forger", other, params), [1, 5, 3, 0]) == 0
    assert consumer.load(request("salted", PROMPT, params, salt="tenant-b"), [1, 5, 3, 0]) == 0
    for name in LAYERS:
        assert torch.equal(consumer.worker.kv_caches[name], before[name])
    assert consumer.scheduler.get_stats() == {"kv_transfer_recomputed": 2}
    assert producer.step() == (None, None)
    assert consumer.load(request("rightful", PROMPT, params), [1, 5, 3, 0]) == ALL_BUT_LAST
    assert producer.step() == ({"victim"}, None)


def test_blocks_no_one_pulls_are_freed_after_the_timeout():
    producer, consumer = Producer(send_timeout_s=0), Consumer(pull_timeout_s=0.5)
    sent = request("a", PROMPT, {"do_remote_decode": True})
    sent.num_computed_tokens = sent.num_tokens
    _, params = producer.scheduler.request_finished(sent, [7, 2, 9, 4])
    assert producer.step() == ({"a"}, None)
    assert consumer.load(request("b", PROMPT, params), [1, 5, 3, 0]) == 0
    assert consumer.scheduler.get_stats() == {"kv_transfer_recomputed": 1}


def test_unreachable_producer_is_a_counted_recompute_or_with_fail_an_error():
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_request_id": "gone",
    }
    consumer = Consumer(pull_timeout_s=0.5)
    assert consumer.load(request("b", PROMPT, params), [1, 5, 3, 0]) == 0
    assert consumer.scheduler.get_stats() == {"kv_transfer_recomputed": 1}
    failing = Consumer(pull_timeout_s=0.5, on_load_failure="fail")
    with pytest.raises(KVLoadError, match="pulling the prompt's KV failed"):
        failing.scheduler.get_num_new_matched_tokens(request("c", PROMPT, params), 0)
    stale = {**params, "remote_port": None}
    assert consumer.load(request("d", PROMPT, stale), [1, 5, 3, 0]) == 0


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"\['port'\] must be the port"):
        connector(KVConnectorRole.SCHEDULER, "kv_producer")
    with pytest.raises(ValueError, match=r"key\(s\) 'prot'"):
        connector(KVConnectorRole.SCHEDULER, "kv_consumer", prot=1)
    with pytest.raises(ValueError, match=r"on_load_failure"):
        connector(KVConnectorRole.SCHEDULER, "kv_consumer", on_load_failure="retry")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def test_engine_with_an_unreachable_producer_recomputes_or_fails_only_that_request(tiny_dir):
    from tokenmill import LLM

    dead = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_request_id": "gone",
    }
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:40]}]
    plain = SamplingParams(temperature=0, max_tokens=6)
    pulling = SamplingParams(temperature=0, max_tokens=6, extra_args={"kv_transfer_params": dead})
    for policy in ("recompute", "fail"):
        config = {
            "kv_connector": "p2p",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"pull_timeout_s": 0.5, "on_load_failure": policy},
        }
        llm = LLM(
            tiny_dir, kv_transfer_config=config, block_size=BLOCK, kv_cache_memory_bytes=2**24
        )
        want = [o.outputs[0] for o in llm.generate(prompts, plain)]
        got = [o.outputs[0] for o in llm.generate(prompts, [pulling, plain])]
        assert got[1].token_ids == want[1].token_ids
        if policy == "recompute":
            assert got[0].token_ids == want[0].token_ids
            assert llm.get_stats()["kv_transfer_recomputed"] == 1
        else:
            assert got[0].finish_reason == "error" and got[0].token_ids == []
            assert llm.get_stats()["kv_transfer_recomputed"] == 0
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["kv_blocks_held_for_transfer"] == 0


def test_engine_without_a_connector_refuses_kv_transfer_params(tiny_dir):
    from tokenmill import LLM

    llm = LLM(tiny_dir, kv_cache_memory_bytes=2**24)
    params = SamplingParams(extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="kv_transfer_params need a KV connector"):
        llm.generate({"prompt_token_ids": PROMPT}, params)


def test_decode_engine_computes_only_the_last_prompt_token(tiny_dir):
    """Two engines in one process: the decode engine, given the prefill engine's params,
    computes one prompt token per request (counters) and answers as the prefill engine does."""
    import threading

    from tokenmill import LLM

    port = free_port()

    def engine(kv_role: str, **extra) -> LLM:
        config = {"kv_connector": "p2p", "kv_role": kv_role, "kv_connector_extra_config": extra}
        return LLM(tiny_dir, kv_transfer_config=config, block_size=BLOCK, kv_cache_memory_bytes=2**24)

    prefill, decode = engine("kv_producer", port=port), engine("kv_consumer")
    prompts = [PROMPT, [t + 3 for t in PROMPT[: 3 * BLOCK + 1]], [t + 7 for t in PROMPT[:40]]]
    prefill_params = SamplingParams(
        temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    producer = prefill.llm_engine
    for i, prompt in enumerate(prompts):
        producer.add_request(f"p{i}", {"prompt_token_ids": prompt}, prefill_params)
    held: dict[str, dict] = {}
    while len(held) < len(prompts):
        held.update({o.request_id: o.kv_transfer_params for o in producer.step() if o.finished})

    def serve() -> None:
        """Step the prefill engine (its worker learns of the held blocks in a step) until
        every block was pulled."""
        while prefill.get_stats()["kv_blocks_held_for_transfer"]:
            producer.step()

    serving = threading.Thread(target=serve)
    serving.start()
    greedy = dict(temperature=0, max_tokens=6, logprobs=2)
    pulling = [SamplingParams(**greedy, extra_args={"kv_transfer_params": held[f"p{i}"]}) for i in range(3)]
    got = decode.generate([{"prompt_token_ids": p} for p in prompts], pulling, use_tqdm=False)
    serving.join(timeout=30)
    assert not serving.is_alive()
    want = prefill.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**greedy), use_tqdm=False)
    assert_same_completions(got, want)
    stats = decode.get_stats()
    computed = (
        stats["prefix_cache_query_tokens"]
        - stats["prefix_cache_hit_tokens"]
        - stats["external_prefix_cache_hit_tokens"]
    )
    assert computed == len(prompts)
    assert stats["external_prefix_cache_hit_tokens"] == sum(len(p) - 1 for p in prompts)
    assert stats["kv_transfer_recomputed"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert prefill.get_stats()["kv_blocks_held_for_transfer"] == 0
