"""Every command shown in README.md and docs/*.md is checked here.

Shell blocks (```bash, ```console): each ``tokenmill`` command is parsed by the real argument
parser, and those in :data:`RUN` (plus the README's three server commands) are executed; any
other command must be listed in :data:`NOT_RUN` with the reason and the test that runs it. Inline
commands (`python benchmarks/...`, `tokenmill ...` in prose) name a script that exists and flags
it defines. A new command in the docs fails :func:`test_every_shell_command_is_checked` until it
is run here or listed. Every ```python block (the plugins page's aside, see
:data:`PYTHON_DOCS`) runs here or is listed in :data:`PYTHON_NOT_RUN`.
"""

from __future__ import annotations

import io
import json
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
    "tokenmill serve --pipeline-parallel-size": "parsed only: tests/worker/test_pipeline_parallel.py runs pipeline stages on tiny models and the default model",
    "tokenmill serve --model /models/deepseek-v3": "parsed only: needs a DeepSeek-V3 checkpoint; tests/worker/test_pipeline_parallel.py runs expert parallelism on a tiny one",
    "tokenmill serve --model /models/my-model": "parsed only: needs a Ray cluster and a model at that path",
    "tokenmill serve --port 8000 --kv-cache-memory-bytes": "parsed only: the first line of the vllm example",
    "tokenmill serve --port 8000 &": "parsed only: the first line of the lm-eval example",
    "tokenmill bench throughput": "parsed only: the documented sizes take minutes; tests/e2e/test_progress.py runs it on a tiny model",
    "tokenmill serve --enable-lora": "parsed only: needs PEFT adapters at those paths; tests/server/test_lora_server.py serves adapters made with peft",
    "curl -X POST localhost:8000/v1/load_lora_adapter": "tests/server/test_lora_server.py loads adapters through this endpoint",
    "curl -X POST localhost:8000/v1/unload_lora_adapter": "tests/server/test_lora_server.py unloads adapters through this endpoint",
    "WEB_UI_SCREENSHOT_DIR=": "the browser tests themselves, which the suite runs (tests/server/test_web_ui_browser.py)",
    "tokenmill serve --port 8000 --kv-transfer-config": "parsed only: tests/kv_connectors/ runs the storage and offload connectors on tiny models",
    "tokenmill serve --port 8100 --kv-transfer-config": "parsed only: tests/server/test_disaggregated.py runs a p2p prefill instance",
    "tokenmill serve --port 8200 --kv-transfer-config": "parsed only: tests/server/test_disaggregated.py runs a p2p decode instance",
    "tokenmill router --port 8000": "parsed only: tests/server/test_disaggregated.py runs the router over real instances",
    "python benchmarks/lora.py": "a benchmark (minutes, and vLLM's CPU build for the comparison); "
    "tests/lora/test_lora_units.py checks the kernel it times against the per-row reference",
    "tokenmill bench latency": "parsed only: the documented sizes take minutes; tests/e2e/test_progress.py runs it on a tiny model",
}
"""Shell commands not run as written (prefix -> why, and where they are exercised)."""

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


PYTHON_DOCS = [path for path in DOCS if path.name != "plugins.md"]
"""The docs whose ```python blocks run here; docs/plugins.md's are the example plugin's code
(tests/plugins/test_example_plugin.py runs that) and its tiny-checkpoint recipe
(tests/plugins/test_plugins.py runs those blocks in order)."""


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

PYTHON_NOT_RUN = {
    "scaling_out.md#1": "tensor_parallel_size=3: three worker processes of the default model take minutes on 2 cores; "
    "tests/worker/test_distributed.py runs tensor parallelism at 3 ranks on the default model's twin and tiny models",
    "scaling_out.md#2": "pipeline_parallel_size=2 x tensor_parallel_size=3: six worker processes; "
    "tests/worker/test_pipeline_parallel.py runs pipeline and tensor parallelism together on tiny models",
}
"""Python blocks not run here -> why, and the test that runs what they show."""


def test_every_python_block_is_run_or_listed():
    handled = [*ON_DEFAULT_MODEL, *ON_TINY_MODEL, *SAME_AS, *HOOKS, *PYTHON_NOT_RUN]
    assert len(handled) == len(set(handled))
    blocks = python_blocks()
    assert sorted(blocks) == sorted(handled), "run new ```python blocks here or list them in PYTHON_NOT_RUN"
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
