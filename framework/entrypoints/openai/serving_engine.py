"""What the completions and chat endpoints share: model names, request checks, sampling
parameters, and running prompts as engine requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.async_llm import AsyncLLM, RequestStream
from tokenmill.engine.output_processor import RequestOutputKind
from tokenmill.entrypoints.openai.errors import OpenAIError, from_exception
from tokenmill.entrypoints.openai.protocol import SamplingFields, UsageInfo
from tokenmill.entrypoints.openai.server_options import ServerOptions
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import ALL_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_ALL_LOGPROB_ENTRIES = 2**18
"""Most logprob entries (positions times vocabulary) a request asking for the whole
vocabulary (``-1``) may get: each entry costs the front end Python objects and 40-80 bytes
of JSON (two positions of a 49,152-token vocabulary took seconds on a loaded CPU), so this
bounds one such response near 20 MB: 5 positions of that vocabulary."""

SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
)
"""Request fields passed to ``SamplingParams`` under the same name, when set."""

PARAM_NAMES = SAMPLING_FIELDS + (
    "max_tokens",
    "logprobs",
    "prompt",
    "messages",
    "cache_salt",
    "structured_outputs",
    "kv_transfer_params",
)


class OpenAIServing:
    """Base of the endpoint handlers: one engine, served under the base model's names and
    the names of its LoRA adapters (``models``)."""

    def __init__(self, engine: AsyncLLM, models: ServedModels, options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.models = models
        self.options = options or ServerOptions()
        self._token_texts: dict[int, str] = {}

    def check_request(self, request: SamplingFields) -> LoRARequest | None:
        """The adapter the request's ``model`` names (None: the base model); 404 for a model
        name not served; 400 for fields this engine cannot honour."""
        lora_request = self.models.resolve(request.model)
        unsupported = request.unsupported()
        if unsupported:
            name, value = next(iter(unsupported.items()))
            raise OpenAIError(f"{name}={value!r} is not supported by this server", param=name)
        if request.priority != 0 and self.engine.config.scheduling_policy != "priority":
            raise OpenAIError(
                "priority needs the server's --scheduling-policy priority", param="priority"
            )
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )
        return lora_request

    def response_model(self, request: SamplingFields) -> str:
        """The ``model`` a response names: the adapter the request asked for, else the base
        model's first name."""
        return request.model if request.model in self.models.adapters else self.models.model_name

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """A response's usage; ``prompt_tokens_details.cached_tokens`` (prompt tokens served
        from the prefix cache) only under ``--enable-prompt-tokens-details``, as in vLLM."""
        details = self.options.enable_prompt_tokens_details
        return UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens if details else None)

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        """``SamplingParams`` from the request; an invalid value is a 400 naming the field
        (``max_tokens`` is reported as ``max_tokens_param``, the field that gave it)."""
        kwargs: dict[str, Any] = {
            name: getattr(request, name)
            for name in SAMPLING_FIELDS
            if getattr(request, name) is not None
        }
        if request.kv_transfer_params is not None:
            kwargs["extra_args"] = {"kv_transfer_params": self.kv_transfer_params(request)}
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=logprobs,
                structured_outputs=structured_outputs,
                **kwargs,
            )
        except ValueError as e:
            message = str(e)
            if message.startswith("max_tokens "):
                message = max_tokens_param + message.removeprefix("max_tokens")
            raise from_exception(ValueError(message), PARAM_NAMES + (max_tokens_param,)) from None

    def kv_transfer_params(self, request: SamplingFields) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` as its connector gets them; a 400 without a
        connector or with more than one completion."""
        if self.engine.config.kv_transfer is None:
            raise OpenAIError(
                "kv_transfer_params need a KV connector and this server has none (start it "
                "with --kv-transfer-config)",
                param="kv_transfer_params",
            )
        if request.n != 1:
            raise OpenAIError("kv_transfer_params need n=1", param="n")
        assert request.kv_transfer_params is not None
        return request.kv_transfer_params.model_dump()

    async def tokenize(
        self, prompt: str | list[int], param: str, request: SamplingFields
    ) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt, cut to ``truncate_prompt_tokens`` and checked
        against the vocabulary and context (off the event loop). A cut prompt has no text."""
        text = prompt if isinstance(prompt, str) else None
        try:
            if request.truncate_prompt_tokens is None and request.add_special_tokens:
                engine_prompt = text if text is not None else {"prompt_token_ids": prompt}
                return await self.engine.run_off_loop(self.engine.tokenize_prompt, engine_prompt)
            ids = (
                prompt
                if text is None
                else await self.engine.run_off_loop(self._encode, text, request.add_special_tokens)
            )
            cut = self.truncate(ids, request)
            if len(cut) < len(ids):
                text = None
            engine_prompt = {"prompt": text, "prompt_token_ids": cut}
            return await self.engine.run_off_loop(self.engine.tokenize_prompt, engine_prompt)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; send token ids")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(self, ids: list[int], request: SamplingFields) -> list[int]:
        """The prompt cut to ``truncate_prompt_tokens`` (vLLM's: -1 is ``max_model_len``) on
        ``truncation_side``."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return ids
        limit = self.engine.max_model_len
        if keep == -1:
            keep = limit
        if keep > limit:
            raise OpenAIError(
                f"truncate_prompt_tokens ({keep}) must be <= max_model_len ({limit})",
                param="truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if request.truncation_side == "left" else ids[:keep]

    def check_all_logprobs(self, param: str, value: int | None, positions: int) -> None:
        """A 400 when ``value`` asks for the whole vocabulary at more positions than
        ``MAX_ALL_LOGPROB_ENTRIES`` allows."""
        if value != ALL_LOGPROBS:
            return
        vocab = self.engine.vocab_size
        if positions * vocab > MAX_ALL_LOGPROB_ENTRIES:
            raise OpenAIError(
                f"{param}=-1 asks for the whole vocabulary ({vocab} tokens) at {positions} "
                f"positions; at most {MAX_ALL_LOGPROB_ENTRIES} entries (positions x vocabulary) "
                "are returned per request",
                param=param,
            )

    def as_token_ids(self, request: SamplingFields) -> bool:
        """Whether logprob tokens are spelled ``token_id:<id>`` (the request's choice, else
        the server's ``--return-tokens-as-token-ids``)."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    def check_context(
        self, num_prompt_tokens: int, max_tokens: int | None, param: str = "max_tokens"
    ) -> None:
        """OpenAI's 400 when prompt and completion together exceed the context; ``param``:
        the field that gave ``max_tokens``."""
        limit = self.engine.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.",
                param=param,
            )

    async def start(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        request_id: str,
        stream: bool,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; if one is refused, abort the others."""
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                prompt = {"prompt": text, "prompt_token_ids": ids, "cache_salt": cache_salt}
                streams.append(
                    await self.engine.add_request(
                        prompt, params, f"{request_id}-{i}", kind, lora_request, priority
                    )
                )
        except Exception as e:
            self.abort_unfinished(streams)
            raise from_exception(e, PARAM_NAMES) from None
        return streams

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The finished output of each stream; aborts them all if the caller goes away."""
        try:
            return list(await asyncio.gather(*(_last(s) for s in streams)))
        finally:
            self.abort_unfinished(streams)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """The text of one token, as logprobs report it (``as_id``: ``token_id:<id>``)."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer else f"token_id:{token_id}"
            self._token_texts[token_id] = text
        return text


def usage_options(request: SamplingFields, force: bool = False) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk (``include_usage``, or ``force``: the
    server's ``--enable-force-include-usage``), and whether every chunk also carries the
    usage so far (``continuous_usage_stats``, which, as in vLLM, needs ``include_usage``)."""
    options = request.stream_options
    include = bool(options and options.include_usage) or force
    return include, include and bool(options and options.continuous_usage_stats)


def top_count(num: int) -> int | None:
    """How many of a position's logprobs to report, as a slice end (None: all of them)."""
    return None if num == ALL_LOGPROBS else num


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _last(stream: RequestStream) -> RequestOutput:
    return [output async for output in stream][-1]
