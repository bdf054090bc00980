"""``POST /v1/completions``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.errors import OpenAIError, from_exception
from tokenmill.entrypoints.openai.protocol import (
    MAX_PROMPTS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    merge_streams,
    top_count,
    usage_options,
)
from tokenmill.entrypoints.openai.structured_outputs import structured_outputs_of
from tokenmill.logprobs import Logprob, PromptLogprobs
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import ALL_LOGPROBS

Prompt = tuple[str | None, list[int]]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or for ``stream`` the server-sent events; raises ``OpenAIError``."""
        lora_request = self.check_request(request)
        prompts = [
            await self.tokenize(p, "prompt", request) for p in _split_prompts(request.prompt)
        ]
        if request.kv_transfer_params is not None and len(prompts) > 1:
            raise OpenAIError("kv_transfer_params need a single prompt", param="prompt")
        prompt_positions = output_positions = 0
        for _, ids in prompts:
            self.check_context(len(ids), request.max_tokens)
            prompt_positions += len(ids)
            max_tokens = request.max_tokens or self.engine.max_model_len - len(ids)
            output_positions += request.n * max_tokens + (len(ids) if request.echo else 0)
        self.check_all_logprobs("prompt_logprobs", request.prompt_logprobs, prompt_positions)
        self.check_all_logprobs("logprobs", request.logprobs, output_positions)
        params = self.sampling_params(
            request, request.max_tokens, request.logprobs, structured_outputs_of(request)
        )
        if request.echo and request.logprobs is not None:
            params.prompt_logprobs = (
                ALL_LOGPROBS
                if ALL_LOGPROBS in (request.logprobs, params.prompt_logprobs)
                else max(params.prompt_logprobs or 0, request.logprobs)
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(
            prompts,
            params,
            request_id,
            bool(request.stream),
            request.cache_salt,
            lora_request,
            request.priority,
        )
        if request.stream:
            return self._stream(request, request_id, prompts, streams)
        outputs = await self.final_outputs(streams)
        choices = []
        num_generated = 0
        for i, output in enumerate(outputs):
            for c in output.outputs:
                num_generated += len(c.token_ids)
                echo = output.prompt_logprobs if request.echo else None
                choice = self._choice(request, i, c, prompts[i], 0, request.echo, echo)
                if request.prompt_logprobs is not None:
                    choice.prompt_logprobs = output.prompt_logprobs
                if request.return_token_ids:
                    choice.prompt_token_ids = prompts[i][1]
                choices.append(choice)
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_cached = sum(output.num_cached_tokens for output in outputs)
        return CompletionResponse(
            id=request_id,
            model=self.response_model(request),
            choices=choices,
            usage=self.usage(num_prompt, num_generated, num_cached),
            kv_transfer_params=outputs[0].kv_transfer_params,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[CompletionResponseChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionStreamResponse(
                id=request_id, created=created, model=self.response_model(request), choices=choices, usage=usage
            )
            return f"data: {body.model_dump_json()}\n\n"

        offsets = {}
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_generated = 0
        num_cached: dict[int, int] = {}
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        include_usage, continuous_usage = usage_options(
            request, self.options.enable_force_include_usage
        )
        try:
            async for i, output in merge_streams(streams):
                num_cached[i] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    index = i * request.n + c.index
                    first = index not in offsets
                    ids_due = request.return_token_ids and (first or c.token_ids)
                    if not (
                        c.text or c.finish_reason or first and request.echo or c.logprobs or ids_due
                    ):
                        continue
                    echo = first and request.echo
                    choice = self._choice(
                        request,
                        i,
                        c,
                        prompts[i],
                        offsets.get(index, 0),
                        echo,
                        prompt_logprobs.get(i) if echo else None,
                    )
                    offsets[index] = offsets.get(index, 0) + len(choice.text)
                    if request.return_token_ids and first:
                        choice.prompt_token_ids = prompts[i][1]
                    usage = None
                    if continuous_usage:
                        usage = self.usage(num_prompt, num_generated, sum(num_cached.values()))
                    yield chunk([choice], usage)
            if include_usage:
                yield chunk([], self.usage(num_prompt, num_generated, sum(num_cached.values())))
        except Exception as e:
            yield from_exception(e).to_sse()
        finally:
            self.abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        c: CompletionOutput,
        prompt: Prompt,
        offset: int,
        echo: bool,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> CompletionResponseChoice:
        """One choice; with ``echo`` its text starts with the prompt, and its logprobs with
        the prompt tokens' (``prompt_logprobs``; the first token's are null)."""
        text = c.text
        if echo:
            text = self.prompt_text(prompt) + text
        logprobs = None
        if request.logprobs is not None and c.logprobs is not None:
            logprobs = CompletionLogProbs()
            as_id = self.as_token_ids(request)
            if echo:
                steps = prompt_logprobs or [None] * len(prompt[1])
                self._add_logprobs(logprobs, prompt[1], steps, offset, request.logprobs, as_id)
            output_offset = offset + len(text) - len(c.text)
            self._add_logprobs(
                logprobs, c.token_ids, c.logprobs, output_offset, request.logprobs, as_id
            )
        return CompletionResponseChoice(
            index=prompt_index * request.n + c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if request.return_token_ids else None,
        )

    def prompt_text(self, prompt: Prompt) -> str:
        text, ids = prompt
        if text is not None:
            return text
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def _add_logprobs(
        self,
        out: CompletionLogProbs,
        token_ids: list[int],
        steps: list[dict[int, Logprob] | None],
        offset: int,
        num: int,
        as_id: bool,
    ) -> None:
        """Append OpenAI's logprobs of ``token_ids``: each token, its logprob and the ``num``
        most likely tokens (-1: all; plus the token itself); null where its step is None.
        ``as_id``: tokens spelled ``token_id:<id>``."""
        for token_id, step in zip(token_ids, steps):
            token = self.token_text(token_id, as_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if step is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(step[token_id].logprob if token_id in step else None)
            top = sorted(step.items(), key=lambda kv: kv[1].logprob, reverse=True)
            top = top[: top_count(num)]
            if token_id not in dict(top) and token_id in step:
                top.append((token_id, step[token_id]))
            out.top_logprobs.append({self.token_text(t, as_id): lp.logprob for t, lp in top})


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One entry per prompt: a text or a token-id list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(
            f"prompt lists {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed per request",
            param="prompt",
        )
    return list(prompt)
