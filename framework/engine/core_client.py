"""Clients of the engine core (vLLM V1's ``EngineCoreClient``): ``InprocClient`` calls an
``EngineCore`` in this process (``LLM``); ``MPClient`` runs it in a busy loop in a child
process (``AsyncLLM``, ``tokenmill serve``) and talks to it over ZMQ with msgpack."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_proc import (
    ABORT,
    ADD,
    FINISH,
    OUTPUTS,
    POLL_INTERVAL_MS,
    READY,
    SHUTDOWN,
    WAKE,
    EngineCoreInfo,
    FinishRequests,
    Payload,
    StartupError,
    decode,
    encoder,
    run_engine_core,
)
from tokenmill.engine.engine_core import EngineCore, EngineCoreOutputs
from tokenmill.engine.input_processor import EngineCoreRequest
from tokenmill.engine.ray_core import RayEngineCore

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core was shut down or died; no request can run on it any more."""


class EngineCoreClient:
    """What a front end asks of the engine core. ``max_model_len`` and
    ``max_prompt_tokens`` are the core's limits, which prompts are checked against."""

    max_model_len: int
    max_prompt_tokens: int

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, req_ids: list[str]) -> None:
        raise NotImplementedError

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish requests from outside a step, e.g. on a stop string the front end matched."""
        raise NotImplementedError

    def get_stats(self) -> dict[str, int]:
        raise NotImplementedError

    def get_engine_stats(self) -> list[dict[str, int]]:
        """The stats of each engine core behind this client (one, without data parallelism)."""
        return [self.get_stats()]

    def shutdown(self) -> None:
        """Release the engine core; the client is unusable afterwards."""


class InprocClient(EngineCoreClient):
    """The engine core in this process, stepped by the caller through ``get_output``."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        assert config.max_model_len is not None
        self.max_model_len = config.max_model_len
        self.max_prompt_tokens = self.engine_core.max_prompt_tokens()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.engine_core.abort_requests(req_ids)

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        self.engine_core.finish_requests(req_ids, status, stop_reason)

    def get_output(self) -> EngineCoreOutputs:
        """Run one step; raises what the step raised (its requests are failed first)."""
        return self.engine_core.step()

    def get_stats(self) -> dict[str, int]:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """Runs ``EngineCoreProc``'s busy loop in a spawned child process (or, with
    ``in_thread``, in a daemon thread of this one) and talks to it over ZMQ ``ipc://``
    sockets in a private temporary directory; with ``data_parallel_backend="ray"``, in a Ray
    actor (``RayEngineCore``) over TCP sockets on this node's address.

    Requests go out from the caller's thread (always the same one). A thread of the client
    receives the core's messages and passes each ``EngineCoreOutputs`` to ``output_handler``;
    if the core dies, it passes an ``EngineDeadError`` instead and stops. The child process
    exits when this process dies. Raises ``ValueError`` or ``RuntimeError`` if the core fails
    to start, or once ``abort_start`` is set while it starts (the core is stopped then).
    """

    def __init__(
        self,
        config: EngineConfig,
        output_handler: Callable[[EngineCoreOutputs | EngineDeadError], None],
        in_thread: bool = False,
        abort_start: threading.Event | None = None,
    ) -> None:
        self.output_handler = output_handler
        self._abort_start = abort_start
        on_ray = config.data_parallel_backend == "ray"
        if on_ray and in_thread:
            raise ValueError(
                "data_parallel_backend='ray' runs each engine core as a Ray actor; it cannot "
                "run in a thread of the front end (engine_process=False)"
            )
        self._dir = tempfile.mkdtemp(prefix="tokenmill-ipc-")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._context.socket(zmq.PULL)
        if on_ray:
            host = f"tcp://{RayEngineCore.node_address()}"
            input_address = f"{host}:{self._input.bind_to_random_port(host)}"
            output_address = f"{host}:{self._output.bind_to_random_port(host)}"
        else:
            input_address = f"ipc://{os.path.join(self._dir, 'input')}"
            output_address = f"ipc://{os.path.join(self._dir, 'output')}"
            self._input.bind(input_address)
            self._output.bind(output_address)
        self._stopping = False
        self._closed = False
        self._last_error: str | None = None
        """The latest step error the core reported (what a core that then died died of)."""
        self._stats: dict[str, int] = {}
        self._num_added = 0
        self._owed_since = 0.0
        self._last_message = 0.0
        registrations = [] if in_thread else plugins.runtime_registrations()
        self._core: threading.Thread | multiprocessing.process.BaseProcess | RayEngineCore
        parent_pid = None if in_thread else os.getpid()
        args = (config, input_address, output_address, parent_pid, registrations)
        if in_thread:
            self._core = threading.Thread(
                target=run_engine_core, args=args, name="tokenmill-engine-core", daemon=True
            )
        elif on_ray:
            self._core = RayEngineCore(
                config, (config, input_address, output_address, registrations)
            )
        else:
            self._core = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, args=args, name="tokenmill-engine-core", daemon=True
            )
        try:
            self._core.start()
            self._wait_ready()
            self._abort_start = None
        except BaseException:
            self._stop_core()
            self._close()
            raise
        self._reader = threading.Thread(
            target=self._read_outputs, name="tokenmill-core-outputs", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        """The engine core's process id (this process's with ``in_thread``)."""
        return getattr(self._core, "pid", None) or os.getpid()

    def is_alive(self) -> bool:
        return self._core.is_alive()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the core; ``ValueError`` if msgpack cannot carry one of its
        values (an integer beyond 64 bits, a string with a lone surrogate)."""
        try:
            payload = encoder.encode(request)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"the request cannot be sent to the engine core: {e}") from None
        if not self._owes_progress():
            self._owed_since = time.monotonic()
        self._send(ADD, payload)
        self._num_added += 1

    def abort_requests(self, req_ids: list[str]) -> None:
        self._send(ABORT, encoder.encode(req_ids))

    def wake(self) -> None:
        """End the core's idle wait: another core whose experts span this one got a request,
        and this one must meet its step now, not after its poll interval."""
        self._send(WAKE, encoder.encode(None))

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        self._send(FINISH, encoder.encode(FinishRequests(req_ids, int(status), stop_reason)))

    def get_stats(self) -> dict[str, int]:
        """The core's stats as of its latest message."""
        return self._stats

    def seconds_without_progress(self) -> float:
        """How long the core has owed a message and sent none: while it holds unfinished
        requests or has not taken all the requests sent to it, it reports after every step;
        0 when it owes nothing."""
        if not self._owes_progress():
            return 0.0
        return time.monotonic() - max(self._owed_since, self._last_message)

    def _owes_progress(self) -> bool:
        stats = self._stats
        return (
            stats.get("num_running_requests", 0) + stats.get("num_waiting_requests", 0) > 0
            or stats.get("num_requests_received", 0) < self._num_added
        )

    def begin_shutdown(self) -> None:
        """Tell the core to stop without waiting for it (``shutdown`` waits): a front end
        whose cores stop together (experts spanning them) tells every core first."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(zmq.ZMQError):
            self._input.send_multipart([SHUTDOWN, encoder.encode(None)], zmq.NOBLOCK)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._stop_core()
        self._reader.join(SHUTDOWN_TIMEOUT_S)
        self._close()

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self._stopping or not self.is_alive():
            raise EngineDeadError(self._death_message())
        try:
            self._input.send_multipart([kind, payload], zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(self._death_message()) from None

    def _recv(self) -> tuple[bytes, Payload] | None:
        """The next message; None once the core is gone and nothing is left to read (or,
        while it starts, once ``abort_start`` is set)."""
        while not self._output.poll(POLL_INTERVAL_MS):
            if not self.is_alive() or (self._abort_start is not None and self._abort_start.is_set()):
                return None
        return decode(self._output.recv_multipart())

    def _wait_ready(self) -> None:
        message = self._recv()
        if message is None and self.is_alive():
            raise RuntimeError(
                f"the engine core ({self._core.name}, pid {self.pid}) was stopped while starting: "
                "another data-parallel engine core failed to start"
            )
        if message is None:
            raise RuntimeError(f"{self._death_message()} while starting")
        kind, payload = message
        if isinstance(payload, StartupError):
            error = ValueError if payload.type == "ValueError" else RuntimeError
            raise error(payload.message)
        assert kind == READY and isinstance(payload, EngineCoreInfo)
        self.max_model_len = payload.max_model_len
        self.max_prompt_tokens = payload.max_prompt_tokens
        self._stats = payload.stats

    def _read_outputs(self) -> None:
        while True:
            message = self._recv()
            if message is None:
                if not self._stopping:
                    logger.error("%s", self._death_message())
                    self.output_handler(EngineDeadError(self._death_message()))
                return
            kind, outputs = message
            assert kind == OUTPUTS and isinstance(outputs, EngineCoreOutputs)
            self._last_message = time.monotonic()
            if outputs.stats is not None:
                self._stats = outputs.stats
            if outputs.error is not None:
                self._last_error = outputs.error
            self.output_handler(outputs)

    def _death_message(self) -> str:
        if self._stopping:
            return "the engine was shut down"
        code = getattr(self._core, "exitcode", None)
        how = "" if code is None else f" with exit code {code}"
        last = "" if self._last_error is None else f"; its last error: {self._last_error}"
        return f"the engine core ({self._core.name}, pid {self.pid}) died{how}{last}"

    def _stop_core(self) -> None:
        if self._core.is_alive():
            try:
                self._input.send_multipart([SHUTDOWN, encoder.encode(None)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._core.join(SHUTDOWN_TIMEOUT_S)
        if not isinstance(self._core, threading.Thread):
            if self._core.is_alive():
                self._core.kill()
            self._core.join()

    def _close(self) -> None:
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
