"""The one input processor: validates and tokenizes a prompt and prepares its sampling
parameters once, producing the ``EngineCoreRequest``s the engine core runs (vLLM's
``InputProcessor``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.config import EngineConfig
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.model_loader.loader import load_generation_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import validate_structured_outputs

PromptType = str | dict[str, Any]


@dataclass
class EngineCoreRequest:
    """One completion as the engine core receives it: plain fields only, so it crosses a
    process boundary as msgpack. ``n > 1`` requests arrive as n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's ``kv_transfer_params``: what the client sent for the request's KV connector."""


@dataclass
class ProcessedRequest:
    """A validated, tokenized request: what the front end keeps about it, and the
    engine-core requests of its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    core_requests: list[EngineCoreRequest]


class InputProcessor:
    """Turns prompts and ``SamplingParams`` into ``ProcessedRequest``s.

    ``max_model_len`` and ``max_prompt_tokens`` are the engine core's, which may have lowered
    the configured length to what its KV cache holds."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        max_prompt_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size: int = config.hf_config.vocab_size
        self.eos_token_id = eos_token_id(tokenizer, config.hf_config)
        self.generation_config = load_generation_config(config.model_path, config.hf_config)
        self.config = config
        self.adapters: dict[int, LoRARequest] = {}
        """The adapters checked so far, by ``lora_int_id``."""

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return the prompt text (if any) and its token ids, or raise ``ValueError`` (also for
        an invalid ``cache_salt``)."""
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
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        self.validate_prompt_ids(ids)
        return text, ids

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt is {len(ids)} tokens; at most {self.max_prompt_tokens} fit "
                f"(max_model_len={self.max_model_len}, one token is kept for the output)"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize ``prompt`` and prepare ``params`` (a copy, with the
        checkpoint's extra EOS ids); ``n > 1`` becomes n child requests. Raises
        ``ValueError``, also for an adapter the engine cannot load."""
        self.check_lora(lora_request)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer and this model has none; use stop_token_ids"
            )
        params.check_token_ids(self.vocab_size)
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer and this model has none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer and this model has none")
            validate_structured_outputs(params.structured_outputs)
        if params.kv_transfer_params is not None and self.config.kv_transfer is None:
            raise ValueError(
                "kv_transfer_params need a KV connector and this engine has none (start it "
                "with kv_transfer_config / --kv-transfer-config)"
            )
        text, ids = self.tokenize_prompt(prompt)
        params = params.clone()
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        params.update_from_tokenizer(self.tokenizer)
        cache_salt = prompt_cache_salt(prompt)
        arrival_time = arrival_time or time.monotonic()
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        children = [
            EngineCoreRequest(
                child_request_id(i, request_id),
                ids,
                child_params,
                self.eos_token_id,
                max_tokens,
                arrival_time,
                priority,
                cache_salt,
                lora_request,
                params.kv_transfer_params,
            )
            for i, child_params in enumerate(_child_params(params))
        ]
        return ProcessedRequest(request_id, text, ids, params, arrival_time, children)


    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse an adapter the engine cannot serve (``ValueError`` naming it): LoRA off, an
        id already naming another adapter, or a checkpoint ``load_adapter`` refuses. Each
        adapter's checkpoint is read once."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested but the engine runs with "
                f"enable_lora=False"
            )
        known = self.adapters.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r}: lora_int_id {lora_request.lora_int_id} "
                f"already names adapter {known.lora_name!r} ({known.lora_path})"
            )
        load_adapter(lora_request, self.config.hf_config, self.config.max_lora_rank)
        self.adapters[lora_request.lora_int_id] = lora_request

    def forget_lora(self, lora_int_id: int) -> None:
        """Let ``lora_int_id`` name another adapter from now on (an unloaded one)."""
        self.adapters.pop(lora_int_id, None)


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """The ``cache_salt`` of a prompt dict (None when absent): requests share prefix-cache
    blocks only when their salts are equal. Raises ``ValueError`` unless a non-empty str."""
    if not isinstance(prompt, dict):
        return None
    salt = prompt.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def child_request_id(index: int, request_id: str) -> str:
    """The engine-core id of completion ``index`` of request ``request_id``.

    Every request, ``n == 1`` included, is named so: as the index has no ``_``, distinct
    (index, request id) pairs never share an id, whatever ids callers choose."""
    return f"{index}_{request_id}"


def eos_token_id(tokenizer: PreTrainedTokenizerBase | None, hf_config: Any) -> int | None:
    """The model's EOS id: the tokenizer's, else the first of the HF config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        tokenizer_eos: int = tokenizer.eos_token_id
        return tokenizer_eos
    eos: int | list[int] | None = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos


def _child_params(params: SamplingParams) -> list[SamplingParams]:
    """One ``n == 1`` copy of ``params`` per completion (``SamplingParams.completion``);
    raises ``ValueError`` if any copy is invalid."""
    if params.n == 1:
        return [params]
    return [params.completion(i) for i in range(params.n)]
