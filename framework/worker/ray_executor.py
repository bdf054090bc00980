"""``RayExecutor`` (``distributed_executor_backend="ray"``): one Ray actor per rank
(``tensor_parallel_size * pipeline_parallel_size``), on any node of a Ray cluster, running the
same ``Worker`` as the other executors.

The actors are placed by a placement group of one bundle per rank (a CPU, or a GPU on a GPU
platform) with the ``PACK`` strategy: on one node when it has room, spread over as few as
needed when not. The ranks meet for ``torch.distributed`` at rank 0's node address. The
executor joins the Ray cluster this process is connected to, else the one ``RAY_ADDRESS`` or a
``ray start`` on this machine names, else starts a local one (``ray.init()``). Each step's
scheduler output is put in Ray's object store once and every rank reads it; the sampling
rank's result comes back (the last stage's first rank). Under pipeline parallelism the batch
queue works as with ``mp``: each actor runs its calls in order, so a stage starts step N+1
while the next stage still runs step N. Actors die with the process that created them (Ray's
ownership); an actor that dies or fails a call takes the executor down (``ExecutorDeadError``,
naming the rank and its stage).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.worker.executor import DistributedExecutor, ExecutorDeadError, output_rank
from tokenmill.worker.multiproc_executor import get_open_port
from tokenmill.worker.worker import Worker

PLACEMENT_TIMEOUT_S = 60.0
"""How long to wait for the cluster to find room for every rank."""

_INIT_LOCK = threading.Lock()
"""Data-parallel engine cores start in threads, each connecting to Ray: one ``ray.init()``."""


def init_ray(setting: str) -> Any:
    """The ``ray`` module, connected to a cluster: the one this process is connected to, else
    the one ``RAY_ADDRESS`` or a ``ray start`` on this machine names, else a new local one.
    ``setting`` names what asked for Ray, for the error when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"{setting} needs Ray: pip install 'tokenmill[ray]'") from None
    with _INIT_LOCK:
        if not ray.is_initialized():
            ray.init()
    return ray


class RayWorker:
    """The actor around one rank's ``Worker``."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.sends_tokens = False

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's is the rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), get_open_port()

    def init_worker(
        self,
        config: EngineConfig,
        rank: int,
        init_method: str,
        registrations: list[tuple[str, str, str]],
    ) -> None:
        for kind, name, target in registrations:
            plugins.register(kind, name, target)
        self.sends_tokens = rank == output_rank(config)
        # Ray shows each actor only its own GPU, as device 0.
        self.worker = Worker(config, rank, init_method, local_rank=0)
        self.worker.load_model()

    def execute_method(self, method: str, *args: Any) -> Any:
        assert self.worker is not None
        result = getattr(self.worker, method)(*args)
        return None if method == "execute_model" and not self.sends_tokens else result


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = init_ray("distributed_executor_backend='ray'")
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        gpu = config.platform_cls.device_type != "cpu"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._placement = placement_group(
            [dict(bundle) for _ in range(self.world_size)], strategy="PACK"
        )
        self.workers: list[Any] = []
        self._finalizer = weakref.finalize(
            self, _release, ray, self.workers, self._placement, remove_placement_group
        )
        try:
            ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(
                    f"the Ray cluster found no room for {self.world_size} ranks of {bundle} in "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.available_resources()}"
                )
            actor_cls = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(RayWorker)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                )
                self.workers.append(actor_cls.options(scheduling_strategy=strategy).remote())
            host, port = ray.get(self.workers[0].address.remote())
            registrations = plugins.runtime_registrations()
            self._gather(
                "startup",
                [
                    w.init_worker.remote(config, rank, f"tcp://{host}:{port}", registrations)
                    for rank, w in enumerate(self.workers)
                ],
            )
            self.worker_info = self._call_all("describe")[self.output_rank]
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Let the ranks leave their process group together, then kill the actors and free
        their placement."""
        if self._dead is None and self.workers:
            try:
                self._call_all("shutdown")
            except ExecutorDeadError:
                pass
        self._dead = self._dead or "the executor was shut down"
        self._finalizer()

    def _send(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Each argument goes into the object store once, for every rank to read; each actor
        runs its calls in the order they were sent."""
        refs = tuple(self._ray.put(arg) for arg in args)
        return [w.execute_method.remote(method, *refs) for w in self.workers]

    def _gather(self, method: str, handle: list[Any]) -> list[Any]:
        """Wait for the ranks in the order they finish, failing on the first rank that died
        or raised (the others may wait for it in a collective)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(handle)}
        results: list[Any] = [None] * len(handle)
        pending = list(handle)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"{self.rank_name(rank)} (Ray actor) died during {method}: {e}")
                except ray.exceptions.RayTaskError as e:
                    self._fail(f"{self.rank_name(rank)} failed in {method}:\n{e}")
        return results


def _release(ray: Any, workers: list[Any], placement: Any, remove_placement_group: Any) -> None:
    if not ray.is_initialized():
        return
    for worker in workers:
        ray.kill(worker)
    remove_placement_group(placement)
