"""The ``tokenmill`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from tokenmill.core.kv_cache_utils import HASH_ALGOS

SUBCOMMAND_MODULES = ("tokenmill.benchmarks", "tokenmill.entrypoints.serve")
"""Modules adding their own subcommands via ``register_subcommand(subparsers)``; each keeps
its heavy imports inside the command so ``tokenmill --help`` stays fast."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine arguments shared by every command that builds an engine (vLLM's names)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="block hash: sha256 (collision-resistant) or builtin (faster, single tenant only)",
    )
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--platform", default=None)
    g.add_argument("--quantization", default=None)
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="GPUs only (default 0.9)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


ENGINE_ARG_NAMES = (
    "model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
    "num_kv_blocks", "kv_cache_memory_bytes", "enable_prefix_caching", "prefix_caching_hash_algo",
    "enable_chunked_prefill", "attention_backend", "platform", "quantization", "kv_cache_dtype",
    "tensor_parallel_size", "seed", "gpu_memory_utilization", "enforce_eager",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(args.prompt, _params(args), use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    outputs = llm.chat(
        [[{"role": "user", "content": m}] for m in args.message], _params(args), use_tqdm=False
    )
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.interfaces.attention import AttentionConfig
    from tokenmill.plugins import KINDS, PluginError, get_plugin_manager
    from tokenmill.selector import backend_reasons, select_platform

    manager = get_plugin_manager(strict=False)
    try:
        platform = select_platform()
    except Exception:
        platform = None
    device = platform.device_type if platform else "cpu"
    attn_config = AttentionConfig(head_size=64, dtype=torch.float32, device_type=device)
    for kind in KINDS:
        registry = manager.registries[kind]
        print(f"{kind}:")
        if not registry.entries:
            print("  (none)")
        for name in registry.names():
            reg = registry.get(name)
            note = ""
            if kind == "attention_backends":
                reasons = backend_reasons(name, attn_config)
                note = f"  [unavailable: {'; '.join(reasons)}]" if reasons else ""
            elif kind == "platforms":
                try:
                    cls = reg.load()
                except PluginError as e:
                    note = f"  [unavailable: {e.__cause__}]"
                else:
                    if cls is platform:
                        note = "  [selected]"
                    elif not cls.is_available():
                        note = "  [not available]"
            print(f"  {name:<24} {reg.target:<60} from {reg.distribution}{note}")
    if manager.errors:
        print("broken plugins (no engine starts until they are fixed or uninstalled):")
        for error in manager.errors:
            print("  " + str(error).replace("\n", "\n    "))
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one or more prompts")
    p.add_argument("prompt", nargs="+")
    _sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="answer messages with the model's chat template")
    p.add_argument("message", nargs="+")
    _sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list registered plugins and where they come from")
    p.set_defaults(func=cmd_plugins)

    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
