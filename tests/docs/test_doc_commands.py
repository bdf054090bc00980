"""Every command shown in README.md and docs/*.md is checked here.

Shell blocks (```bash, ```console): each ``tokenmill`` command is parsed by the real argument
parser, and those in :data:`RUN` (plus the README's three server commands) are executed; any
other command must be listed in :data:`NOT_RUN` with the reason and the test that runs it. Inline
commands (`python benchmarks/...`, `tokenmill ...` in prose) name a script that exists and flags
it defines. A new command in the docs fails :func:`test_every_shell_command_is_checked` until it
is run here or listed.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tokenmill
import tokenmill.entrypoints.llm
from tokenmill import LLM, cli
from tokenmill.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN = {
    'tokenmill generate "Once upon a time" --max-tokens 32': None,
    'tokenmill chat "What is the capital of France?" --temperature 0.7': None,
    "tokenmill chat": "Hi!\nexit\n",
    'tokenmill chat "Hi!" "Name a colour." --json': None,
    "tokenmill plugins": None,
}
"""Commands run as written, in process, on the default model -> the stdin they get."""

SERVE = "tokenmill serve --port 8000"
CURL = "curl -s http://127.0.0.1:8000/v1/completions"
BENCH_SERVE = "tokenmill bench serve --base-url http://127.0.0.1:8000 --num-prompts 100 --max-concurrency 16"
"""The README's server commands: run on a free port, the benchmark with 4 prompts of 8 output tokens."""

NOT_RUN = {
    "make demo": "the set-up itself: CI runs `make test` from a clean clone (.ci/run), which installs what `make demo` does",
    "make test": "the set-up itself: CI runs it (.ci/run)",
    "pip install ./plugins_example": "tests/plugins/test_example_plugin.py installs the example (into a temporary target)",
    "tokenmill example-hello": "needs the example plugin installed: tests/plugins/test_example_plugin.py runs it",
    "pytest --tokenmill-": "the conformance kit: tests/plugins/test_conformance_kit.py runs these options",
    "ray start": "needs a Ray cluster of several machines",
    "M=": "a shell variable of the lm-eval and vllm examples",
    "HF_DATASETS_OFFLINE=1 lm_eval": "tests/e2e/test_lm_eval.py runs lm-eval against tokenmill serve and HF",
    "for backend in": "needs vllm, which the test environment does not install",
    "vllm bench serve": "needs vllm, which the test environment does not install",
    "done": "the end of the vllm loop",
    "tokenmill serve --tensor-parallel-size": "parsed only: 3 ranks take minutes on 2 cores; tests/worker/test_distributed.py runs tensor parallelism on tiny models",
    "tokenmill serve --data-parallel-size": "parsed only: tests/worker/test_distributed.py runs data parallelism on tiny models",
    "tokenmill serve --model /models/my-model": "parsed only: needs a Ray cluster and a model at that path",
    "tokenmill serve --port 8000 --kv-cache-memory-bytes": "parsed only: the first line of the vllm example",
    "tokenmill serve --port 8000 &": "parsed only: the first line of the lm-eval example",
    "tokenmill bench throughput": "parsed only: the documented sizes take minutes; tests/e2e/test_progress.py runs it on a tiny model",
    "tokenmill serve --enable-lora": "parsed only: needs PEFT adapters at those paths; tests/server/test_lora_server.py serves adapters made with peft",
    "curl -X POST localhost:8000/v1/load_lora_adapter": "tests/server/test_lora_server.py loads adapters through this endpoint",
    "curl -X POST localhost:8000/v1/unload_lora_adapter": "tests/server/test_lora_server.py unloads adapters through this endpoint",
    "WEB_UI_SCREENSHOT_DIR=": "the browser tests themselves, which the suite runs (tests/server/test_web_ui_browser.py)",
    "tokenmill serve --port 8100 --kv-transfer-config": "parsed only: tests/server/test_disaggregated.py runs a p2p prefill instance",
    "tokenmill serve --port 8200 --kv-transfer-config": "parsed only: tests/server/test_disaggregated.py runs a p2p decode instance",
    "tokenmill router --port 8000": "parsed only: tests/server/test_disaggregated.py runs the router over real instances",
    "tokenmill serve --port 8000 --kv-transfer-config": "parsed only: tests/kv_connectors/ runs the storage and offload connectors on tiny models",
    "tokenmill bench latency": "parsed only: the documented sizes take minutes; tests/e2e/test_progress.py runs it on a tiny model",
}
"""Shell commands not run as written (prefix -> why, and where they are exercised)."""

SCRIPT = re.compile(r"`((?:python|bash)\s+(?:benchmarks|scripts)/[^`]+)`")
INLINE_CLI = re.compile(r"`(tokenmill\s+[^`]+)`")


def shell_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of the docs' shell blocks, as written: comments
    removed, continuation lines joined, runs of blanks as one."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for lang, body in re.findall(r"^```(bash|console)\n(.*?)^```", text, re.S | re.M):
            lines = body.replace("\\\n", " ").splitlines()
            if lang == "console":
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in lines:
                command = " ".join(re.sub(r"(^|\s)#\s.*$", "", line).split())
                if command:
                    found.append((path.name, command))
    return found


def _known(command: str) -> str | None:
    for prefix in NOT_RUN:
        if command.startswith(prefix):
            return prefix
    return None


def test_every_shell_command_is_checked():
    unchecked = []
    for name, command in shell_commands():
        if command in RUN or command.startswith((SERVE, CURL, BENCH_SERVE)) or _known(command):
            continue
        unchecked.append(f"{name}: {command}")
    assert unchecked == [], "run these in tests/docs/test_doc_commands.py or list them in NOT_RUN"


def test_listed_commands_are_still_in_the_docs():
    commands = [command for _, command in shell_commands()]
    for listed in [*RUN, SERVE, CURL, BENCH_SERVE, *NOT_RUN]:
        assert any(c == listed or c.startswith(listed) for c in commands), listed


def test_every_tokenmill_command_parses():
    for name, command in shell_commands():
        words = shlex.split(command)
        if words[0] != "tokenmill" or _known(command) == "tokenmill example-hello":
            continue
        argv = [w for w in words[1:] if w != "&"]
        try:
            cli.build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{name}: {command!r} does not parse (exit {e.code})")


def _subparser_options(words: list[str]) -> set[str]:
    """The option strings of the (sub)command that ``words`` (after ``tokenmill``) name."""
    parser = cli.build_parser()
    options: set[str] = set()
    for word in words:
        options |= set(parser._option_string_actions)
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if word.startswith("-") or not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return options | set(parser._option_string_actions)


def test_inline_commands_name_real_scripts_and_flags():
    problems = []
    for path in DOCS:
        text = path.read_text()
        for span in SCRIPT.findall(text):
            words = span.split()
            script = ROOT / words[1]
            if not script.exists():
                problems.append(f"{path.name}: {words[1]} does not exist")
                continue
            source = script.read_text()
            for flag in {w.split("=")[0] for w in words if w.startswith("--")}:
                if f'"{flag}"' not in source and f"{flag} " not in source:
                    problems.append(f"{path.name}: {words[1]} has no {flag}")
        for span in INLINE_CLI.findall(text):
            words = span.split()[1:]
            options = _subparser_options(words)
            for flag in {w.split("=")[0] for w in words if w.startswith("--")}:
                if flag not in options:
                    problems.append(f"{path.name}: `{span}` has no {flag}")
    assert problems == []


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    """Engines built by this module's commands, by their arguments: one default-model engine
    serves every command that asks for the same arguments."""
    return {}


@pytest.fixture
def shared_engines(engines, default_model_dir, monkeypatch) -> None:
    def build(**kwargs) -> LLM:
        key = repr(EngineArgs(**kwargs))
        if key not in engines:
            engines[key] = LLM(**kwargs)
        return engines[key]

    monkeypatch.setattr(tokenmill.entrypoints.llm, "LLM", build)
    monkeypatch.setattr(tokenmill, "LLM", build)


@pytest.mark.parametrize("command", list(RUN))
def test_documented_cli_command_runs(command, shared_engines, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(RUN[command] or ""))
    assert cli.main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    assert out.strip()
    if "--json" in command:
        answers = [json.loads(line) for line in out.splitlines()]
        assert [a["messages"][-1]["content"] for a in answers] == ["Hi!", "Name a colour."]
        assert all(a["text"] for a in answers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readme_line(start: str) -> str:
    [line] = [c for name, c in shell_commands() if name == "README.md" and c.startswith(start)]
    return line


def test_readme_server_commands_run(default_model_dir, tmp_path):
    port = str(_free_port())

    def local(line: str) -> list[str]:
        words = shlex.split(line.replace("8000", port))
        return [sys.executable, "-m", "tokenmill", *words[1:]] if words[0] == "tokenmill" else words

    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(local(_readme_line(SERVE)), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert shutil.which("curl"), "curl is needed to run the README's curl command"
        curl = subprocess.run(local(_readme_line(CURL)), capture_output=True, text=True, check=True)
        assert json.loads(curl.stdout)["choices"][0]["text"]
        bench = local(_readme_line(BENCH_SERVE).replace("--num-prompts 100", "--num-prompts 4 --random-output-len 8"))
        report = subprocess.run(bench, capture_output=True, text=True, timeout=300)
        assert report.returncode == 0, report.stderr
        assert re.search(r"[Ss]uccessful requests:\s+4\b", report.stdout), report.stdout
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_readme_python_example_runs(shared_engines, capsys):
    text = (ROOT / "README.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(example.splitlines()) <= 10
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.count("\n") >= 3
