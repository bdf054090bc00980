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
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
from tokenmill.entrypoints.openai.server_options import ServerOptions
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, top_count, usage_options
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.structured_outputs import GUIDED_FIELDS, structured_outputs_of
from tokenmill.entrypoints.openai.tool_calls import (
    ToolCallStream,
    extract,
    finish_reason,
    tool_constraint,
    tool_mode,
)
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import ALL_LOGPROBS, MAX_LOGPROBS


class OpenAIServingChat(OpenAIServing):
    """``tool_parser``: the parser of ``tool_choice="auto"`` outputs; None refuses "auto"."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tool_parser: type[ToolParser] | None = None,
        options: ServerOptions | None = None,
        renderer: ChatRenderer | None = None,
    ) -> None:
        super().__init__(engine, models, options)
        self.tool_parser = tool_parser
        self.renderer = renderer or ChatRenderer.create(engine.tokenizer, self.options)

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
            if not _only_response_format(request):
                raise OpenAIError(
                    f"tool_choice={request.tool_choice!r} cannot be combined with structured "
                    "outputs",
                    param="tool_choice",
                )
            # The reply is tool calls only, which response_format (for content) does not
            # shape: the tools' schema constrains it, as in vLLM.
            requested = None
        ids = await self.engine.run_off_loop(self._apply_chat_template, request)
        ids = (await self.tokenize(ids, "messages", request))[1]
        max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        self.check_context(len(ids), max_tokens, max_tokens_param)
        self.check_all_logprobs("prompt_logprobs", request.prompt_logprobs, len(ids))
        if request.logprobs:
            positions = request.n * (max_tokens or self.engine.max_model_len - len(ids))
            self.check_all_logprobs("top_logprobs", request.top_logprobs, positions)
        params = self.sampling_params(
            request,
            max_tokens,
            self._num_logprobs(request),
            constraint or requested,
            max_tokens_param,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(
            [(None, ids)],
            params,
            request_id,
            bool(request.stream),
            request.cache_salt,
            lora_request,
            request.priority,
        )
        if request.stream:
            return self._stream(request, request_id, ids, streams[0], mode, parser)
        output = (await self.final_outputs(streams))[0]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        echo = _echo_text(request) if mode is None else ""
        choices = []
        for c in output.outputs:
            content, tool_calls = extract(request, mode, parser, c.text, c.finish_reason)
            if echo:
                content = echo + (content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                    logprobs=self._logprobs(request, c),
                    finish_reason=finish_reason(mode, bool(tool_calls), c.finish_reason),
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.response_model(request),
            choices=choices,
            usage=self.usage(len(ids), num_generated, output.num_cached_tokens),
            prompt_logprobs=output.prompt_logprobs,
            prompt_token_ids=ids if request.return_token_ids else None,
            kv_transfer_params=output.kv_transfer_params,
        )

    def _apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids under the chat template (slow for long chats: run it off
        the event loop)."""
        tools = request.tools if request.tool_choice != "none" else None
        text = self.renderer.render(
            request.messages,
            tools,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.documents,
            request.chat_template,
        )
        return self.engine.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    @staticmethod
    def _num_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs needs logprobs to be true", param="top_logprobs")
            top = request.top_logprobs
            if top != ALL_LOGPROBS and not 0 <= top <= MAX_LOGPROBS:
                raise OpenAIError(
                    f"top_logprobs must be -1 (the whole vocabulary) or in [0, {MAX_LOGPROBS}], "
                    f"got {request.top_logprobs}",
                    param="top_logprobs",
                )
        return (request.top_logprobs or 0) if request.logprobs else None

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_ids: list[int],
        stream: RequestStream,
        mode: str | None,
        parser: ToolParser | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        tool_streams = [ToolCallStream(request, mode, parser, i) for i in range(request.n)]

        num_prompt = len(prompt_ids)

        def chunk(
            choices: list[ChatCompletionStreamChoice],
            usage: UsageInfo | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.response_model(request),
                choices=choices,
                usage=usage,
                prompt_token_ids=prompt_token_ids,
            )
            return f"data: {body.model_dump_json()}\n\n"

        num_generated = 0
        num_cached = 0
        include_usage, continuous_usage = usage_options(
            request, self.options.enable_force_include_usage
        )
        echo = _echo_text(request) if mode is None else ""

        def usage_so_far() -> UsageInfo | None:
            return self.usage(num_prompt, num_generated, num_cached) if continuous_usage else None

        try:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content=echo)
                    )
                    for i in range(request.n)
                ],
                usage_so_far(),
                prompt_ids if request.return_token_ids else None,
            )
            async for output in stream:
                num_cached = output.num_cached_tokens
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    tool_stream = tool_streams[c.index]
                    delta = tool_stream.delta(c.text, c.finish_reason)
                    ids_due = request.return_token_ids and c.token_ids
                    if not (delta or c.finish_reason or c.logprobs or ids_due):
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
                                token_ids=list(c.token_ids) if request.return_token_ids else None,
                            )
                        ],
                        usage_so_far(),
                    )
            if include_usage:
                yield chunk([], self.usage(num_prompt, num_generated, num_cached))
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
        end = top_count(request.top_logprobs or 0)
        as_id = self.as_token_ids(request)
        content = []
        for token_id, step in zip(c.token_ids, c.logprobs):
            top = sorted(step.items(), key=lambda kv: kv[1].logprob, reverse=True)[:end]
            sampled = step[token_id].logprob if token_id in step else float("-inf")
            content.append(
                ChatCompletionTokenLogprob(
                    **self._top(token_id, sampled, as_id).model_dump(),
                    top_logprobs=[self._top(t, lp.logprob, as_id) for t, lp in top],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _top(self, token_id: int, logprob: float, as_id: bool) -> TopLogprob:
        token = self.token_text(token_id, as_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _echo_text(request: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the reply (vLLM's rule): the last message's content when it
    has the reply's role (assistant, or with ``add_generation_prompt`` off, its own)."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    if request.add_generation_prompt and last.role != "assistant":
        return ""
    return last.text()


def _only_response_format(request: ChatCompletionRequest) -> bool:
    """Whether ``response_format`` is the request's only structured-output field."""
    return request.structured_outputs is None and all(
        getattr(request, name) is None for name in GUIDED_FIELDS
    )
