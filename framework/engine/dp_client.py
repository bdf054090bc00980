"""``DPClient``: data parallelism, several engine cores behind one front end (vLLM V1's
data-parallel client with its coordinator's load balancing, in one process).

Each of the ``data_parallel_size`` cores is an ``MPClient`` (all started at once): its own
busy-loop process (a Ray actor on any node of a Ray cluster with
``data_parallel_backend="ray"``), with its own executor (tensor-parallel workers too, when
asked) and KV cache. A new request goes to the core with the lowest score
``waiting * 4 + running``, counted from the core's latest stats plus, as waiting, the
requests sent to it that those stats had not yet received; ties go to the lowest rank.
Aborts and finishes follow a request to the core that owns it. Every core's outputs reach
one ``output_handler``; if any core dies, the engine is dead.

With ``enable_expert_parallel`` the cores' workers form one expert-parallel group (DP
attention + EP MoE) and the cores step together: each core learns where the workers meet and
where the cores agree on their steps (two local TCP ports), and a request sent to one core
wakes the others, which must step with it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from collections.abc import Callable

from tokenmill.config import EngineConfig
from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_client import EngineCoreClient, EngineDeadError, MPClient
from tokenmill.engine.engine_core import EngineCoreOutputs
from tokenmill.engine.input_processor import EngineCoreRequest
from tokenmill.worker.multiproc_executor import get_open_port

WAITING_WEIGHT = 4
"""A waiting request counts this many running ones when choosing a core."""


def load_score(stats: dict[str, int], num_routed: int) -> int:
    """How loaded a core is: its stats' waiting and running requests, with the ones routed to
    it that its stats have not received yet (still in flight) counted as waiting.

    The stats are the core's latest message, which can predate requests already sent to it."""
    in_flight = num_routed - stats["num_requests_received"]
    waiting = stats["num_waiting_requests"] + in_flight
    return waiting * WAITING_WEIGHT + stats["num_running_requests"]


class DPClient(EngineCoreClient):
    def __init__(
        self,
        config: EngineConfig,
        output_handler: Callable[[EngineCoreOutputs | EngineDeadError], None],
    ) -> None:
        self.output_handler = output_handler
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        size = config.data_parallel_size
        self._num_routed = [0] * size
        if config.expert_parallel_across_data_parallel:
            config = copy.copy(config)
            config.expert_parallel_init_method = f"tcp://127.0.0.1:{get_open_port()}"
            config.data_parallel_sync_init_method = f"tcp://127.0.0.1:{get_open_port()}"

        # The first core that fails to start stops the others' starts: with experts across
        # the cores they would wait for it in the expert-parallel group's set-up.
        failed = threading.Event()
        first_error: list[BaseException] = []

        def start(rank: int) -> MPClient:
            core_config = copy.copy(config)
            core_config.data_parallel_rank = rank
            core_config.data_parallel_rank_local = 0 if config.data_parallel_backend == "ray" else rank
            try:
                return MPClient(core_config, self._on_output, abort_start=failed)
            except BaseException as e:
                with self._lock:
                    if not failed.is_set():
                        first_error.append(e)
                        failed.set()
                raise

        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            futures = [pool.submit(start, rank) for rank in range(size)]
        self.cores = [f.result() for f in futures if f.exception() is None]
        if first_error:
            self.shutdown()
            raise first_error[0]
        self._wake_others = config.expert_parallel_across_data_parallel
        self.max_model_len = min(c.max_model_len for c in self.cores)
        self.max_prompt_tokens = min(c.max_prompt_tokens for c in self.cores)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            scores = [load_score(c.get_stats(), n) for c, n in zip(self.cores, self._num_routed)]
            rank = scores.index(min(scores))
            self._owner[request.request_id] = rank
            self._num_routed[rank] += 1
        self.cores[rank].add_request(request)
        if self._wake_others:
            for other, core in enumerate(self.cores):
                if other != rank:
                    core.wake()

    def abort_requests(self, req_ids: list[str]) -> None:
        for rank, ids in self._by_owner(req_ids).items():
            self.cores[rank].abort_requests(ids)

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        for rank, ids in self._by_owner(req_ids).items():
            self.cores[rank].finish_requests(ids, status, stop_reason)

    def get_stats(self) -> dict[str, int]:
        """Every core's stats, summed."""
        total: dict[str, int] = {}
        for stats in self.get_engine_stats():
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def get_engine_stats(self) -> list[dict[str, int]]:
        """Each core's stats, with ``num_requests_routed``: the requests sent to it."""
        return [
            {**core.get_stats(), "num_requests_routed": routed}
            for core, routed in zip(self.cores, self._num_routed)
        ]

    def is_alive(self) -> bool:
        return all(core.is_alive() for core in self.cores)

    def seconds_without_progress(self) -> float:
        """The longest any core has owed a message (see ``MPClient``)."""
        return max(core.seconds_without_progress() for core in self.cores)

    def shutdown(self) -> None:
        for core in self.cores:
            core.begin_shutdown()
        for core in self.cores:
            core.shutdown()

    def _by_owner(self, req_ids: list[str]) -> dict[int, list[str]]:
        """The requests grouped by the core that owns them, which forgets them."""
        groups: dict[int, list[str]] = {}
        with self._lock:
            for req_id in req_ids:
                rank = self._owner.pop(req_id, None)
                if rank is not None:
                    groups.setdefault(rank, []).append(req_id)
        return groups

    def _on_output(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Runs on the receiving thread of the core that sent ``item``."""
        if isinstance(item, EngineCoreOutputs):
            with self._lock:
                for output in item.outputs:
                    if output.finish_reason is not None:
                        self._owner.pop(output.req_id, None)
        self.output_handler(item)
