"""Rendering chat messages into a prompt: the tokenizer's chat template, the server's
``--chat-template`` or (under ``--trust-request-chat-template``) the request's own
``chat_template``, with vLLM's request options (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``documents``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionToolsParam, ChatMessage
from tokenmill.entrypoints.openai.server_options import CONTENT_FORMATS, ServerOptions

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
    }
)
"""Names ``chat_template_kwargs`` may not set: the request's own fields (or the renderer's
arguments) set them."""

_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content\b)")


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is inline Jinja (it
    holds ``{``, ``}`` or a newline); ``ValueError`` for a path that does not exist."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def resolve_content_format(content_format: str, template: str | None) -> str:
    """``string`` or ``openai`` for ``--chat-template-content-format``."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}, "
            f"got {content_format!r}"
        )
    if content_format != "auto":
        return content_format
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


@dataclass
class ChatRenderer:
    """Renders a request's messages with the server's chat template.

    Attributes:
        tokenizer: the model's tokenizer (None: the model has no chat template).
        template: ``--chat-template``'s text; None: the tokenizer's own.
        content_format: ``string`` or ``openai`` (see ``CONTENT_FORMATS``).
        format_option: ``--chat-template-content-format``, resolved for a request's template.
        trust_request_chat_template: ``--trust-request-chat-template``: a request may bring
            its own ``chat_template``.
    """

    tokenizer: Any
    template: str | None = None
    content_format: str = "string"
    format_option: str = "auto"
    trust_request_chat_template: bool = False

    @classmethod
    def create(cls, tokenizer: Any, options: ServerOptions) -> ChatRenderer:
        template = load_chat_template(options.chat_template) if options.chat_template else None
        own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        content_format = resolve_content_format(options.chat_template_content_format, template or own)
        return cls(
            tokenizer,
            template,
            content_format,
            options.chat_template_content_format,
            options.trust_request_chat_template,
        )

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[ChatCompletionToolsParam] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        documents: list[dict[str, str]] | None,
        chat_template: str | None = None,
    ) -> str:
        """The prompt text (``chat_template``: the request's own template, Jinja text); a 400
        naming the request field at fault."""
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer, so it has no chat template")
        template, content_format = self.template, self.content_format
        if chat_template is not None:
            if not self.trust_request_chat_template:
                raise OpenAIError(
                    "chat_template in a request is refused: the server runs without "
                    "--trust-request-chat-template",
                    param="chat_template",
                )
            template = chat_template
            content_format = resolve_content_format(self.format_option, chat_template)
        if not messages:
            raise OpenAIError("messages must not be empty", param="messages")
        if continue_final_message and add_generation_prompt:
            raise OpenAIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise OpenAIError(
                f"chat_template_kwargs may not set {', '.join(reserved)} (request fields or the "
                "server set them)",
                param="chat_template_kwargs",
            )
        try:
            return self.tokenizer.apply_chat_template(
                [m.to_template_dict(content_format) for m in messages],
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                documents=documents,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
