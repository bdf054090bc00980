"""The ``tokenmill serve`` settings the OpenAI endpoints read (vLLM's flags of the same
names)."""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_FORMATS = ("auto", "string", "openai")
"""``--chat-template-content-format`` values (vLLM's): how message content reaches the
template: one string, or OpenAI's list of ``{"type": "text", "text"}`` parts; ``auto``
picks ``openai`` when the template loops over a message's content, else ``string``."""

METRICS_NAMES = ("tokenmill", "vllm", "both")
"""``--metrics-names``: which prefix ``/metrics`` names its series with."""


@dataclass(frozen=True)
class ServerOptions:
    """Attributes:
    chat_template: ``--chat-template``: a Jinja file or inline template replacing the
        tokenizer's; None: the tokenizer's.
    chat_template_content_format: ``--chat-template-content-format``: ``auto``, ``string``
        or ``openai``.
    trust_request_chat_template: ``--trust-request-chat-template``: a request's own
        ``chat_template`` is used; otherwise such a request is a 400.
    return_tokens_as_token_ids: ``--return-tokens-as-token-ids``: logprob tokens are spelled
        ``token_id:<id>`` unless a request says otherwise.
    enable_force_include_usage: ``--enable-force-include-usage``: every stream ends with a
        usage chunk, even without ``stream_options.include_usage``.
    enable_prompt_tokens_details: ``--enable-prompt-tokens-details``: usage carries
        ``prompt_tokens_details.cached_tokens``.
    enable_request_id_headers: ``--enable-request-id-headers``: responses carry
        ``X-Request-Id`` (the request's, or a new one).
    enable_tokenizer_info_endpoint: ``--enable-tokenizer-info-endpoint``: serve
        ``/tokenizer_info`` (it shows the chat template).
    enable_server_load_tracking: ``--enable-server-load-tracking``: serve ``/load``.
    root_path: ``--root-path``: the path prefix a proxy serves this server under.
    metrics_names: ``--metrics-names``: see ``METRICS_NAMES``.
    """

    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    enable_request_id_headers: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    root_path: str = ""
    metrics_names: str = "both"
