"""``POST /v1/chat/completions``: the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.errors import OpenAIError, from_exception
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import MAX_LOGPROBS


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or for ``stream`` the server-sent events; raises ``OpenAIError``."""
        self.check_request(request)
        ids = self.tokenize(self._apply_chat_template(request), "messages")[1]
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        self.check_context(len(ids), max_tokens)
        params = self.sampling_params(request, max_tokens, self._num_logprobs(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(
            [(None, ids)], params, request_id, bool(request.stream), request.cache_salt
        )
        if request.stream:
            return self._stream(request, request_id, len(ids), streams[0])
        output = (await self.final_outputs(streams))[0]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=self._logprobs(request, c),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in output.outputs
            ],
            usage=UsageInfo.of(len(ids), num_generated, output.num_cached_tokens),
            prompt_logprobs=output.prompt_logprobs,
        )

    def _apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer, so it has no chat template")
        if not request.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        try:
            ids = tokenizer.apply_chat_template(
                [m.to_template_dict() for m in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as e:
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        return list(ids)

    @staticmethod
    def _num_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs needs logprobs to be true", param="top_logprobs")
            if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}",
                    param="top_logprobs",
                )
        return (request.top_logprobs or 0) if request.logprobs else None

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        num_prompt: int,
        stream: RequestStream,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )
            return f"data: {body.model_dump_json()}\n\n"

        num_generated = 0
        num_cached = 0
        try:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                    for i in range(request.n)
                ]
            )
            async for output in stream:
                num_cached = output.num_cached_tokens
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    if not (c.text or c.finish_reason or c.logprobs):
                        continue
                    yield chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                                logprobs=self._logprobs(request, c),
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ]
                    )
            if request.stream_options and request.stream_options.include_usage:
                yield chunk([], UsageInfo.of(num_prompt, num_generated, num_cached))
        except Exception as e:
            yield from_exception(e).to_sse()
        finally:
            self.abort_unfinished([stream])
        yield "data: [DONE]\n\n"

    def _logprobs(
        self, request: ChatCompletionRequest, c: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs or c.logprobs is None:
            return None
        num = request.top_logprobs or 0
        content = []
        for token_id, step in zip(c.token_ids, c.logprobs):
            top = sorted(step.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num]
            sampled = step[token_id].logprob if token_id in step else float("-inf")
            content.append(
                ChatCompletionTokenLogprob(
                    **self._top(token_id, sampled).model_dump(),
                    top_logprobs=[self._top(t, lp.logprob) for t, lp in top],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
