"""A worker owns one device: it sets the process up for its platform (joining the
tensor-parallel group and its pipeline stage when there are several ranks), holds the model runner and answers the
executor's calls. The same class serves every executor: in the engine's process (``uni``), in
a process per rank (``mp``) and as a Ray actor (``ray``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.distributed.parallel_state import (
    dead_expert_parallel_ranks,
    destroy_distributed_environment,
    expert_rank_names,
    init_distributed_environment,
)
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput


@dataclass
class WorkerInfo:
    """What the engine core learns from rank 0 once the model is loaded: what runs (for its
    log line), how many lookahead slots the proposer needs and what its drafts cost
    (``Proposer.draft_cost``)."""

    model_cls: str
    attention: str
    """Which attention backend each kind of layer got, and why."""
    num_lookahead_tokens: int
    draft_cost: float


def determine_num_blocks(config: EngineConfig, specs: dict[str, KVCacheSpec]) -> int:
    """Blocks from ``num_kv_blocks``, else from the byte budget over all layers' page sizes."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory_bytes or config.platform_cls.get_kv_cache_budget(config)
    bytes_per_block = sum(spec.page_size_bytes for spec in specs.values())
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV-cache budget of {budget} bytes holds no block ({bytes_per_block} bytes each)"
        )
    return num_blocks


class Worker:
    """Rank ``rank`` of ``config.world_size`` (stage ``rank // tensor_parallel_size``, TP rank
    ``rank % tensor_parallel_size``); with more than one rank,
    ``distributed_init_method`` (``tcp://host:port``) is where the ranks meet. ``local_rank``
    is the device index on this node (default: after the devices of the workers of the
    data-parallel engine cores before this one on the node)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        platform = config.platform_cls
        platform.import_kernels()
        platform.set_num_threads(config)
        torch.manual_seed(config.seed)
        if local_rank is None:
            local_rank = config.data_parallel_rank_local * config.world_size + rank
        self.device = platform.device(local_rank)
        self.distributed = config.world_size > 1 or config.expert_parallel_across_data_parallel
        if self.distributed:
            assert distributed_init_method is not None
            across = config.expert_parallel_across_data_parallel
            init_distributed_environment(
                platform.dist_backend,
                distributed_init_method,
                rank,
                config.world_size,
                config.pipeline_parallel_size,
                platform.get_device_communicator_cls(),
                self.device,
                config.all2all_backend,
                config.data_parallel_size if across else 1,
                config.data_parallel_rank if across else 0,
            )
        self.model_runner = ModelRunner(config, self.device, rank)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def describe(self) -> WorkerInfo:
        runner = self.model_runner
        model_cls = type(runner.model)
        return WorkerInfo(
            f"{model_cls.__module__}.{model_cls.__qualname__}",
            runner.attn_selector.describe(),
            runner.proposer.num_lookahead_tokens if runner.proposer else 0,
            runner.proposer.draft_cost if runner.proposer else 0.0,
        )

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs()

    def determine_num_blocks(self) -> int:
        """How many KV-cache blocks this rank's budget holds."""
        return determine_num_blocks(self.config, self.get_kv_cache_specs())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.config.platform_cls.before_step()
        with _blame_dead_expert_ranks():
            return self.model_runner.execute_model(scheduler_output)

    def execute_dummy_batch(self) -> None:
        """Meet the other engine cores' MoE collectives in a step without tokens
        (``ModelRunner.execute_dummy_batch``)."""
        with _blame_dead_expert_ranks():
            self.model_runner.execute_dummy_batch()

    def dead_expert_parallel_ranks(self) -> list[tuple[int, int]]:
        """``parallel_state.dead_expert_parallel_ranks``, asked by this rank's engine core."""
        return dead_expert_parallel_ranks()

    def step_intervals(self) -> list[tuple[float, float]]:
        """When this rank was busy with its latest steps (``ModelRunner.step_intervals``)."""
        return list(self.model_runner.step_intervals)

    def shutdown(self) -> None:
        """Leave the process group (all ranks call it together)."""
        if self.distributed:
            destroy_distributed_environment()


@contextmanager
def _blame_dead_expert_ranks() -> Iterator[None]:
    """A collective that fails because an expert-parallel rank of another engine core died
    raises naming that rank (this rank only sees its connection close)."""
    try:
        yield
    except Exception as e:
        dead = dead_expert_parallel_ranks()
        if not dead:
            raise
        raise RuntimeError(f"{expert_rank_names(dead)} died: {type(e).__name__}: {e}") from e
