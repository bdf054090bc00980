"""``RayEngineCore``: an engine core run as a Ray actor (``data_parallel_backend="ray"``, vLLM's
``--data-parallel-backend ray``), so the data-parallel cores of one front end are placed on any
node of a Ray cluster.

Each core gets a placement group of one bundle for it and its workers: ``world_size`` CPUs, or
GPUs on a GPU platform, on one node; its executor runs the workers there as processes
(``mp``, or ``uni`` for one rank). The actor runs the same ``run_engine_core`` busy loop as an
engine-core process, connected to the front end's ZMQ sockets over TCP. It dies with the
process that created it (Ray's ownership), and ``MPClient`` watches it through
``is_alive`` as it watches a process.
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.worker.ray_executor import PLACEMENT_TIMEOUT_S, init_ray


class EngineCoreActor:
    """The actor's class: its process id, then the busy loop until shutdown."""

    def pid(self) -> int:
        return os.getpid()

    def run(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        registrations: list[tuple[str, str, str]],
    ) -> None:
        run_engine_core(config, input_address, output_address, None, registrations)


class RayEngineCore:
    """What ``MPClient`` needs of its engine core (as of a ``multiprocessing.Process``):
    ``start``, ``is_alive``, ``join``, ``kill``, ``pid``, ``name``, ``exitcode``."""

    exitcode: int | None = None

    def __init__(self, config: EngineConfig, args: tuple[Any, ...]) -> None:
        self._config = config
        self._args = args
        self._ray = init_ray("data_parallel_backend='ray'")
        self.name = f"Ray actor of data-parallel rank {config.data_parallel_rank}"
        self.pid: int | None = None
        self._actor: Any = None
        self._placement: Any = None
        self._run: Any = None

    @staticmethod
    def node_address() -> str:
        """This node's address, where the front end's sockets listen for the actors."""
        return str(init_ray("data_parallel_backend='ray'").util.get_node_ip_address())

    def start(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, config = self._ray, self._config
        gpu = config.platform_cls.device_type != "cpu"
        size = float(config.world_size)
        bundle = {"GPU": size} if gpu else {"CPU": size}
        self._placement = placement_group([bundle])
        ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"the Ray cluster found no node with room for {self.name} and its workers "
                f"({bundle}) in {PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.available_resources()}"
            )
        actor_cls = ray.remote(
            num_cpus=0 if gpu else size, num_gpus=size if gpu else 0
        )(EngineCoreActor)
        strategy = PlacementGroupSchedulingStrategy(self._placement)
        self._actor = actor_cls.options(scheduling_strategy=strategy).remote()
        self.pid = ray.get(self._actor.pid.remote())
        self._run = self._actor.run.remote(*self._args)

    def is_alive(self) -> bool:
        if self._run is None:
            return False
        done, _ = self._ray.wait([self._run], timeout=0)
        return not done

    def join(self, timeout: float | None = None) -> None:
        """Wait for the busy loop to end; once it has, free the actor and its placement."""
        if self._run is not None:
            self._ray.wait([self._run], timeout=timeout)
            if self.is_alive():
                return
        if self._actor is not None:
            self._ray.kill(self._actor)
            self._actor = None
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
            self._placement = None

    def kill(self) -> None:
        if self._actor is not None:
            self._ray.kill(self._actor)
