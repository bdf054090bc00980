"""A worker owns one device: it sets the process up for its platform, holds the model runner
and answers the executor's calls."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        platform = config.platform_cls
        platform.import_kernels()
        platform.set_num_threads(config)
        torch.manual_seed(config.seed)
        self.device = platform.device(rank)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
