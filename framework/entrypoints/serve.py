"""``tokenmill serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve`` arguments)."""

from __future__ import annotations

import argparse
import os

from tokenmill.cli import add_engine_args, engine_kwargs


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI API over HTTP")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $TOKENMILL_API_KEY)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names clients may use; the first is reported (default: the model's)",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="unfinished requests at which new ones get 503 (default: 1024)",
    )
    parser.add_argument("--uvicorn-log-level", default="info")
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
    engine = AsyncLLM.from_engine_args(**limit, **engine_kwargs(args))
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    app = build_app(engine, names, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
