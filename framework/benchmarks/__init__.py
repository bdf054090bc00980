"""``tokenmill bench {throughput,latency,serve}`` with vLLM's argument names and printed metrics."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "throughput": "tokenmill.benchmarks.throughput",
    "latency": "tokenmill.benchmarks.latency",
    "serve": "tokenmill.benchmarks.serve",
}
"""Each module has ``add_arguments(parser)`` and ``run(args) -> int``."""


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    text = "benchmarks (vLLM-compatible arguments)"
    bench = subparsers.add_parser("bench", help=text, description=text)
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = module.__doc__.replace("``", "")
        parser = kinds.add_parser(name, help=doc.splitlines()[0], description=doc)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
