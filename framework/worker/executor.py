"""Executors carry scheduler outputs to the workers and bring results back: ``uni`` runs one
worker in the engine's process; ``mp`` (``multiproc_executor``) a process per tensor-parallel
rank; ``ray`` (``ray_executor``) a Ray actor per rank, on any node of a Ray cluster."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.worker.model_runner import ModelRunnerOutput
from tokenmill.worker.worker import Worker, WorkerInfo

logger = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """A worker died or failed a call: the ranks can no longer be trusted to agree, so the
    executor has stopped them all and cannot run another step."""


class Executor:
    """What the engine core asks of its workers. ``worker_info`` describes the model of the
    rank that samples (rank 0, the last stage's first under pipeline parallelism); every call
    goes to all ranks, and the results are rank 0's (the sampling rank's for a step)."""

    worker_info: WorkerInfo

    def __init__(self, config: EngineConfig) -> None:
        raise NotImplementedError

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor of ``config.executor_backend``."""
        backend = config.executor_backend
        if backend == "mp":
            from tokenmill.worker.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from tokenmill.worker.ray_executor import RayExecutor

            return RayExecutor
        return UniProcExecutor

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Rank 0's layers' KV-cache specs (every rank's pages are the same size)."""
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        """The KV-cache blocks every rank can hold: the smallest rank's count."""
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank; the sampled tokens come back (with ``non_block``, a
        future of them, returned at once). Raises ``ExecutorDeadError`` when a rank died or
        failed."""
        raise NotImplementedError

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine core may keep in flight (``non_block``): the pipeline
        stages under pipeline parallelism, else 1."""
        return 1

    def step_intervals(self) -> list[list[tuple[float, float]]]:
        """Per rank, rank 0 first: when it was busy with its latest steps (monotonic clock,
        comparable between the processes of one machine)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the workers; the executor is unusable afterwards."""


class UniProcExecutor(Executor):
    """One worker in the engine's own process (``tensor_parallel_size == 1``). A failing
    step raises its own exception: the worker stays usable."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()
        self.worker_info = self.worker.describe()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.worker.get_kv_cache_specs()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def step_intervals(self) -> list[list[tuple[float, float]]]:
        return [self.worker.step_intervals()]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.execute_model(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future


class DistributedExecutor(Executor):
    """An executor whose ranks live elsewhere (processes, Ray actors): every call runs on all
    ranks through ``_run_all``; the first rank that dies or fails marks the executor dead
    (``_fail``), and every later call raises ``ExecutorDeadError`` with that reason."""

    _dead: str | None = None
    _finalizer: Callable[[], Any]
    """Kills every rank and releases what the executor holds; runs at most once, also when
    the executor is garbage-collected (a ``weakref.finalize``)."""

    def _run_all(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Run ``method`` on every rank; their results, rank 0 first."""
        raise NotImplementedError

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self._call("get_kv_cache_specs")

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def step_intervals(self) -> list[list[tuple[float, float]]]:
        return self._call_all("step_intervals")

    def _call(self, method: str, *args: Any) -> Any:
        return self._call_all(method, *args)[0]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        return self._run_all(method, args)

    def _fail(self, reason: str) -> None:
        logger.error("%s; stopping every worker", reason)
        self._dead = reason
        self._finalizer()
        raise ExecutorDeadError(reason)
