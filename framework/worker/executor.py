"""Executors carry scheduler outputs to the workers and bring results back: ``uni`` runs one
worker in the engine's process; ``mp`` (``multiproc_executor``) a process per tensor-parallel
rank; ``ray`` (``ray_executor``) a Ray actor per rank, on any node of a Ray cluster."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from tokenmill import envs
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

    def execute_dummy_batch(self) -> None:
        """Run a step without tokens on every rank, meeting the other data-parallel engine
        cores' MoE collectives (experts spanning the cores only)."""
        raise NotImplementedError

    def dead_expert_parallel_ranks(self) -> list[tuple[int, int]]:
        """``(expert-parallel rank, pid)`` of the ranks of any engine core whose process has
        exited (experts spanning the cores only): what a core blames a broken step agreement
        on."""
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
    """An executor whose ranks live elsewhere (processes, Ray actors), laid out as vLLM's
    (``rank = stage * tensor_parallel_size + tp_rank``). Every call goes to all ranks
    (``_send``) and their answers come back in call order (``_gather``); a step sent with
    ``non_block`` returns a future at once, so under pipeline parallelism the engine core can
    send the next step while the stages still work on this one (the batch queue). The first
    rank that dies or fails marks the executor dead (``_fail``), and every later call raises
    ``ExecutorDeadError`` with that reason."""

    _dead: str | None = None
    _finalizer: Callable[[], Any]
    """Kills every rank and releases what the executor holds; runs at most once, also when
    the executor is garbage-collected (a ``weakref.finalize``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.world_size
        self.tp_size = config.tensor_parallel_size
        self.output_rank = output_rank(config)
        self.data_parallel_rank = (
            config.data_parallel_rank if config.expert_parallel_across_data_parallel else None
        )
        """This core's data-parallel rank when its ranks belong to an expert-parallel group
        spanning the cores (errors then name their expert-parallel rank)."""
        self._pending: deque[tuple[str, Any, Future[ModelRunnerOutput]]] = deque()
        """Steps sent whose answers are not gathered yet, oldest first: method, the
        ``_send`` handle, the future."""
        self._max_concurrent_batches = (
            config.pipeline_parallel_size if envs.TOKENMILL_PP_BATCH_QUEUE else 1
        )

    def _send(self, method: str, args: tuple[Any, ...]) -> Any:
        """Start ``method`` on every rank; a handle ``_gather`` takes back."""
        raise NotImplementedError

    def _gather(self, method: str, handle: Any) -> list[Any]:
        """Every rank's answer to the call ``handle`` names (the oldest not gathered yet),
        rank 0 first; ``_fail`` on the first rank that died or raised."""
        raise NotImplementedError

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        handle = self._send("execute_model", (scheduler_output,))
        future = _StepFuture(self)
        self._pending.append(("execute_model", handle, future))
        return future if non_block else future.result()

    def execute_dummy_batch(self) -> None:
        self._call_all("execute_dummy_batch")

    def dead_expert_parallel_ranks(self) -> list[tuple[int, int]]:
        return self._call("dead_expert_parallel_ranks")

    @property
    def max_concurrent_batches(self) -> int:
        return self._max_concurrent_batches

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self._call("get_kv_cache_specs")

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def step_intervals(self) -> list[list[tuple[float, float]]]:
        return self._call_all("step_intervals")

    def rank_name(self, rank: int) -> str:
        """How errors name worker ``rank``: its stage too under pipeline parallelism, its
        expert-parallel rank and engine core when the experts span the cores."""
        if self.data_parallel_rank is not None:
            return (
                f"expert-parallel rank {self.data_parallel_rank * self.world_size + rank} "
                f"(data-parallel rank {self.data_parallel_rank}, tensor-parallel worker rank {rank})"
            )
        if self.world_size == self.tp_size:
            return f"tensor-parallel worker rank {rank}"
        stage, tp_rank = divmod(rank, self.tp_size)
        return f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"

    def _call(self, method: str, *args: Any) -> Any:
        return self._call_all(method, *args)[0]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` on every rank once the steps in flight are answered; the results,
        rank 0 first."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        while self._pending:
            self._gather_pending()
        return self._gather(method, self._send(method, args))

    def _gather_pending(self) -> None:
        """Gather the oldest step in flight; if it fails, so do all the others."""
        method, handle, future = self._pending[0]
        try:
            results = self._gather(method, handle)
        except BaseException as e:
            for _, _, f in self._pending:
                f.set_exception(e)
            self._pending.clear()
            raise
        self._pending.popleft()
        future.set_result(results[self.output_rank])

    def _fail(self, reason: str) -> None:
        logger.error("%s; stopping every worker", reason)
        self._dead = reason
        self._finalizer()
        raise ExecutorDeadError(reason)


class _StepFuture(Future):
    """A step's result: waiting for it gathers the answers of the steps sent before it too."""

    def __init__(self, executor: DistributedExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        while not self.done():
            self._executor._gather_pending()
        return super().result(timeout)


def output_rank(config: EngineConfig) -> int:
    """The rank whose ``execute_model`` answer carries the step's tokens: the first rank of
    the last pipeline stage."""
    return config.tensor_parallel_size * (config.pipeline_parallel_size - 1)
