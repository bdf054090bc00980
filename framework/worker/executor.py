"""Executors carry scheduler outputs to the workers and bring results back: ``uni`` runs one
worker in the engine's process; ``mp`` (``multiproc_executor``) a process per tensor-parallel
rank; ``ray`` (``ray_executor``) a Ray actor per rank, on any node of a Ray cluster."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.worker.model_runner import ModelRunnerOutput
from tokenmill.worker.worker import Worker, WorkerInfo


class ExecutorDeadError(RuntimeError):
    """A worker died or failed a call: the ranks can no longer be trusted to agree, so the
    executor has stopped them all and cannot run another step."""


class Executor:
    """What the engine core asks of its workers. ``worker_info`` describes rank 0's model;
    every call goes to all ranks, and the results are rank 0's."""

    worker_info: WorkerInfo

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens come back. Raises
        ``ExecutorDeadError`` when a rank died or failed."""
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
