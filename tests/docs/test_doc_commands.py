"""Every command shown in README.md and docs/*.md is checked here.

Shell blocks (```bash, ```console): each ``tokenmill`` command is parsed by the real argument
parser; those in :data:`RUN`, the README's three server commands and the plugins page's install
session (:data:`PLUGIN_SESSION`) run here, the heavier blocks (several worker processes, Ray
clusters, the disaggregated trio, LoRA servers, benchmarks at their sizes) in
test_doc_commands_slow.py, the lm-eval example in tests/e2e/test_lm_eval.py (:data:`RUN_ELSEWHERE`);
any other command must be listed in :data:`NOT_RUN` with the reason.
Inline commands (`python benchmarks/...`, `tokenmill ...` in prose) name a script that exists and
flags it defines. A new command in the docs fails :func:`test_every_shell_command_is_checked`
until it runs or is listed. Every ```python block runs: here, in test_doc_commands_slow.py
(:data:`PYTHON_SLOW`) or, for docs/plugins.md, in test_plugin_docs.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

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

PLUGIN_SESSION = ("pip install ./plugins_example", "tokenmill plugins", "tokenmill example-hello --name you")
"""The plugins page's console session, run as written in a copy of the project (pip installing
into a temporary target through pip's environment variables); each command prints the lines the
page shows (``...`` standing for more)."""

NOT_RUN = {
    "make demo": "the set-up itself (scripts/install.sh installs from the package index): "
    "CI runs `make test` from a clean clone (.ci/run), which installs what `make demo` does",
    "make test": "the test suite itself: CI runs it (.ci/run)",
    "tokenmill serve --port 8000 --kv-cache-memory-bytes": "the vllm example: needs vLLM's CPU build, which "
    "the test extras do not install (its wheel brings its own torch); run by hand with "
    "benchmarks/vllm_cli.py as the `vllm` command",
    "for backend in": "the vllm example",
    "vllm bench serve": "the vllm example",
    "done": "the vllm example",
    "python benchmarks/lora.py --vllm-python": "needs vLLM's CPU build (see the vllm example); "
    "`python benchmarks/lora.py --kernel` runs (slow)",
}
"""Shell commands not run (prefix -> why, and where they are exercised)."""

RUN_ELSEWHERE = {
    "tokenmill serve --port 8000 &": "tests/e2e/test_lm_eval.py (slow): the shared default_server, "
    "this command with the test flags",
    "M=": "a shell variable: tests/e2e/test_lm_eval.py fills $M in with the default model's directory",
    "HF_DATASETS_OFFLINE=1 lm_eval": "tests/e2e/test_lm_eval.py (slow, 26 min on 2 cores) runs both as written, "
    "--output_path and --log_samples added",
}
"""Shell commands another (slow) test runs as written (prefix -> the test)."""


def run_in_slow_tests() -> set[str]:
    """The commands tests/docs/test_doc_commands_slow.py runs as written."""
    from test_doc_commands_slow import commands_run_here

    return commands_run_here()

SCRIPT = re.compile(r"`((?:python|bash)\s+(?:benchmarks|scripts)/[^`]+)`")
INLINE_CLI = re.compile(r"`(tokenmill\s+[^`]+)`")


def shell_blocks() -> list[tuple[str, list[str]]]:
    """(file, commands) for every shell block of the docs, its command lines as written: comments
    removed, continuation lines joined, runs of blanks as one."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for lang, body in re.findall(r"^```(bash|console)\n(.*?)^```", text, re.S | re.M):
            lines = body.replace("\\\n", " ").splitlines()
            if lang == "console":
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            commands = [" ".join(re.sub(r"(^|\s)#\s.*$", "", line).split()) for line in lines]
            found.append((path.name, [c for c in commands if c]))
    return found


def shell_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of the docs' shell blocks."""
    return [(name, command) for name, commands in shell_blocks() for command in commands]


def _known(command: str) -> str | None:
    for prefix in NOT_RUN:
        if command.startswith(prefix):
            return prefix
    return None


def run_here(command: str) -> bool:
    """Whether this module runs ``command`` as written (bar the test flags it names)."""
    return command in (*RUN, SERVE, BENCH_SERVE, *PLUGIN_SESSION) or command.startswith(CURL)


def test_every_shell_command_is_checked():
    slow = run_in_slow_tests()
    unchecked = []
    for name, command in shell_commands():
        if run_here(command) or command in slow or command.startswith(tuple(RUN_ELSEWHERE)) or _known(command):
            continue
        unchecked.append(f"{name}: {command}")
    assert unchecked == [], "run these here or in test_doc_commands_slow.py, or list them in NOT_RUN"
    assert not [c for _, c in shell_commands() if (c in slow or run_here(c)) and _known(c)], "run and listed"


def test_listed_commands_are_still_in_the_docs():
    commands = [command for _, command in shell_commands()]
    for listed in [*RUN, SERVE, CURL, BENCH_SERVE, *PLUGIN_SESSION, *RUN_ELSEWHERE, *NOT_RUN]:
        assert any(c == listed or c.startswith(listed) for c in commands), listed


def test_every_tokenmill_command_parses():
    for name, command in shell_commands():
        words = shlex.split(command)
        if words[0] != "tokenmill" or command in PLUGIN_SESSION:
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


def replace_llm(monkeypatch: pytest.MonkeyPatch, build) -> None:
    """Make ``tokenmill.LLM`` and ``tokenmill.entrypoints.llm.LLM`` ``build`` until ``monkeypatch``
    is undone. ``tokenmill.LLM`` is a lazy attribute read from ``tokenmill.entrypoints.llm``: it is
    patched as an entry of the package's namespace, which the undo removes, since a
    ``setattr`` would record (and restore) whatever the lazy lookup returns at that moment."""
    monkeypatch.setattr(tokenmill.entrypoints.llm, "LLM", build)
    monkeypatch.setitem(vars(tokenmill), "LLM", build)


@pytest.fixture
def shared_engines(engines, default_llm, monkeypatch) -> None:
    """Commands that build the default engine get the shared ``default_llm`` (its KV cache is
    256 MiB instead of the default size); others one engine per set of arguments."""

    def build(**kwargs) -> LLM:
        key = repr(EngineArgs(**kwargs))
        if key == repr(EngineArgs()):
            return default_llm
        if key not in engines:
            engines[key] = LLM(**kwargs)
        return engines[key]

    replace_llm(monkeypatch, build)


def test_replaced_llm_is_restored_after_the_test():
    """A leaked ``build`` once handed later tests a cached engine for the same arguments."""
    real = tokenmill.entrypoints.llm.LLM
    with pytest.MonkeyPatch.context() as mp:
        replace_llm(mp, lambda **kwargs: None)
        assert tokenmill.LLM is not real
    assert tokenmill.LLM is real
    assert tokenmill.entrypoints.llm.LLM is real


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


def _readme_line(start: str) -> str:
    [line] = [c for name, c in shell_commands() if name == "README.md" and c.startswith(start)]
    return line


def test_readme_server_commands_run(default_server):
    """The README's server is the shared ``default_server``: the same ``tokenmill serve`` with the
    test flags added (a free port, a smaller KV cache, prompt token details); its curl and
    benchmark commands run as written against that server's URL."""
    serve = shlex.split(_readme_line(SERVE))
    launched = default_server.proc.args
    assert serve[1] == "serve" and launched[launched.index("serve") - 1] == "tokenmill"
    for flag, value in zip(serve[2::2], serve[3::2]):
        assert flag in launched, f"the shared server is not started with {flag}"
        assert flag == "--port" or launched[launched.index(flag) + 1] == value

    def local(line: str) -> list[str]:
        words = shlex.split(line.replace("http://127.0.0.1:8000", default_server.url))
        return [sys.executable, "-m", "tokenmill", *words[1:]] if words[0] == "tokenmill" else words

    assert shutil.which("curl"), "curl is needed to run the README's curl command"
    curl = subprocess.run(local(_readme_line(CURL)), capture_output=True, text=True, check=True)
    assert json.loads(curl.stdout)["choices"][0]["text"]
    bench = local(_readme_line(BENCH_SERVE).replace("--num-prompts 100", "--num-prompts 4 --random-output-len 8"))
    report = subprocess.run(bench, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert re.search(r"[Ss]uccessful requests:\s+4\b", report.stdout), report.stdout
    default_server.wait_idle()


def console_session(first: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) of the docs' console block that starts with
    ``$ first``."""
    for path in DOCS:
        for body in re.findall(r"^```console\n(.*?)^```", path.read_text(), re.S | re.M):
            if body.startswith(f"$ {first}\n"):
                session: list[tuple[str, list[str]]] = []
                for line in body.splitlines():
                    if line.startswith("$ "):
                        session.append((line[2:], []))
                    else:
                        session[-1][1].append(line)
                return session
    raise LookupError(first)


def test_plugin_install_session_runs(tmp_path):
    session = console_session(PLUGIN_SESSION[0])
    assert tuple(command for command, _ in session) == PLUGIN_SESSION
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "plugins_example", tmp_path / "plugins_example", ignore=ignore)
    site = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_PLUGINS", "TOKENMILL_PLATFORM")}
    env.update(PIP_TARGET=str(site), PIP_NO_DEPS="1", PIP_NO_BUILD_ISOLATION="0", PIP_QUIET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    for command, shown in session:
        words = shlex.split(command)
        argv = [sys.executable, "-m", words[0], *words[1:]]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        printed = iter(" ".join(line.split()) for line in done.stdout.splitlines())
        expected = [" ".join(line.split()) for line in shown if line.strip() != "..."]
        missing = [line for line in expected if line not in printed]
        assert missing == [], f"{command} printed:\n{done.stdout}"


PYTHON_DOCS = [path for path in DOCS if path.name != "plugins.md"]
"""The docs whose ```python blocks run here; docs/plugins.md's run in test_plugin_docs.py."""


def python_blocks() -> dict[str, str]:
    """``"<file>#<n>"`` (the n-th ```python block of the file, from 1) -> its code."""
    blocks = {}
    for path in PYTHON_DOCS:
        for n, code in enumerate(re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M), start=1):
            blocks[f"{path.name}#{n}"] = code
    return blocks


def _prints_three_lines(namespace: dict, out: str) -> None:
    assert out.count("\n") >= 3 and namespace["outs"][0].outputs[0].text


def _prints_json_with_a_city(namespace: dict, out: str) -> None:
    assert re.match(r'\{\s*"city"\s*:\s*"', out.strip()), out


ON_DEFAULT_MODEL = {
    "README.md#1": _prints_three_lines,
    "structured_outputs.md#1": _prints_json_with_a_city,
}
"""Blocks that build ``LLM()``: run on the shared ``default_llm`` (the default model with a
256 MiB KV cache instead of the default size) -> the check of what they printed."""

ON_TINY_MODEL = {
    "kv_transfer.md#1": {"/tmp/kv": "kv"},
    "quantization.md#1": {},
    "lora.md#1": {"/path/to/": ""},
}
"""Blocks that build engines with other settings: run on a tiny Llama with a byte tokenizer (its
path given as ``model`` where the block gives none), in a folder holding the files they name ->
the replacements made to their paths first."""

SAME_AS = {"usage.md#1": "README.md#1"}
"""Blocks whose code is another block's, which runs it."""

HOOKS = ["architecture.md#1", "kv_transfer.md#2"]
"""Hook implementations: defined, then called with a recorder of what they register."""

PYTHON_SLOW = {
    "scaling_out.md#1": "tensor_parallel_size=3: three worker processes of the default model",
    "scaling_out.md#2": "pipeline_parallel_size=2 x tensor_parallel_size=3: six worker processes of the default model",
}
"""Python blocks that build engines of several worker processes: test_doc_commands_slow.py runs
them (slow) -> what they start."""


def test_every_python_block_is_run_or_listed():
    handled = [*ON_DEFAULT_MODEL, *ON_TINY_MODEL, *SAME_AS, *HOOKS, *PYTHON_SLOW]
    assert len(handled) == len(set(handled))
    blocks = python_blocks()
    assert sorted(blocks) == sorted(handled), "run new ```python blocks here or in PYTHON_SLOW"
    for block, runner in SAME_AS.items():
        assert blocks[block] == blocks[runner], f"{block} differs from {runner}: run it on its own"


@pytest.mark.parametrize("block", list(ON_DEFAULT_MODEL))
def test_python_block_runs_on_the_default_model(block, default_llm, monkeypatch, capsys):
    def build(**kwargs) -> LLM:
        assert kwargs == {}, f"{block} builds LLM({kwargs}): run it in ON_TINY_MODEL"
        return default_llm

    replace_llm(monkeypatch, build)
    code, namespace = python_blocks()[block], {}
    assert block != "README.md#1" or len(code.splitlines()) <= 10
    exec(compile(code, block, "exec"), namespace)
    ON_DEFAULT_MODEL[block](namespace, capsys.readouterr().out)


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tmp_path_factory) -> Path:
    from conftest import make_tiny_checkpoint, save_byte_tokenizer

    path = Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama")))
    save_byte_tokenizer(path)
    return path


def _write_named_files(folder: Path, tiny: Path) -> None:
    """What the tiny-model blocks name: a GPTQ checkpoint and two PEFT adapters of ``tiny``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from support.quant_checkpoints import quantized_variant

    quantized_variant(tiny, folder / "some-gptq-checkpoint", "gptq", folder / "gptq-reference")
    for name in ("sql-adapter", "chat-adapter"):
        base = AutoModelForCausalLM.from_pretrained(str(tiny))
        get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).save_pretrained(str(folder / name))


@pytest.mark.parametrize("block", list(ON_TINY_MODEL))
def test_python_block_runs_on_a_tiny_model(block, tiny_llama_with_tokenizer, tmp_path, monkeypatch):
    built: list[LLM] = []

    def build(**kwargs) -> LLM:
        kwargs.setdefault("model", str(tiny_llama_with_tokenizer))
        built.append(LLM(**kwargs, max_model_len=256, num_kv_blocks=64))
        return built[-1]

    _write_named_files(tmp_path, tiny_llama_with_tokenizer)
    monkeypatch.chdir(tmp_path)
    replace_llm(monkeypatch, build)
    code = python_blocks()[block]
    for old, new in ON_TINY_MODEL[block].items():
        assert old in code
        code = code.replace(old, new)
    exec(compile(code, block, "exec"), {})
    assert built and all(llm.generate("Hi", use_tqdm=False)[0].outputs[0].token_ids for llm in built)


@pytest.mark.parametrize("block", HOOKS)
def test_python_block_hook_registers(block):
    from tokenmill.plugins import hookimpl

    namespace: dict = {"hookimpl": hookimpl}
    exec(compile(python_blocks()[block], block, "exec"), namespace)
    hooks = [f for name, f in namespace.items() if name.startswith("register_") and callable(f)]
    assert hooks
    registered: list[tuple[str, str]] = []
    for hook in hooks:
        before = len(registered)
        hook(lambda name, target: registered.append((name, target)))
        assert len(registered) > before, f"{hook.__name__} registers nothing"
    assert all(":" in target for _, target in registered), registered
