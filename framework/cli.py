"""The ``tokenmill`` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import sys
import textwrap
import types
import typing
from dataclasses import Field, fields
from typing import TYPE_CHECKING, Any

from tokenmill.engine_args import EngineArgs
from tokenmill.envs import ENVIRONMENT_VARIABLES
from tokenmill.plugins import PluginError, get_plugin_manager

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.outputs import RequestOutput
    from tokenmill.sampling_params import SamplingParams

REPL_EXIT_WORDS = ("exit", "quit")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends every option's default to its help (positional arguments have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not action.option_strings:
            return action.help
        return super()._get_help_string(action)


class TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``tokenmill --help``: keeps the epilog's own layout."""


class ArgumentParser(argparse.ArgumentParser):
    """The parser of ``tokenmill`` and of all its subcommands (``add_subparsers`` makes
    subparsers of the same class), so every ``--help`` shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def json_object(text: str) -> dict[str, Any]:
    """A flag value given as a JSON object (``--speculative-config '{"method": "ngram"}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _flag_type(hint: Any) -> tuple[Any, tuple[Any, ...] | None] | None:
    """The value type and choices of a flag for a field annotated ``hint``: a scalar, optional
    or not, a ``Literal``, or a dict given as a JSON object; None for anything else (no flag)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            return None
        hint = args[0]
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), choices
    if typing.get_origin(hint) is dict:
        return json_object, None
    return (hint, None) if hint in (str, int, float, bool) else None


def _engine_flags() -> list[tuple[Field, type, tuple[Any, ...] | None]]:
    hints = typing.get_type_hints(EngineArgs)
    flags = []
    for f in fields(EngineArgs):
        flag_type = _flag_type(hints[f.name])
        if flag_type is not None:
            flags.append((f, *flag_type))
    return flags


ENGINE_FLAGS = _engine_flags()
"""A flag for each ``EngineArgs`` field with a scalar type, with the field's default and help."""

ENGINE_ARG_NAMES = tuple(f.name for f, _, _ in ENGINE_FLAGS)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine arguments shared by every command that builds an engine (vLLM's names)."""
    g = parser.add_argument_group("engine")
    for f, flag_type, choices in ENGINE_FLAGS:
        names = ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
        kind: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction}
            if flag_type is bool
            else {"type": flag_type, "choices": choices}
        )
        g.add_argument(*names, default=f.default, help=f.metadata["help"], **kind)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def _answer_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags and ``--json`` of ``generate`` and ``chat``."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per answer")
    g.add_argument("--temperature", type=float, default=0.0, help="softmax temperature; 0: greedy")
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="keep the most likely tokens whose probabilities sum to top-p; 1: off",
    )
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: off")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per line: the prompt (generate) or messages (chat), the "
        "answer's text and finish_reason",
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as ``SamplingParams``: invalid values raise ``ValueError`` here, before
    any model loads."""
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )


def _print_answers(
    inputs: list[tuple[str, dict[str, Any]]], outputs: list[RequestOutput], as_json: bool
) -> None:
    """Print each answer: alone for one input, after a ``=== i/n: input ===`` line for several,
    or as a JSON line holding the input's ``record`` and the answer."""
    for i, ((label, record), out) in enumerate(zip(inputs, outputs), 1):
        answer = out.outputs[0]
        if as_json:
            line = {**record, "text": answer.text, "finish_reason": answer.finish_reason}
            print(json.dumps(line, ensure_ascii=False), flush=True)
            continue
        if len(inputs) > 1:
            print(f"=== {i}/{len(inputs)}: {label} ===")
        print(answer.text, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    _print_answers([(p, {"prompt": p}) for p in args.prompt], outputs, args.json)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    if not args.message:
        _chat_repl(llm, params, args.json)
        return 0
    conversations = [[{"role": "user", "content": m}] for m in args.message]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    _print_answers(
        [(m, {"messages": c}) for m, c in zip(args.message, conversations)], outputs, args.json
    )
    return 0


def _chat_repl(llm: LLM, params: SamplingParams, as_json: bool) -> None:
    """One conversation: answer each line of stdin given the turns before it, until EOF or an
    exit word. A turn the engine refuses (too long for the context) is dropped."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"Type {' or '.join(REPL_EXIT_WORDS)} (or Ctrl-D) to end.", file=sys.stderr)
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("> " if interactive else "").strip()
        except EOFError:
            return
        if line in REPL_EXIT_WORDS:
            return
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            output = llm.chat([messages], params, use_tqdm=False)[0]
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        _print_answers([(line, {"messages": list(messages)})], [output], as_json)
        messages.append({"role": "assistant", "content": output.outputs[0].text})


def cmd_plugins(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.interfaces.attention import AttentionConfig
    from tokenmill.plugins import KINDS
    from tokenmill.selector import backend_reasons, select_platform

    manager = get_plugin_manager(strict=False)
    try:
        platform = select_platform()
    except Exception:
        platform = None
    device = platform.device_type if platform else "cpu"
    attn_config = AttentionConfig(head_size=64, dtype=torch.float32, device_type=device)
    mla_config = AttentionConfig(head_size=576, dtype=torch.float32, device_type=device, use_mla=True)
    for kind in KINDS:
        registry = manager.registries[kind]
        print(f"{kind}:")
        if not registry.entries:
            print("  (none)")
        for name in registry.names():
            reg = registry.get(name)
            note = ""
            if kind == "attention_backends":
                try:
                    is_mla = reg.load().is_mla()
                except PluginError:
                    is_mla = False
                reasons = backend_reasons(name, mla_config if is_mla else attn_config)
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


def add_plugin_commands(subparsers: argparse._SubParsersAction) -> list[str]:
    """Add every subcommand registered through the ``register_commands`` hook (``bench`` and
    ``serve`` among them) and return the errors of broken plugins and commands: a command that
    fails to load or to add itself is left out, the others work."""
    try:
        manager = get_plugin_manager(strict=False)
    except ValueError as e:
        return [str(e)]
    errors = [str(e) for e in manager.errors]
    registry = manager.registries["commands"]
    for name in registry.names():
        reg = registry.get(name)
        choices, shown = dict(subparsers.choices), list(subparsers._choices_actions)
        try:
            if name in subparsers.choices:
                raise ValueError("another command has that name")
            reg.load()(subparsers)
            if name not in subparsers.choices:
                raise ValueError(f"{reg.target} added no subcommand {name!r}")
        except Exception as e:
            subparsers.choices.clear()
            subparsers.choices.update(choices)
            subparsers._choices_actions[:] = shown
            errors.append(
                str(e)
                if isinstance(e, PluginError)
                else f"command {name!r} from plugin {reg.plugin!r} (distribution "
                f"{reg.distribution!r}) is left out: {e}"
            )
    return errors


def _epilog(errors: list[str]) -> str:
    """The environment variables with their docs, then the errors of broken plugins."""
    width = max(shutil.get_terminal_size().columns - 2, 60)
    column = max(map(len, ENVIRONMENT_VARIABLES)) + 4
    lines = ["environment variables:"]
    for name, var in ENVIRONMENT_VARIABLES.items():
        doc = textwrap.wrap(var.describe(), max(width - column, 30))
        lines.append(f"  {name:<{column - 2}}{doc[0]}")
        lines.extend(" " * column + line for line in doc[1:])
    if errors:
        lines += ["", "broken plugins (see 'tokenmill plugins'):"]
        lines.extend("  " + error.replace("\n", "\n    ") for error in errors)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tokenmill", description="LLM inference engine", formatter_class=TopHelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {importlib.metadata.version('tokenmill')}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    text = "complete prompts; several prompts are completed independently"
    p = sub.add_parser("generate", help=text, description=text)
    p.add_argument("prompt", nargs="+", help="prompts to complete")
    _answer_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    text = (
        "answer messages with the model's chat template: without a message, an interactive "
        "conversation read from stdin; with several, each is a separate one-turn conversation"
    )
    p = sub.add_parser("chat", help=text, description=text)
    p.add_argument("message", nargs="*", help="messages, each answered on its own")
    _answer_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list registered plugins and where they come from")
    p.set_defaults(func=cmd_plugins)

    parser.epilog = _epilog(add_plugin_commands(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PluginError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
