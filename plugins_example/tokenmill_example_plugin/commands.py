"""``tokenmill example-hello``: a subcommand added by a plugin through ``register_commands``."""

from __future__ import annotations

import argparse


def add_hello(subparsers: argparse._SubParsersAction) -> None:
    """Add ``example-hello`` to the ``tokenmill`` subcommands."""
    text = "greet from the example plugin"
    parser = subparsers.add_parser("example-hello", help=text, description=text)
    parser.add_argument("--name", default="world", help="who to greet")
    parser.set_defaults(func=hello)


def hello(args: argparse.Namespace) -> int:
    print(f"Hello, {args.name}, from the tokenmill example plugin!")
    return 0
