"""``tokenmill serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve`` arguments)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tokenmill import envs, plugins
from tokenmill.cli import add_engine_args, engine_kwargs
from tokenmill.entrypoints.openai.server_options import (
    CONTENT_FORMATS,
    METRICS_NAMES,
    ServerOptions,
)

if TYPE_CHECKING:
    from fastapi import FastAPI


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    text = "serve the OpenAI API over HTTP"
    parser = subparsers.add_parser("serve", help=text, description=text)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1; None: $TOKENMILL_API_KEY, if set",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names clients may use; the first is reported; None: the model's",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="unfinished requests at which new ones get 503; None: 1024",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process (--no-engine-process: in a thread of the "
        "server's)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose whether to call tools (tool_choice="auto"); needs '
        "--tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls appear in the model's output, for tool_choice=\"auto\": a "
        "registered tool parser (hermes, llama3_json, mistral, granite, internlm, pythonic, "
        "llama4_pythonic, or a plugin's); needs --enable-auto-tool-choice",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to use instead of the tokenizer's: a Jinja file, or the "
        "template itself",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="how message content reaches the chat template: one string, or OpenAI's list of "
        "text parts; auto: the list when the template loops over content",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="use a request's own chat_template (Jinja text); without it such a request is a 400",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="spell logprob tokens 'token_id:<id>' (a request's return_tokens_as_token_ids "
        "overrides it)",
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, even without stream_options.include_usage",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens (prompt tokens served from the "
        "prefix cache)",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer every request with an X-Request-Id header (the request's, or a new one)",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (it shows the tokenizer's settings and chat template)",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="serve GET /load: the requests the server is working on",
    )
    parser.add_argument(
        "--root-path", default="", help="the path prefix a proxy serves this server under"
    )
    parser.add_argument(
        "--metrics-names",
        choices=METRICS_NAMES,
        default="both",
        help="/metrics series names: tokenmill:*, vLLM's vllm:*, or both",
    )
    parser.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the browser UI (the chat page at / and the engine page at /engine)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as models of their own, each chosen by a "
        "request's model; needs --enable-lora",
    )
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = make_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def make_app(args: argparse.Namespace) -> FastAPI:
    """The server's app for the parsed ``serve`` arguments, its engine started."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit(
            "error: --enable-auto-tool-choice and --tool-call-parser must be given together"
        )
    if args.tool_call_parser is not None:
        try:
            plugins.get_registry("tool_parsers").get(args.tool_call_parser)
        except ValueError as e:
            raise SystemExit(f"error: --tool-call-parser: {e}") from None

    lora_modules = parse_lora_modules(args.lora_modules or [])
    if lora_modules and not args.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora")
    from tokenmill.entrypoints.openai.chat_template import load_chat_template

    if args.chat_template is not None:
        try:
            load_chat_template(args.chat_template)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    options = ServerOptions(
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_server_load_tracking=args.enable_server_load_tracking,
        root_path=args.root_path,
        metrics_names=args.metrics_names,
    )

    from tokenmill.default_model import DEFAULT_MODEL_NAME
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.api_server import build_app
    from tokenmill.entrypoints.openai.errors import OpenAIError

    limit = (
        {}
        if args.max_pending_requests is None
        else {"max_pending_requests": args.max_pending_requests}
    )
    engine = AsyncLLM.from_engine_args(
        **limit, engine_process=args.engine_process, **engine_kwargs(args)
    )
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    try:
        return build_app(
            engine,
            names,
            args.api_key or envs.TOKENMILL_API_KEY,
            args.tool_call_parser,
            options,
            lora_modules,
            web_ui=not args.disable_web_ui,
        )
    except OpenAIError as e:
        engine.shutdown()
        raise SystemExit(f"error: --lora-modules: {e}") from None


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``--lora-modules`` values ``name=path`` as a dict; ``SystemExit`` for a malformed or
    repeated name."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --lora-modules: expected NAME=PATH, got {item!r}")
        if name in modules:
            raise SystemExit(f"error: --lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules
