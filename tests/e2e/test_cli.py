"""The ``tokenmill`` command line: help and defaults of every flag, ``--version``, sampling flags
checked before any model loads, and the answers of ``generate`` / ``chat`` (separators,
``--json``, the interactive conversation)."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import subprocess
import sys
import time
import typing
from dataclasses import fields

import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer

from tokenmill import cli
from tokenmill.engine_args import EngineArgs

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> typing.Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_has_help_and_shows_its_default():
    parsers = dict(_parsers(cli.build_parser()))
    assert {("generate",), ("chat",), ("serve",), ("plugins",), ("bench", "serve")} <= set(parsers)
    assert {("bench", "throughput"), ("bench", "latency")} <= set(parsers)
    for path, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help and action.help.strip(), f"{path} {name} has no help"
            if action.option_strings:
                assert "%(default)" in formatter._get_help_string(action), f"{path} {name}"
        text = parser.format_help()
        assert "``" not in text, f"{path} help has reST markup"


def test_serve_help_shows_host_and_port(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--host HOST address to bind (default: 127.0.0.1)" in out
    assert "--port PORT port to bind (default: 8000)" in out


def test_bench_serve_defaults_to_short_prompts():
    args = cli.build_parser().parse_args(["bench", "serve"])
    assert (args.random_input_len, args.random_output_len) == (128, 64)


def test_engine_flags_come_from_engine_args():
    parser = cli.build_parser()
    generate = dict(_parsers(parser))[("generate",)]
    by_dest = {a.dest: a for a in generate._actions}
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        assert f.name in cli.ENGINE_ARG_NAMES, f.name
        assert by_dest[f.name].help == f.metadata["help"], f.name
        assert by_dest[f.name].default == f.default, f.name
        if hints[f.name] is bool:
            assert isinstance(by_dest[f.name], argparse.BooleanOptionalAction), f.name
    kwargs = cli.engine_kwargs(parser.parse_args(["generate", "hi"]))
    assert kwargs == {name: getattr(EngineArgs, name) for name in cli.ENGINE_ARG_NAMES}
    args = parser.parse_args(["generate", "hi", "--no-enable-prefix-caching", "-tp", "2"])
    assert cli.engine_kwargs(args)["enable_prefix_caching"] is False
    assert cli.engine_kwargs(args)["tensor_parallel_size"] == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"tokenmill {importlib.metadata.version('tokenmill')}\n"


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", "-1", "temperature must be >= 0, got -1.0"),
        ("--max-tokens", "0", "max_tokens must be >= 1, got 0"),
        ("--top-p", "0", "top_p must be in (0, 1], got 0.0"),
        ("--top-k", "-2", "top_k must be >= -1, got -2"),
    ],
)
def test_bad_sampling_flag_fails_before_the_model_loads(
    command, flag, value, message, monkeypatch, capsys
):
    import tokenmill.entrypoints.llm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(tokenmill.entrypoints.llm, "LLM", no_model)
    start = time.perf_counter()
    assert cli.main([command, "x", flag, value]) == 2
    assert time.perf_counter() - start < 1.0
    assert capsys.readouterr().err == f"error: {message}\n"


def test_bad_sampling_flag_fails_without_importing_torch():
    code = (
        "import sys\n"
        "from tokenmill import cli\n"
        "assert cli.main(['generate', 'x', '--temperature', '-1']) == 2\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch before failing'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "error: temperature must be >= 0, got -1.0\n"


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_chat")
    make_tiny_checkpoint(path)
    save_byte_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def _run(model: str, argv: list[str], capsys, stdin: str | None = None, monkeypatch=None) -> str:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    engine = ["--model", model, "--num-kv-blocks", "64", "--max-tokens", "3"]
    assert cli.main([*argv, *engine]) == 0
    return capsys.readouterr().out


def test_generate_separates_several_prompts(tiny_chat_model, capsys):
    one = _run(tiny_chat_model, ["generate", "ab"], capsys)
    assert "===" not in one
    out = _run(tiny_chat_model, ["generate", "ab", "cd"], capsys)
    lines = out.splitlines()
    assert lines[0] == "=== 1/2: ab ==="
    assert "=== 2/2: cd ===" in lines[1:]
    assert out.startswith(f"=== 1/2: ab ===\n{one}")


def test_generate_json_lines(tiny_chat_model, capsys):
    out = _run(tiny_chat_model, ["generate", "ab", "cd", "--json"], capsys)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["ab", "cd"]
    assert all(r["finish_reason"] == "length" and isinstance(r["text"], str) for r in records)


def test_chat_messages_are_separate_conversations(tiny_chat_model, capsys):
    out = _run(tiny_chat_model, ["chat", "A", "B", "--json"], capsys)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["messages"] for r in records] == [
        [{"role": "user", "content": "A"}],
        [{"role": "user", "content": "B"}],
    ]
    text = _run(tiny_chat_model, ["chat", "A", "B"], capsys)
    assert text.startswith(f"=== 1/2: A ===\n{records[0]['text']}\n=== 2/2: B ===\n")


def test_chat_without_message_keeps_the_conversation(tiny_chat_model, capsys, monkeypatch):
    stdin = "A\n\nB\nquit\nC\n"
    out = _run(tiny_chat_model, ["chat", "--json"], capsys, stdin=stdin, monkeypatch=monkeypatch)
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["messages"] == [{"role": "user", "content": "A"}]
    assert second["messages"] == [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "B"},
    ]
    eof = _run(tiny_chat_model, ["chat"], capsys, stdin="A\n", monkeypatch=monkeypatch)
    assert eof == f"{first['text']}\n"
