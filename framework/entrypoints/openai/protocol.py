"""Request and response bodies of the OpenAI API, plus vLLM's sampling extensions.

Requests are strict about types. A top-level field neither OpenAI nor vLLM knows is ignored
with a logged warning, as vLLM does. Fields OpenAI or vLLM accept but this engine cannot
honour are accepted only at values that change nothing (see ``unsupported``)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenmill.logprobs import PromptLogprobs

logger = logging.getLogger(__name__)

TokenIds = list[int]

MAX_N = 128
"""Most completions one request may ask for (``n``; OpenAI's limit)."""
MAX_PROMPTS = 1024
"""Most prompts one completions request may list."""
MAX_MESSAGES = 10_000
"""Most chat messages one request may hold."""
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 1024
MAX_CACHE_SALT_CHARS = 1024
MAX_TOKEN_ID_ENTRIES = 2**18
"""Most entries of ``allowed_token_ids`` and of ``logit_bias`` (any vocabulary's size)."""

StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]

VLLM_UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "vllm_xargs": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
    "prompt_embeds": None,
    "request_id": None,
}
"""vLLM request fields this engine does not implement, with the values that change nothing
(any other value is refused; docs/vllm_compatibility.md gives each one's reason)."""

class OpenAIModel(BaseModel):
    """A request body (or part of one): strict types, no unknown fields, and text that is
    valid Unicode (JSON escapes can spell lone surrogates, which no tokenizer or UTF-8
    encoder takes)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any, info: ValidationInfo) -> Any:
        where = _lone_surrogate(value)
        if where is not None:
            raise ValueError(
                f"{info.field_name}{where} holds a lone surrogate; text must be valid Unicode"
            )
        return value


def _lone_surrogate(value: Any) -> str | None:
    """Where in ``value`` (a path such as ``[0]['content']``; "" for ``value`` itself) a string
    holds a lone surrogate; None if nowhere.

    A list that starts with an int is not searched (token ids can number millions): the
    strict fields that take one hold ints only, and any other string reaching the engine
    core is refused there."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return ""
    elif isinstance(value, list) and not (value and isinstance(value[0], int)):
        for i, item in enumerate(value):
            where = _lone_surrogate(item)
            if where is not None:
                return f"[{i}]{where}"
    elif isinstance(value, dict):
        for key, item in value.items():
            where = _lone_surrogate(key)
            if where is None:
                where = _lone_surrogate(item)
            if where is not None:
                return f"[{key!r}]{where}"
    return None


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
    parent: str | None = None
    """For a LoRA adapter, the base model's name; None for the base model."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """With ``include_usage``: every chunk carries the usage so far (vLLM's extension)."""


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> UsageInfo:
        """``cached_tokens`` None: no ``prompt_tokens_details``."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=(
                None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
            ),
        )


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that validates
    against ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class KVTransferParams(OpenAIModel):
    """vLLM's ``kv_transfer_params``: what a request tells the server's KV connector (a
    prefill instance: ``do_remote_decode``, keep the prompt's KV for a decode instance; a
    decode instance: ``do_remote_prefill`` with where to pull it from), and what a response
    returns for the next instance. vLLM's fields are typed; a connector's own keys pass
    through to it."""

    model_config = ConfigDict(extra="allow", strict=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    remote_request_id: str | None = None


class SamplingFields(OpenAIModel):
    """Sampling fields shared by both endpoints (vLLM's extensions included), and
    ``cache_salt``: only requests with equal salts share prefix-cache blocks.

    Structured outputs come from one of ``structured_outputs`` (vLLM's
    ``StructuredOutputsParams`` fields), the legacy ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``, or ``response_format``."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StopString | StopStrings | None = None
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
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_TOKEN_ID_ENTRIES)] | None = None
    allowed_token_ids: Annotated[list[int], Field(max_length=MAX_TOKEN_ID_ENTRIES)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    """vLLM's: each choice carries ``prompt_token_ids`` and ``token_ids``."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprob tokens are spelled ``token_id:<id>``; None: the server's
    ``--return-tokens-as-token-ids``."""
    add_special_tokens: bool = True
    """vLLM's: the tokenizer adds its special tokens (a BOS) to the prompt text; a chat
    request's default is False (its template writes them)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM's: keep only this many prompt tokens (-1: ``max_model_len``), cut on
    ``truncation_side``."""
    truncation_side: Literal["left", "right"] = "left"
    """Which end ``truncate_prompt_tokens`` cuts: ``left`` keeps the last tokens (vLLM's
    default)."""
    priority: int = 0
    """vLLM's: lower runs first under ``--scheduling-policy priority``."""
    user: str | None = None
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None
    kv_transfer_params: KVTransferParams | None = None
    """vLLM's: for the server's KV connector (``--kv-transfer-config``); refused without one."""

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


class FunctionCall(OpenAIModel):
    name: str
    arguments: str
    """The arguments as a JSON text."""


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One chat message. As in vLLM, any role is taken (the chat template decides what it
    means) and fields this server does not know are left out of the template's input."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def to_template_dict(self, content_format: str = "string") -> dict[str, Any]:
        """The message as chat templates expect it: the content as one string (``string``) or
        as a list of ``{"type": "text", "text"}`` parts (``openai``); tool call arguments as
        objects (as HF chat templates render them)."""
        content: Any = self.text()
        if content_format == "openai":
            parts = self.content if isinstance(self.content, list) else None
            content = (
                [p.model_dump() for p in parts] if parts is not None
                else [{"type": "text", "text": content}]
            )
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return message


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the reply continues the last (assistant) message instead of starting one."""
    echo: bool = False
    """vLLM's: the reply starts with the last message's content when it has the reply's role."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template."""
    chat_template: str | None = None
    """vLLM's: a Jinja chat template for this request (only under
    ``--trust-request-chat-template``)."""
    documents: list[dict[str, str]] | None = None
    """vLLM's: documents for retrieval-augmented templates (the template's ``documents``)."""
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


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
    prompt_token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the prompt's token ids."""
    token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the generated token ids."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the server's KV connector returned for the request (a prefill
    instance's: where a decode instance pulls the prompt's KV)."""


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
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the generated token ids."""


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
    prompt_token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the prompt's token ids (after the chat template)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the server's KV connector returned for the request."""


class _DropNone(BaseModel):
    """Unset (None) fields are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A streamed piece of tool call ``index``: the first carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DropNone):
    """A streamed message delta; unset fields are left out (the last chunk's is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the token ids this chunk adds."""


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the prompt's token ids, on the first chunk."""


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
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    return (
        "TokenizeChatRequest"
        if isinstance(body, dict) and "messages" in body
        else "TokenizeCompletionRequest"
    )


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]
    | Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
    Discriminator(_tokenize_kind),
]
"""``POST /tokenize``'s body: chat messages if it has ``messages``, else a prompt (so a bad
body is reported against the one it meant to be)."""


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


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): the tokenizer's class and its settings
    (``init_kwargs``, values JSON cannot hold as text), with the chat template in use."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
