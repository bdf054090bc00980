"""``tokenmill serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve`` arguments)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tokenmill import envs, plugins
from tokenmill.cli import add_engine_args, engine_kwargs

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
        "registered tool parser (hermes, llama3_json, or a plugin's); needs "
        "--enable-auto-tool-choice",
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
