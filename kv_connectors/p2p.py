"""``p2p``: a prefill instance (``kv_producer``) hands a prompt's KV blocks to a decode
instance (``kv_consumer``) over ZMQ, as vLLM's disaggregated prefill does.

The prefill instance runs a request that carries ``kv_transfer_params={"do_remote_decode":
true}`` and, when it finishes, keeps its blocks (a delayed free) and answers with
``kv_transfer_params`` naming itself (``remote_host``, ``remote_port``, ``remote_engine_id``),
the request (``remote_request_id``, ``remote_block_ids``) and the prompt's block hashes
(``block_hashes``, which a router matches against its decode instances' KV events). Its worker
serves the blocks on ``remote_port`` until a decode instance pulls them or
``send_timeout_s`` passes; then the blocks are freed.

The decode instance, given those params, pulls the blocks before it schedules the request,
naming the remote request *and* the block hashes of its own prompt, and the tokens of its
partial last block: the prefill instance sends only the leading blocks whose hashes match that
request's own, and the partial block only when all full blocks matched and its tokens are the
same, so params forged or copied from another request never read blocks of a prompt (or a
``cache_salt``) other than the puller's. The pull covers every prompt token but the last, so
the decode instance computes one prompt token (its logits give the first output token).
A pull that fails (the prefill instance is gone, the blocks timed out, the params are stale or
forged) makes the decode instance compute the prompt itself, counted in
``kv_transfer_recomputed``.

``kv_connector_extra_config``: ``host`` (the address decode instances reach the producer at;
default 127.0.0.1) and ``port`` (required for a producer), ``send_timeout_s`` (default 120),
``pull_timeout_s`` (default 5), ``on_load_failure`` (``recompute``, the default, or ``fail``:
the request finishes with ``finish_reason="error"`` instead).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from tokenmill.interfaces import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
    KVLoadError,
)

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.interfaces.kv_cache_spec import KVCacheSpec

logger = logging.getLogger(__name__)

WAIT_FOR_ENTRY_S = 5.0
"""How long a pull waits for a finished request's blocks to reach the worker (they come with
the next step's metadata)."""


@dataclass
class SendEntry:
    """A finished request's blocks, held for a decode instance to pull: its full prompt blocks
    (``block_hashes``), then, when the prompt's tokens short of the last end inside a block,
    that block (``block_ids`` has one more id) holding ``tail_token_ids``."""

    block_ids: list[int]
    block_hashes: list[bytes]
    tail_token_ids: list[int]
    deadline: float


@dataclass
class LoadEntry:
    """Blocks pulled for a request: one tensor per layer, ``[num_blocks, ...]``."""

    block_ids: list[int]
    layers: dict[str, torch.Tensor]


@dataclass
class Pulled:
    """Blocks a consumer pulled: one ``[num_blocks, ...]`` tensor per layer, holding the
    prompt's first ``num_tokens`` tokens (the last block may be partial)."""

    layers: dict[str, torch.Tensor]
    num_tokens: int


@dataclass
class P2pMetadata(KVConnectorMetadata):
    sends: dict[str, SendEntry] = field(default_factory=dict)
    loads: dict[str, LoadEntry] = field(default_factory=dict)


class PullRequest(msgspec.Struct):
    request_id: str
    block_hashes: list[bytes]
    tail_token_ids: list[int] = []


class PullReply(msgspec.Struct):
    num_blocks: int = 0
    num_tokens: int = 0
    error: str | None = None
    layers: list[str] = []
    shape: list[int] = []
    dtype: str = ""


def transfer_of(
    request: KVConnectorRequest, block_size: int, num_tokens: int
) -> tuple[list[bytes], list[int]]:
    """What of the first ``num_tokens`` prompt tokens goes from a prefill to a decode instance,
    never the prompt's last token (the decode instance computes it for its logits): the hashes
    of the full blocks, and the tokens of the partial block after them (empty when the tokens
    end on a block boundary). A partial block goes only after at least one full block, whose
    hash chain carries the request's ``cache_salt`` and LoRA adapter."""
    num_tokens = min(num_tokens, len(request.prompt_token_ids) - 1)
    num_full = num_tokens // block_size
    hashes = list(request.block_hashes[:num_full])
    if not hashes:
        return [], []
    return hashes, list(request.prompt_token_ids[num_full * block_size : num_tokens])


class P2pConnector(KVConnectorBase):
    """See the module's docstring."""

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        rank: int = 0,
        kv_cache_specs: dict[str, KVCacheSpec] | None = None,
    ) -> None:
        super().__init__(config, role, rank, kv_cache_specs)
        cfg = self.kv_transfer_config
        known = {"host", "port", "send_timeout_s", "pull_timeout_s", "on_load_failure"}
        unknown = sorted(set(cfg.kv_connector_extra_config) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has key(s) {', '.join(map(repr, unknown))} the p2p "
                f"connector does not take; it takes {', '.join(sorted(known))}"
            )
        self.host = str(cfg.extra("host", "127.0.0.1"))
        self.port = cfg.extra("port")
        if cfg.is_kv_producer and not isinstance(self.port, int):
            raise ValueError(
                "kv_connector_extra_config['port'] must be the port a p2p producer serves its "
                f"blocks on, got {self.port!r}"
            )
        self.on_load_failure = cfg.extra("on_load_failure", "recompute")
        if self.on_load_failure not in ("recompute", "fail"):
            raise ValueError(
                "kv_connector_extra_config['on_load_failure'] must be 'recompute' or 'fail', "
                f"got {self.on_load_failure!r}"
            )
        self.send_timeout_s = float(cfg.extra("send_timeout_s", 120.0))
        self.pull_timeout_s = float(cfg.extra("pull_timeout_s", 5.0))
        self.block_size = self.config.block_size
        self.engine_id = f"{self.host}:{self.port}"
        # scheduler side
        self.pulled: dict[str, Pulled | None] = {}
        """Per request: the pulled blocks, or None when the pull failed."""
        self.new_sends: dict[str, SendEntry] = {}
        self.new_loads: dict[str, LoadEntry] = {}
        self.num_recomputed = 0
        # worker side
        self.sends: dict[str, SendEntry] = {}
        self.done_sending: set[str] = set()
        self.lock = threading.Condition()
        self.server: threading.Thread | None = None
        if self.role is KVConnectorRole.WORKER and cfg.is_kv_producer:
            self.server = threading.Thread(target=self._serve, name="tokenmill-p2p", daemon=True)
            self.server.start()

    # ----- scheduler side -----

    def get_num_new_matched_tokens(
        self, request: KVConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        if request.request_id not in self.pulled:
            self.pulled[request.request_id] = self._pull(request, params)
        pulled = self.pulled[request.request_id]
        if pulled is None:
            return 0, False
        return max(pulled.num_tokens - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: KVConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pulled = self.pulled.pop(request.request_id, None)
        if pulled is None or num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        layers = {name: kv[first:last] for name, kv in pulled.layers.items()}
        self.new_loads[request.request_id] = LoadEntry(block_ids[first:last], layers)

    def build_connector_meta(self, scheduler_output: Any) -> P2pMetadata:
        meta = P2pMetadata(self.new_sends, self.new_loads)
        self.new_sends, self.new_loads = {}, {}
        return meta

    def request_finished(
        self, request: KVConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.pulled.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or not self.kv_transfer_config.is_kv_producer:
            return False, None
        hashes, tail = transfer_of(request, self.block_size, request.num_computed_tokens)
        if not hashes:
            return False, None
        sent_ids = block_ids[: len(hashes) + bool(tail)]
        self.new_sends[request.request_id] = SendEntry(
            sent_ids, hashes, tail, time.monotonic() + self.send_timeout_s
        )
        return True, {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": sent_ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request.request_id,
            "block_hashes": [h.hex() for h in hashes],
        }

    def get_stats(self) -> dict[str, int]:
        return {"kv_transfer_recomputed": self.num_recomputed}

    def _pull(self, request: KVConnectorRequest, params: dict[str, Any]) -> Pulled | None:
        """The remote blocks matching this request's prompt; None (counted) when none come."""
        hashes, tail = transfer_of(request, self.block_size, request.num_tokens)
        host, port = params.get("remote_host"), params.get("remote_port")
        remote_id = params.get("remote_request_id")
        if not hashes:
            return None
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(remote_id, str)):
            reason = "kv_transfer_params lack remote_host, remote_port or remote_request_id"
            return self._failed(request, reason)
        context = zmq.Context.instance()
        socket = context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        timeout_ms = int(self.pull_timeout_s * 1000)
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            socket.connect(f"tcp://{host}:{port}")
            socket.send(msgspec.msgpack.encode(PullRequest(remote_id, hashes, tail)))
            head, *frames = socket.recv_multipart()
        except zmq.ZMQError as e:
            return self._failed(request, f"{host}:{port} did not answer: {e}")
        finally:
            socket.close()
        reply = msgspec.msgpack.decode(head, type=PullReply)
        if reply.error is not None or reply.num_blocks == 0:
            return self._failed(request, reply.error or "no block matched")
        dtype = getattr(torch, reply.dtype)
        layers = {
            name: torch.frombuffer(bytearray(frame), dtype=torch.uint8)
            .view(dtype)
            .reshape(reply.shape)
            for name, frame in zip(reply.layers, frames, strict=True)
        }
        return Pulled(layers, reply.num_tokens)

    def _failed(self, request: KVConnectorRequest, reason: str) -> None:
        """Count a failed pull and let the prompt be computed here; or, with
        ``on_load_failure="fail"``, fail the request."""
        if self.on_load_failure == "fail":
            raise KVLoadError(f"pulling the prompt's KV failed: {reason}")
        self.num_recomputed += 1
        logger.warning(
            "request %s: pulling its KV failed (%s); computing its prompt here",
            request.request_id,
            reason,
        )
        return None

    # ----- worker side -----

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pMetadata)
        if meta.sends:
            with self.lock:
                self.sends.update(meta.sends)
                self.lock.notify_all()
        for entry in meta.loads.values():
            index = torch.tensor(entry.block_ids, dtype=torch.long)
            for name, kv in self.kv_caches.items():
                kv[index] = entry.layers[name].to(kv.device, kv.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        with self.lock:
            for req_id, entry in list(self.sends.items()):
                if entry.deadline <= now:
                    logger.warning("no decode instance pulled request %s's KV; freeing it", req_id)
                    del self.sends[req_id]
                    self.done_sending.add(req_id)
            done, self.done_sending = self.done_sending, set()
        return done or None, None

    def _serve(self) -> None:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        socket.bind(f"tcp://{self.host}:{self.port}")
        while True:
            address, empty, body = socket.recv_multipart()
            try:
                pull = msgspec.msgpack.decode(body, type=PullRequest)
                frames = self._answer(pull)
            except msgspec.DecodeError as e:
                frames = [msgspec.msgpack.encode(PullReply(error=f"malformed pull: {e}"))]
            socket.send_multipart([address, empty, *frames])

    def _answer(self, pull: PullRequest) -> list[bytes]:
        """The blocks of ``pull.request_id`` whose hashes match the puller's, leading ones only,
        and the partial block after them when every full block matched and its tokens are the
        puller's; a pull that matches none leaves the entry for its rightful puller."""
        deadline = time.monotonic() + WAIT_FOR_ENTRY_S
        with self.lock:
            while pull.request_id not in self.sends and time.monotonic() < deadline:
                self.lock.wait(0.05)
            entry = self.sends.get(pull.request_id)
            if entry is None:
                return [msgspec.msgpack.encode(PullReply(error="no such request held here"))]
            num = 0
            for mine, theirs in zip(entry.block_hashes, pull.block_hashes):
                if mine != theirs:
                    break
                num += 1
            if num == 0:
                return [msgspec.msgpack.encode(PullReply(error="no block of the prompt matched"))]
            del self.sends[pull.request_id]
        num_tokens = num * self.block_size
        whole = num == len(entry.block_hashes) == len(pull.block_hashes)
        if whole and entry.tail_token_ids and entry.tail_token_ids == pull.tail_token_ids:
            num += 1
            num_tokens += len(entry.tail_token_ids)
        index = torch.tensor(entry.block_ids[:num], dtype=torch.long)
        names = list(self.kv_caches)
        tensors = [self.kv_caches[name][index].contiguous().cpu() for name in names]
        with self.lock:
            self.done_sending.add(pull.request_id)
        reply = PullReply(
            num,
            num_tokens,
            layers=names,
            shape=list(tensors[0].shape),
            dtype=str(tensors[0].dtype).removeprefix("torch."),
        )
        return [
            msgspec.msgpack.encode(reply),
            *(t.view(torch.uint8).numpy().tobytes() for t in tensors),
        ]
