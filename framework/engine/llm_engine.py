"""The synchronous engine: validates and tokenizes requests, steps the engine core and turns
its outputs into ``RequestOutput``s."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputKind
from tokenmill.model_loader.loader import load_generation_config
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

PromptType = str | dict[str, Any]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.finalize()
        tokenizer_path = config.tokenizer or config.model_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        if self.tokenizer is None:
            logger.warning(
                "no tokenizer files in %s: prompts must be token ids "
                "({'prompt_token_ids': [...]}) and outputs carry token ids with empty text",
                tokenizer_path,
            )
        self.engine_core = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.block_hasher = make_block_hasher(config.block_size, config.prefix_caching_hash_algo)
        self.eos_token_id = _eos_token_id(self.tokenizer, config.hf_config)
        self.generation_config = load_generation_config(config.model_path, config.hf_config)
        self.vocab_size = config.hf_config.vocab_size
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize_prompt(
        self, prompt: PromptType, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> tuple[str | None, list[int]]:
        """Return the prompt text (if any) and its token ids, or raise ``ValueError`` (also for
        an invalid ``cache_salt``).

        ``tokenizer``: an instance to use instead of the engine's own, for callers on
        another thread than the one stepping the engine."""
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, dict):
            prompt_cache_salt(prompt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                text, ids = prompt.get("prompt"), list(ids)
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"], tokenizer)
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            text, ids = prompt, tokenizer.encode(prompt)
        else:
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        self.validate_prompt_ids(ids)
        return text, ids

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.engine_core.max_prompt_tokens()
        if len(ids) > limit:
            raise ValueError(
                f"prompt is {len(ids)} tokens; at most {limit} fit "
                f"(max_model_len={self.config.max_model_len}, one token is kept for the output)"
            )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Validate, tokenize and queue a request; ``n > 1`` runs as n child requests. A
        ``ValueError`` leaves nothing registered.

        ``output_kind`` chooses what ``step()`` reports for it: everything so far, only what
        is new (for streaming), or one output at the end."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer and this model has none; use stop_token_ids"
            )
        text, ids = self.tokenize_prompt(prompt)
        params = params.clone()
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        cache_salt = prompt_cache_salt(prompt)
        arrival_time = arrival_time or time.monotonic()
        max_tokens = params.max_tokens or self.config.max_model_len - len(ids)
        children = [
            Request(
                child_request_id(i, request_id),
                ids,
                child_params,
                self.eos_token_id,
                max_tokens,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                block_hasher=self.block_hasher,
            )
            for i, child_params in enumerate(_child_params(params))
        ]
        self.output_processor.add_request(
            request_id, text, ids, params, [c.request_id for c in children], arrival_time, output_kind
        )
        for child in children:
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
        start = time.monotonic()
        core_outputs = self.engine_core.step()
        self.output_processor.mark_scheduled(
            [r.request_id for r in self.engine_core.scheduler.running]
            + [o.req_id for o in core_outputs],
            start,
        )
        processed = self.output_processor.process(core_outputs)
        for child_id, stop_str in processed.stopped_by_string:
            self.engine_core.scheduler.finish_requests(
                [child_id], RequestStatus.FINISHED_STOPPED, stop_str
            )
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

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


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """The ``cache_salt`` of a prompt dict (None when absent): requests share prefix-cache
    blocks only when their salts are equal. Raises ``ValueError`` unless a non-empty str."""
    if not isinstance(prompt, dict):
        return None
    salt = prompt.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def load_tokenizer(path: str):
    """The HF fast tokenizer in ``path``, or None when the directory has none."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    return AutoTokenizer.from_pretrained(path)


def child_request_id(index: int, request_id: str) -> str:
    """The engine-core id of completion ``index`` of request ``request_id``.

    Every request, ``n == 1`` included, is named so: as the index has no ``_``, distinct
    (index, request id) pairs never share an id, whatever ids callers choose."""
    return f"{index}_{request_id}"


def _child_params(params: SamplingParams) -> list[SamplingParams]:
    """One ``n == 1`` copy of ``params`` per completion, completion i seeded ``seed + i``;
    raises ``ValueError`` if any copy is invalid."""
    if params.n == 1:
        return [params]
    return [
        replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos
