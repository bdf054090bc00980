"""The synchronous engine: validates and tokenizes requests, steps the engine core and turns
its outputs into ``RequestOutput``s."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_client import InprocClient
from tokenmill.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    PromptType,
)
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputKind
from tokenmill.lora.request import LoRARequest
from tokenmill.model_loader.tokenizer import load_tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size}: data parallelism runs engine "
                f"cores behind AsyncLLM or 'tokenmill serve'; the offline LLM runs one"
            )
        if config.data_parallel_backend == "ray":
            raise ValueError(
                "data_parallel_backend='ray' runs engine cores as Ray actors behind AsyncLLM "
                "or 'tokenmill serve'; the offline LLM runs its core in this process"
            )
        self.config = resolve_config(config)
        tokenizer_path = config.tokenizer or config.model_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        if self.tokenizer is None:
            logger.warning(
                "no tokenizer files in %s: prompts must be token ids "
                "({'prompt_token_ids': [...]}) and outputs carry token ids with empty text",
                tokenizer_path,
            )
        self.engine_core = InprocClient(config)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.engine_core.max_model_len, self.engine_core.max_prompt_tokens
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = self.input_processor.vocab_size
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return the prompt text (if any) and its token ids, or raise ``ValueError`` (also for
        an invalid ``cache_salt``)."""
        return self.input_processor.tokenize_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue a request; ``n > 1`` runs as n child requests. A
        ``ValueError`` leaves nothing registered.

        ``output_kind`` chooses what ``step()`` reports for it: everything so far, only what
        is new (for streaming), or one output at the end."""
        processed = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        self.add_processed_request(processed, output_kind)

    def add_processed_request(
        self, request: ProcessedRequest, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> None:
        """Queue a request that ``input_processor.process`` already prepared."""
        if request.request_id in self.output_processor.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.output_processor.add_request(request, output_kind)
        for child in request.core_requests:
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests at any point; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = [c for r in request_ids for c in self.output_processor.unfinished_children(r)]
        self.engine_core.abort_requests(children)
        return self.output_processor.abort(children)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that got new tokens or finished."""
        core_outputs = self.engine_core.get_output()
        self.output_processor.mark_scheduled(core_outputs.scheduled_req_ids, core_outputs.timestamp)
        processed = self.output_processor.process(core_outputs.outputs)
        for child_id, stop_str in processed.stopped_by_string:
            self.engine_core.finish_requests([child_id], RequestStatus.FINISHED_STOPPED, stop_str)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def get_stats(self) -> dict[str, int]:
        out = self.output_processor
        return {
            "num_requests_finished": out.num_requests_finished,
            "num_generated_tokens": out.num_generated_tokens,
            "num_prompt_tokens": out.num_prompt_tokens,
            **self.engine_core.get_stats(),
        }
