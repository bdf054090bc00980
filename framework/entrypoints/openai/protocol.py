"""Request and response bodies of the OpenAI API, plus vLLM's sampling extensions.

Requests are strict about types. A top-level field neither OpenAI nor vLLM knows is ignored
with a logged warning, as vLLM does. Fields OpenAI or vLLM accept but this engine cannot
honour are accepted only at values that change nothing (see ``unsupported``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from tokenmill.logprobs import PromptLogprobs

logger = logging.getLogger(__name__)

TokenIds = list[int]

VLLM_UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True,
    "priority": 0,
    "return_tokens_as_token_ids": None,
    "return_token_ids": None,
    "logits_processors": None,
    "structured_outputs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "echo": False,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "documents": None,
    "mm_processor_kwargs": None,
}
"""vLLM request fields this engine does not implement, with the values that change nothing
(any other value is refused). Endpoint fields of the same name take precedence."""


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class SamplingFields(OpenAIModel):
    """Sampling fields shared by both endpoints (vLLM's extensions included), and
    ``cache_salt``: only requests with equal salts share prefix-cache blocks."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    user: str | None = None
    cache_salt: str | None = None

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_ignored(self) -> SamplingFields:
        ignored = sorted(set(self.model_extra or {}) - set(VLLM_UNIMPLEMENTED_DEFAULTS))
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return self

    def unsupported(self) -> dict[str, Any]:
        """Fields set to values this engine cannot honour: {field: value}."""
        extra = self.model_extra or {}
        return {
            name: extra[name]
            for name, default in VLLM_UNIMPLEMENTED_DEFAULTS.items()
            if name in extra and extra[name] != default
        }


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> dict[str, Any]:
        out = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            out["best_of"] = self.best_of
        if self.suffix:
            out["suffix"] = self.suffix
        return out


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it: text parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def unsupported(self) -> dict[str, Any]:
        out = super().unsupported()
        if self.tools:
            out["tools"] = self.tools
        if self.tool_choice not in (None, "none", "auto"):
            out["tool_choice"] = self.tool_choice
        if self.response_format not in (None, {"type": "text"}):
            out["response_format"] = self.response_format
        return out


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's extension: the prompt's ``Logprob``s by token id, when ``prompt_logprobs`` asks."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's extension: the prompt's ``Logprob``s by token id, when ``prompt_logprobs`` asks."""


class DeltaMessage(BaseModel):
    """A streamed message delta; unset fields are left out (the last chunk's is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` with a prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    """``POST /tokenize`` with chat messages, rendered by the chat template (vLLM's
    ``TokenizeChatRequest``)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
