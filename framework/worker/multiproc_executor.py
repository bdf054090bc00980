"""``MultiprocExecutor`` (``distributed_executor_backend="mp"``): one worker process per
rank (``tensor_parallel_size * pipeline_parallel_size``) on this machine, as vLLM V1's.

Each call is pickled once and pushed to every rank over its own ZMQ ``ipc://`` socket (one
message per rank and step: the scheduler output is small next to a forward pass); every rank
answers on one shared socket, rank 0 with the sampled tokens and the others with an
acknowledgement (under pipeline parallelism the last stage's first rank sends the tokens).
A step sent with ``non_block`` returns a future at once, so the engine core can send the next
step while the stages still work on this one (the batch queue); each rank answers its calls
in order, and a future's result is its step's answers. The ranks meet for ``torch.distributed`` (the platform's ``dist_backend``:
gloo on the CPU, NCCL on GPUs) at a TCP port of this machine; when the experts span the
data-parallel engine cores, at the port the front end gave every core, with the other cores'
ranks (one rank per core included).

Workers are started with ``python -m tokenmill.worker.multiproc_executor`` (so an engine-core
process, itself a child, can start them) and die with it: each watches its parent. A worker
that dies or fails a call takes the executor down (``ExecutorDeadError``, naming the rank)
within ``POLL_INTERVAL_S``; the other ranks are killed, so nothing is left behind.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

import zmq

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.worker.executor import DistributedExecutor, ExecutorDeadError, output_rank
from tokenmill.worker.worker import Worker

POLL_INTERVAL_S = 0.1
"""How often a waiting executor checks that its workers live, and a worker its parent."""
SHUTDOWN_TIMEOUT_S = 10.0
DEATH_GRACE_S = 0.5
"""After a rank reports an error, how long to look for a rank that died (the root cause)."""
EXIT = b"exit"
"""Sent to every worker once all have left the process group."""


def get_open_port() -> int:
    """A free TCP port of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._early: list[deque[tuple[bool, Any]]] = [deque() for _ in range(self.world_size)]
        """Answers of a rank to calls after the one being gathered (a faster stage's)."""
        self._dir = tempfile.mkdtemp(prefix="tokenmill-workers-")
        self._context = zmq.Context()
        reply_address = f"ipc://{os.path.join(self._dir, 'replies')}"
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(reply_address)
        self._requests = []
        self.workers: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.workers, self._context, self._dir
        )
        init_method = config.expert_parallel_init_method or f"tcp://127.0.0.1:{get_open_port()}"
        try:
            for rank in range(self.world_size):
                address = f"ipc://{os.path.join(self._dir, f'rank{rank}')}"
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(address)
                self._requests.append(sock)
                self.workers.append(
                    subprocess.Popen([sys.executable, "-m", __name__, address, reply_address])
                )
            registrations = plugins.runtime_registrations()
            for rank, sock in enumerate(self._requests):
                sock.send(pickle.dumps((config, rank, init_method, registrations)))
            self._gather("startup", None)
            self.worker_info = self._call_all("describe")[self.output_rank]
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Let the ranks leave their process group together, and only then exit (a gloo rank
        that closes its sockets while another still tears down can abort it); kill any
        worker that does not exit in time."""
        if self._dead is None and len(self.workers) == self.world_size:
            try:
                self._call_all("shutdown")
                for sock in self._requests:
                    sock.send(EXIT)
                deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
                for proc in self.workers:
                    proc.wait(max(0.0, deadline - time.monotonic()))
            except (ExecutorDeadError, subprocess.TimeoutExpired):
                pass
        self._dead = self._dead or "the executor was shut down"
        self._finalizer()

    def _send(self, method: str, args: tuple[Any, ...]) -> None:
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._requests:
            sock.send(message, copy=False)

    def _gather(self, method: str, handle: None) -> list[Any]:
        """Each rank answers its calls in order: the first answer not taken yet is this
        call's."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        for rank in range(self.world_size):
            if self._early[rank]:
                self._take(method, rank, *self._early[rank].popleft(), results, pending)
        while pending:
            if not self._replies.poll(int(POLL_INTERVAL_S * 1000)):
                self._check_alive(method)
                continue
            rank, ok, value = pickle.loads(self._replies.recv())
            if rank in pending:
                self._take(method, rank, ok, value, results, pending)
            else:
                self._early[rank].append((ok, value))
        return results

    def _take(
        self, method: str, rank: int, ok: bool, value: Any, results: list[Any], pending: set[int]
    ) -> None:
        if not ok:
            # A rank that died makes the others' collectives fail: report the death.
            deadline = time.monotonic() + DEATH_GRACE_S
            while time.monotonic() < deadline:
                self._check_alive(method, but=rank)
                time.sleep(POLL_INTERVAL_S / 10)
            self._fail(f"{self.rank_name(rank)} failed in {method}:\n{value}")
        results[rank] = value
        pending.discard(rank)

    def _check_alive(self, method: str, but: int | None = None) -> None:
        """Fail if a worker (other than rank ``but``) has exited."""
        for rank, proc in enumerate(self.workers):
            if rank != but and proc.poll() is not None:
                self._fail(
                    f"{self.rank_name(rank)} (pid {proc.pid}) "
                    f"{describe_exit(proc.returncode)} during {method}"
                )


def _stop_workers(workers: list[subprocess.Popen], context: zmq.Context, ipc_dir: str) -> None:
    """Kill the workers still running and release the sockets (also when the executor is
    garbage-collected or the process exits)."""
    for proc in workers:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    context.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _watch_parent(parent_pid: int) -> None:
    """Exit the moment the executor's process is gone, even while blocked in a collective."""
    while os.getppid() == parent_pid:
        time.sleep(POLL_INTERVAL_S)
    os._exit(1)


def worker_main(request_address: str, reply_address: str) -> None:
    """A worker process: build rank ``rank``'s ``Worker`` from the first message, report
    ready (or the error), then run each call until ``shutdown``."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    context = zmq.Context()
    requests = context.socket(zmq.PULL)
    requests.connect(request_address)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(reply_address)
    config, rank, init_method, registrations = pickle.loads(requests.recv())
    sends_tokens = rank == output_rank(config)

    def reply(ok: bool, value: Any) -> None:
        replies.send(pickle.dumps((rank, ok, value), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        for kind, name, target in registrations:
            plugins.register(kind, name, target)
        worker = Worker(config, rank, init_method)
        worker.load_model()
    except Exception:
        reply(False, traceback.format_exc())
        context.destroy(linger=1000)
        sys.exit(1)
    reply(True, None)
    while True:
        method, args = pickle.loads(requests.recv())
        try:
            result = getattr(worker, method)(*args)
        except Exception:
            reply(False, traceback.format_exc())
            continue
        reply(True, None if method == "execute_model" and not sends_tokens else result)
        if method == "shutdown":
            requests.poll(int(SHUTDOWN_TIMEOUT_S * 1000))  # EXIT: every rank has left the group
            break
    context.destroy(linger=1000)


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2])
