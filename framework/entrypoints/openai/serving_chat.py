"""``POST /v1/chat/completions``: the tokenizer's chat template, then one engine request;
tool calls as ``tool_calls`` (see ``tool_calls``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from tokenmill.engine.async_llm import AsyncLLM, RequestStream
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
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, usage_options
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.structured_outputs import structured_outputs_of
from tokenmill.entrypoints.openai.tool_calls import (
    ToolCallStream,
    extract,
    finish_reason,
    tool_constraint,
    tool_mode,
)
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import MAX_LOGPROBS


class OpenAIServingChat(OpenAIServing):
    """``tool_parser``: the parser of ``tool_choice="auto"`` outputs; None refuses "auto"."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tool_parser: type[ToolParser] | None = None,
    ) -> None:
        super().__init__(engine, models)
        self.tool_parser = tool_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or for ``stream`` the server-sent events; raises ``OpenAIError``."""
        lora_request = self.check_request(request)
        mode = tool_mode(request, self.tool_parser)
        parser = None
        if mode == "auto":
            assert self.tool_parser is not None
            parser = self.tool_parser(self.engine.tokenizer)
            request = parser.adjust_request(request)
        constraint = tool_constraint(request, mode)
        requested = structured_outputs_of(request)
        if constraint is not None and requested is not None:
            raise OpenAIError(
                f"tool_choice={request.tool_choice!r} cannot be combined with structured outputs",
                param="tool_choice",
            )
        ids = await self.engine.run_off_loop(self._apply_chat_template, request)
        ids = (await self.tokenize(ids, "messages"))[1]
        max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        self.check_context(len(ids), max_tokens, max_tokens_param)
        params = self.sampling_params(
            request,
            max_tokens,
            self._num_logprobs(request),
            constraint or requested,
            max_tokens_param,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(
            [(None, ids)], params, request_id, bool(request.stream), request.cache_salt, lora_request
        )
        if request.stream:
            return self._stream(request, request_id, len(ids), streams[0], mode, parser)
        output = (await self.final_outputs(streams))[0]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        choices = []
        for c in output.outputs:
            content, tool_calls = extract(request, mode, parser, c.text)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                    logprobs=self._logprobs(request, c),
                    finish_reason=finish_reason(mode, bool(tool_calls), c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.response_model(request),
            choices=choices,
            usage=UsageInfo.of(len(ids), num_generated, output.num_cached_tokens),
            prompt_logprobs=output.prompt_logprobs,
        )

    def _apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids under the chat template (slow for long chats: run it off
        the event loop)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer, so it has no chat template")
        if not request.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
        try:
            ids = tokenizer.apply_chat_template(
                [m.to_template_dict() for m in request.messages],
                tools=tools,
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
        mode: str | None,
        parser: ToolParser | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        tool_streams = [ToolCallStream(request, mode, parser, i) for i in range(request.n)]

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.response_model(request), choices=choices, usage=usage
            )
            return f"data: {body.model_dump_json()}\n\n"

        num_generated = 0
        num_cached = 0
        include_usage, continuous_usage = usage_options(request)

        def usage_so_far() -> UsageInfo | None:
            return UsageInfo.of(num_prompt, num_generated, num_cached) if continuous_usage else None

        try:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                    for i in range(request.n)
                ],
                usage_so_far(),
            )
            async for output in stream:
                num_cached = output.num_cached_tokens
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    tool_stream = tool_streams[c.index]
                    delta = tool_stream.delta(c.text)
                    if not (delta or c.finish_reason or c.logprobs):
                        continue
                    yield chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=delta or DeltaMessage(),
                                logprobs=self._logprobs(request, c),
                                finish_reason=finish_reason(
                                    mode, tool_stream.num_calls > 0, c.finish_reason
                                ),
                                stop_reason=c.stop_reason,
                            )
                        ],
                        usage_so_far(),
                    )
            if include_usage:
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
