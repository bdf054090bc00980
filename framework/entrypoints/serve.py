"""``tokenmill serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve`` arguments)."""

from __future__ import annotations

import argparse

from tokenmill import envs
from tokenmill.cli import add_engine_args, engine_kwargs


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
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.default_model import DEFAULT_MODEL_NAME
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.api_server import build_app

    limit = (
        {}
        if args.max_pending_requests is None
        else {"max_pending_requests": args.max_pending_requests}
    )
    engine = AsyncLLM.from_engine_args(
        **limit, engine_process=args.engine_process, **engine_kwargs(args)
    )
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    app = build_app(engine, names, args.api_key or envs.TOKENMILL_API_KEY)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
