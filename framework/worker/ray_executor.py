"""``RayExecutor`` (``distributed_executor_backend="ray"``): one Ray actor per tensor-parallel
rank, on any node of a Ray cluster, running the same ``Worker`` as the other executors.

The actors are placed by a placement group of one bundle per rank (a CPU, or a GPU on a GPU
platform) with the ``PACK`` strategy: on one node when it has room, spread over as few as
needed when not. The ranks meet for ``torch.distributed`` at rank 0's node address. The
executor joins the Ray cluster this process is connected to, else the one ``RAY_ADDRESS`` or a
``ray start`` on this machine names, else starts a local one (``ray.init()``). Each step's
scheduler output is put in Ray's object store once and every rank reads it; rank 0's result
comes back. Actors die with the process that created them (Ray's ownership); an actor that
dies or fails a call takes the executor down (``ExecutorDeadError``, naming the rank).
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.worker.executor import DistributedExecutor, ExecutorDeadError
from tokenmill.worker.model_runner import ModelRunnerOutput
from tokenmill.worker.multiproc_executor import get_open_port
from tokenmill.worker.worker import Worker

PLACEMENT_TIMEOUT_S = 60.0
"""How long to wait for the cluster to find room for every rank."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'tokenmill[ray]'"
        ) from None
    return ray


class RayWorker:
    """The actor around one rank's ``Worker``."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = 0

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
        self.rank = rank
        # Ray shows each actor only its own GPU, as device 0.
        self.worker = Worker(config, rank, init_method, local_rank=0)
        self.worker.load_model()

    def execute_method(self, method: str, *args: Any) -> Any:
        assert self.worker is not None
        result = getattr(self.worker, method)(*args)
        return None if self.rank and method == "execute_model" else result


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        if not ray.is_initialized():
            ray.init()
        world_size = config.tensor_parallel_size
        gpu = config.platform_cls.device_type != "cpu"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._placement = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self.workers: list[Any] = []
        self._finalizer = weakref.finalize(
            self, _release, ray, self.workers, self._placement, remove_placement_group
        )
        try:
            ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(
                    f"the Ray cluster found no room for {world_size} ranks of {bundle} in "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.available_resources()}"
                )
            actor_cls = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(RayWorker)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                )
                self.workers.append(actor_cls.options(scheduling_strategy=strategy).remote())
            host, port = ray.get(self.workers[0].address.remote())
            registrations = plugins.runtime_registrations()
            self._get(
                [
                    w.init_worker.remote(config, rank, f"tcp://{host}:{port}", registrations)
                    for rank, w in enumerate(self.workers)
                ],
                "startup",
            )
            self.worker_info = self._call("describe")
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", self._ray.put(scheduler_output))

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

    def _run_all(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return self._get([w.execute_method.remote(method, *args) for w in self.workers], method)

    def _get(self, refs: list[Any], method: str) -> list[Any]:
        """The results of one call on every rank, failing on the first rank that died or
        raised (the others may wait for it in a collective)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"tensor-parallel worker rank {rank} (Ray actor) died during {method}: {e}")
                except ray.exceptions.RayTaskError as e:
                    self._fail(f"tensor-parallel worker rank {rank} failed in {method}:\n{e}")
        return results


def _release(ray: Any, workers: list[Any], placement: Any, remove_placement_group: Any) -> None:
    if not ray.is_initialized():
        return
    for worker in workers:
        ray.kill(worker)
    remove_placement_group(placement)
