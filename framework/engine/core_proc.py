"""``EngineCoreProc``: the engine core's busy loop between two ZMQ sockets (vLLM V1's
``EngineCoreProc``), and the msgpack messages that cross them.

The loop pulls adds, aborts and finishes from its input socket, steps while any request is
unfinished, and pushes each step's ``EngineCoreOutputs`` (with the core's stats) on its output
socket. Data-parallel cores whose experts span them step together (dummy steps on the idle
ones: vLLM's waves), agreeing over a gloo group of the cores before every step. Token ids
travel as msgpack lists: no tensor crosses the boundary.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import INIT_TIMEOUT, expert_rank_names
from tokenmill.core.request import RequestStatus
from tokenmill.engine.engine_core import EngineCore, EngineCoreOutputs
from tokenmill.engine.input_processor import EngineCoreRequest
from tokenmill.worker.executor import ExecutorDeadError

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100
"""How long an idle loop waits for input before checking that its parent is alive."""

ADD, ABORT, FINISH, SHUTDOWN, WAKE = b"add", b"abort", b"finish", b"shutdown", b"wake"
"""Input message kinds (first frame); the second frame is the msgpack payload. ``WAKE``
(nothing) ends an idle wait: another core whose experts span this one got a request, and
both are about to agree on a step."""
READY, STARTUP_ERROR, OUTPUTS = b"ready", b"startup_error", b"outputs"
"""Output message kinds."""


@dataclass
class FinishRequests:
    """Finish these requests with ``status`` (a stop string the front end matched)."""

    req_ids: list[str]
    status: int
    stop_reason: int | str | None = None


@dataclass
class EngineCoreInfo:
    """What the core tells its client once it is ready: the limits prompts are checked
    against (the core may have lowered ``max_model_len`` to its KV cache) and its stats."""

    max_model_len: int
    max_prompt_tokens: int
    stats: dict[str, int]


@dataclass
class StartupError:
    type: str
    message: str


Payload = (
    EngineCoreRequest | list[str] | FinishRequests | None | EngineCoreInfo | StartupError
    | EngineCoreOutputs
)
"""What a message carries, by kind: ``DECODERS`` decodes each kind to its type."""

encoder = msgspec.msgpack.Encoder()
DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    ABORT: msgspec.msgpack.Decoder(list[str]),
    FINISH: msgspec.msgpack.Decoder(FinishRequests),
    SHUTDOWN: msgspec.msgpack.Decoder(None),
    WAKE: msgspec.msgpack.Decoder(None),
    READY: msgspec.msgpack.Decoder(EngineCoreInfo),
    STARTUP_ERROR: msgspec.msgpack.Decoder(StartupError),
    OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
}


def decode(frames: list[bytes]) -> tuple[bytes, Payload]:
    kind, data = frames
    payload: Payload = DECODERS[kind].decode(data)
    return kind, payload


class EngineCoreProc:
    """Runs one ``EngineCore`` in a busy loop. ``parent_pid``: exit when this process is no
    longer the parent's child (the parent died); None in a thread. ``data_parallel_group``:
    the engine cores' process group when their experts span them (they step together)."""

    def __init__(
        self,
        engine_core: EngineCore,
        input_socket: zmq.Socket[bytes],
        output_socket: zmq.Socket[bytes],
        parent_pid: int | None,
        data_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.engine_core = engine_core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.data_parallel_group = data_parallel_group

    def run_busy_loop(self) -> None:
        """Serve until a shutdown message or the parent's death. A step that raises fails its
        requests (every request, if it raised while scheduling) and the loop serves on. When
        the executor dies, report the error for the requests in flight and raise: the process
        ends, and its client sees an engine that died.

        With ``data_parallel_group`` (experts spanning the data-parallel cores) every
        iteration first agrees with the other cores, in one all-reduce, on how many have
        requests and how many were told to shut down: while any has requests, a core without
        any runs a dummy step (as does one whose step sent nothing to its workers), so the
        MoE layers' collectives always meet; when none has, all wait for input together (the
        front end wakes every core when it sends one a request); the cores leave together
        once each was told to shut down."""
        core = self.engine_core
        group_busy = stopping = False
        while True:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the front-end process died; the engine core exits")
                return
            if not (group_busy or core.has_unfinished_requests()):
                if not self.input.poll(POLL_INTERVAL_MS) and self.data_parallel_group is None:
                    continue
            changed, shutdown = self._receive()
            if shutdown and not stopping:
                core.abort_all_requests()
                if self.data_parallel_group is None:
                    return
                stopping = True
            has_work = core.has_unfinished_requests()
            if self.data_parallel_group is not None:
                busy, stopped = self._agree(self.data_parallel_group, has_work, stopping)
                if stopped == dist.get_world_size(self.data_parallel_group):
                    return
                group_busy = busy > 0
            if has_work:
                executed = core.num_executed_steps
                outputs = self._step()
                if group_busy and core.num_executed_steps == executed:
                    self._dummy_step()
            else:
                if group_busy:
                    self._dummy_step()
                if not changed:
                    continue
                outputs = EngineCoreOutputs()
            outputs.stats = core.get_stats()
            self.output.send_multipart([OUTPUTS, encoder.encode(outputs)])

    def _receive(self) -> tuple[bool, bool]:
        """Handle every message waiting on the input socket: whether there were any, and
        whether one was a shutdown."""
        changed = False
        while True:
            try:
                kind, payload = decode(self.input.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return changed, False
            if kind == SHUTDOWN:
                return True, True
            if kind != WAKE:
                self._handle(payload)
                changed = True

    def _agree(self, group: dist.ProcessGroup, has_work: bool, stopping: bool) -> tuple[int, int]:
        """How many cores have requests and how many were told to shut down. If another
        core is gone, fail this core's requests saying so, and raise (the core exits)."""
        flags = torch.tensor([int(has_work), int(stopping)])
        try:
            dist.all_reduce(flags, group=group)
        except RuntimeError as e:
            failed = self.engine_core.abort_all_requests()
            error = f"the data-parallel engine cores whose experts span them lost one: {e}"
            dead = self._dead_expert_ranks()
            if dead:
                error = f"{expert_rank_names(dead)} died; {error}"
            outputs = EngineCoreOutputs(error=error, failed_req_ids=failed)
            self.output.send_multipart([OUTPUTS, encoder.encode(outputs)])
            raise
        busy, stopped = flags.tolist()
        return busy, stopped

    def _dead_expert_ranks(self) -> list[tuple[int, int]]:
        """The expert-parallel ranks whose process is gone, as this core's workers see them
        (a few tries: the dead rank's process may still be exiting); none if they cannot
        say."""
        for _ in range(10):
            try:
                dead = self.engine_core.executor.dead_expert_parallel_ranks()
            except Exception:
                return []
            if dead:
                return dead
            time.sleep(0.1)
        return []

    def _dummy_step(self) -> None:
        """``EngineCore.execute_dummy_batch``; when the executor dies, report why before
        raising (the core then exits)."""
        try:
            self.engine_core.execute_dummy_batch()
        except ExecutorDeadError as e:
            self.output.send_multipart([OUTPUTS, encoder.encode(EngineCoreOutputs(error=str(e)))])
            raise

    def _step(self) -> EngineCoreOutputs:
        """One step of the core: its outputs, or the error and the requests it failed."""
        core = self.engine_core
        try:
            return core.step()
        except ExecutorDeadError as e:
            failed = (core.failed_req_ids or []) + core.abort_all_requests()
            outputs = EngineCoreOutputs(error=str(e), failed_req_ids=failed)
            self.output.send_multipart([OUTPUTS, encoder.encode(outputs)])
            raise
        except Exception as e:
            if core.failed_req_ids is None:
                logger.exception("engine step failed to schedule; failing every request")
                failed = core.abort_all_requests()
            else:
                logger.exception("engine step failed; failing its requests")
                failed = core.failed_req_ids
            return EngineCoreOutputs(error=f"{type(e).__name__}: {e}", failed_req_ids=failed)

    def _handle(self, payload: Payload) -> None:
        if isinstance(payload, EngineCoreRequest):
            self.engine_core.add_request(payload)
        elif isinstance(payload, list):
            self.engine_core.abort_requests(payload)
        elif isinstance(payload, FinishRequests):
            self.engine_core.finish_requests(
                payload.req_ids, RequestStatus(payload.status), payload.stop_reason
            )


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int | None,
    registrations: list[tuple[str, str, str]],
) -> None:
    """Entry point of the engine-core process (or thread, or Ray actor): repeat the front
    end's runtime plugin registrations (none in a thread, which shares them), build the
    ``EngineCore``, report ready (or the error that stopped it) and run the busy loop.
    ``parent_pid``: see ``EngineCoreProc``."""
    for kind, name, target in registrations:
        plugins.register(kind, name, target)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.connect(output_address)
    try:
        try:
            core = EngineCore(config)
        except Exception as e:
            error = StartupError(type(e).__name__, str(e))
            output_socket.send_multipart([STARTUP_ERROR, encoder.encode(error)])
            return
        assert config.max_model_len is not None
        group = None
        if config.data_parallel_sync_init_method is not None:
            dist.init_process_group(
                "gloo",
                init_method=config.data_parallel_sync_init_method,
                rank=config.data_parallel_rank,
                world_size=config.data_parallel_size,
                timeout=INIT_TIMEOUT,
            )
            group = dist.group.WORLD
        info = EngineCoreInfo(config.max_model_len, core.max_prompt_tokens(), core.get_stats())
        output_socket.send_multipart([READY, encoder.encode(info)])
        try:
            EngineCoreProc(core, input_socket, output_socket, parent_pid, group).run_busy_loop()
        finally:
            core.shutdown()
            if group is not None:
                dist.destroy_process_group()
    finally:
        context.destroy(linger=1000)
