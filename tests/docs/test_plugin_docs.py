"""Every ```python block of docs/plugins.md runs.

- The example's hook module and command module (blocks headed by their path) become the modules
  of a package beside the example's other files, with the entry point of the page's
  ``pyproject.toml``: an engine built by the page's ``LLM(...)`` block picks its parts up.
- The other blocks headed by a ``plugins_example/`` path are excerpts: each run of lines between
  ``...`` stands in that file, and every line of it runs while that engine loads and generates.
- The ``my_plugin`` blocks are the modules of a distribution whose entry points name them; an
  engine uses the part each registers.
- The runtime-registration block runs against an application package holding the classes it
  names.
The tiny-checkpoint recipe runs in tests/plugins/test_plugins.py and the conformance kit's hooks in
tests/plugins/test_conformance_kit.py (:data:`RUN_ELSEWHERE`).
"""

from __future__ import annotations

import importlib
import logging
import re
import shutil
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import make_tiny_checkpoint
from test_doc_commands import replace_llm
from tokenmill import LLM, SamplingParams, cli, plugins
from tokenmill.interfaces import AttentionConfig
from tokenmill.selector import select_attention_backend, select_platform

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"
EXAMPLE = ROOT / "plugins_example" / "tokenmill_example_plugin"
HEADER = re.compile(r"# plugins_example/tokenmill_example_plugin/(\w+\.py)$")
ENV_VARS = (
    "TOKENMILL_PLUGINS",
    "TOKENMILL_PLATFORM",
    "TOKENMILL_ATTENTION_BACKEND",
    "TOKENMILL_EXAMPLE_PLATFORM",
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)

RUN_ELSEWHERE = {
    "from transformers import LlamaConfig": "tests/plugins/test_plugins.py (tiny-checkpoint recipe)",
    'LLM(model="tiny-llama"': "tests/plugins/test_plugins.py (tiny-checkpoint recipe)",
    "from tokenizers import Tokenizer": "tests/plugins/test_plugins.py (tiny-checkpoint recipe)",
    "def pytest_tokenmill_": "tests/plugins/test_conformance_kit.py (the kit's hooks)",
}
"""Text a block holds -> the test that runs it."""


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _headed(block: str) -> str | None:
    match = HEADER.match(block.splitlines()[0])
    return match.group(1) if match else None


def example_modules() -> dict[str, str]:
    """The blocks that are whole modules of the example (file name -> code)."""
    return {_headed(b): b for b in python_blocks() if _headed(b) in ("__init__.py", "commands.py")}


def excerpts() -> list[str]:
    return [b for b in python_blocks() if _headed(b) and _headed(b) not in example_modules()]


def my_plugin_modules() -> dict[str, str]:
    """The blocks that register a ``my_plugin.<module>`` target (module -> code)."""
    found = {}
    for block in python_blocks():
        match = re.search(r'"my_plugin\.(\w+):', block)
        if match:
            found[match.group(1)] = block
    return found


def _the_block(start: str) -> str:
    [block] = [b for b in python_blocks() if b.startswith(start)]
    return block


ENGINE_BLOCK = 'from tokenmill import LLM, SamplingParams\n\nllm = LLM(model="path/to/gpt2"'
RUNTIME_BLOCK = "from tokenmill import plugins\n"


def test_every_block_is_run():
    handled = [*example_modules().values(), *excerpts(), *my_plugin_modules().values()]
    handled += [_the_block(ENGINE_BLOCK), _the_block(RUNTIME_BLOCK)]
    handled += [b for b in python_blocks() if any(text in b for text in RUN_ELSEWHERE)]
    assert sorted(handled) == sorted(python_blocks()), "run the new block in this module"
    assert set(example_modules()) == {"__init__.py", "commands.py"}
    assert set(my_plugin_modules()) == {"models", "proposer", "quant"}


# --- the example, built from the page -------------------------------------------------------


def _doc_block(lang: str, after: str) -> str:
    """The first ```lang block after the text ``after``."""
    rest = DOC.read_text().split(after, 1)[1]
    return re.search(rf"^```{lang}\n(.*?)^```", rest, re.S | re.M).group(1)


def _write_distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    lines = [f"{ep} = {module}" for ep, module in entry_points.items()]
    (info / "entry_points.txt").write_text("[tokenmill.plugins]\n" + "\n".join(lines) + "\n")


@pytest.fixture
def clean_plugins(monkeypatch) -> Iterator[pytest.MonkeyPatch]:
    """No plugin variables or runtime registrations; the plugins reloaded after."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plugins, "_runtime", [])
    before = set(sys.modules)
    yield monkeypatch
    monkeypatch.undo()
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("tokenmill_example_plugin", "my_plugin", "my_app"):
            del sys.modules[name]
    importlib.invalidate_caches()
    plugins.reload_plugins()


@pytest.fixture
def doc_example(tmp_path, clean_plugins) -> Path:
    """The example package with the page's ``__init__.py`` and ``commands.py``, installed as the
    distribution the page's ``pyproject.toml`` describes (a ``dist-info`` on ``sys.path``)."""
    project = tomllib.loads(_doc_block("toml", "## How a plugin is found"))["project"]
    package = tmp_path / "tokenmill_example_plugin"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__"))
    for name, code in example_modules().items():
        (package / name).write_text(code)
    _write_distribution(tmp_path, project["name"], project["entry-points"]["tokenmill.plugins"])
    clean_plugins.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    plugins.reload_plugins()
    return tmp_path


@pytest.fixture(scope="module")
def openai_style_gpt2(tmp_path_factory) -> Path:
    """A random tiny GPT-2 named as OpenAI's checkpoints are (no ``transformer.``), with the
    causal-mask buffers and the tied ``lm_head``, so every branch of the loader runs."""
    # GPT-2's own vocabulary size: the page's block prompts with GPT-2 token ids
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(str(path))
    tensors = {
        n.removeprefix("transformer."): t for n, t in load_file(path / "model.safetensors").items()
    }
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    for i in range(config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_untied_llama(tmp_path_factory) -> Path:
    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), tie_word_embeddings=False))


def _chunks(excerpt: str) -> list[tuple[str, list[str]]]:
    """(file, lines) of each run of an excerpt's code lines between ``...`` and file headers;
    comments and blank lines dropped."""
    chunks: list[tuple[str, list[str]]] = []
    current: list[str] = []
    name = ""
    for line in [*excerpt.splitlines(), "..."]:
        header = HEADER.match(line)
        if header or line.strip() == "...":
            if current:
                chunks.append((name, current))
            current = []
            name = header.group(1) if header else name
        elif _code(line):
            current.append(_code(line))
    return chunks


def _code(line: str) -> str:
    return re.sub(r"(^|\s+)#\s.*$", "", line).strip()


def _excerpt_lines() -> dict[str, set[int]]:
    """File -> the line numbers the page's excerpts show, each run found in its file in order."""
    shown: dict[str, set[int]] = {}
    for excerpt in excerpts():
        start: dict[str, int] = {}
        for name, lines in _chunks(excerpt):
            numbered = [
                (n, _code(line))
                for n, line in enumerate((EXAMPLE / name).read_text().splitlines(), 1)
            ]
            numbered = [(n, code) for n, code in numbered if code]
            source = [code for _, code in numbered]
            at = next(
                (
                    i
                    for i in range(start.get(name, 0), len(source))
                    if source[i : i + len(lines)] == lines
                ),
                None,
            )
            assert at is not None, (
                f"docs/plugins.md shows lines not in {name} (in this order):\n" + "\n".join(lines)
            )
            start[name] = at + len(lines)
            shown.setdefault(name, set()).update(n for n, _ in numbered[at : at + len(lines)])
    return shown


def test_excerpts_stand_in_the_example():
    assert set(_excerpt_lines()) == {"platform.py", "ops.py", "attention.py", "gpt2.py"}


def _statement_lines(path: Path) -> set[int]:
    """The lines of ``path`` that hold bytecode (a docstring or a bracket alone holds none)."""
    lines: set[int] = set()
    todo = [compile(path.read_text(), str(path), "exec")]
    while todo:
        code = todo.pop()
        lines.update(line for _, _, line in code.co_lines() if line is not None)
        todo += [c for c in code.co_consts if hasattr(c, "co_lines")]
    return lines


class LineRecorder:
    """The (file, line) pairs executed in the given files, in every thread, while active."""

    def __init__(self, files: list[Path]) -> None:
        self.files = {str(f): f.name for f in files}
        self.ran: set[tuple[str, int]] = set()

    def _local(self, frame, event, arg):
        if event == "line":
            self.ran.add((self.files[frame.f_code.co_filename], frame.f_lineno))
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.files else None

    def __enter__(self) -> LineRecorder:
        threading.settrace(self._global)
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


def test_example_built_from_the_page_runs_every_line_shown(
    doc_example, openai_style_gpt2, tiny_untied_llama, clean_plugins, tokenmill_log, capsys
):
    """The page's example package registers its parts from its distribution; the page's
    ``LLM(...)`` block runs on them with the log lines the page shows; with a Llama on the
    example platform too (its RMSNorm op), every line of the excerpts ran; the page's ``example-hello`` command prints what the page shows."""
    project = tomllib.loads(_doc_block("toml", "## How a plugin is found"))["project"]
    for kind, name in [
        ("platforms", "example"),
        ("attention_backends", "example-hnd"),
        ("models", "GPT2LMHeadModel"),
    ]:
        reg = plugins.get_registry(kind).get(name)
        assert (reg.plugin, reg.distribution) == ("example", project["name"])

    clean_plugins.setenv("TOKENMILL_EXAMPLE_PLATFORM", "1")
    package = doc_example / "tokenmill_example_plugin"
    shown = _excerpt_lines()
    built: list[LLM] = []

    def build(**kwargs) -> LLM:
        built.append(LLM(**kwargs, num_kv_blocks=16))
        return built[-1]

    replace_llm(clean_plugins, build)
    code = _the_block(ENGINE_BLOCK).replace("path/to/gpt2", str(openai_style_gpt2))
    namespace: dict = {}
    with LineRecorder([package / name for name in shown]) as recorder:
        platform = select_platform()
        assert platform.name == "example"
        attention = AttentionConfig(head_size=16, dtype=torch.float32)
        assert select_attention_backend(platform, attention).get_name() == "example-hnd"
        tokenmill_log.clear()
        exec(compile(code, "plugins.md: LLM(...)", "exec"), namespace)
        logged = [
            m
            for name, level, m in tokenmill_log
            if name == "tokenmill.plugins" and level == logging.INFO
        ]
        # a Llama has RMSNorms, which the platform's op computes
        assert len(_greedy(tiny_untied_llama, platform="example")) == GREEDY.max_tokens
    assert len(namespace["out"][0].outputs[0].token_ids) == 8
    assert logged == _doc_block("text", "## Which parts an engine uses").splitlines()
    for name, lines in shown.items():
        missed = sorted(
            (lines & _statement_lines(package / name)) - {n for f, n in recorder.ran if f == name}
        )
        assert not missed, f"{name}: lines {missed} shown on the page did not run"

    console = _doc_block("console", "Install the distribution and check what tokenmill sees:")
    command, expected = console.split("$ tokenmill example-hello", 1)[1].split("\n", 1)
    assert cli.main(["example-hello", *command.split()]) == 0
    assert capsys.readouterr().out == expected


# --- my_plugin: a model, a proposer and a quantization method --------------------------------


@pytest.fixture
def my_plugin(tmp_path, clean_plugins) -> Path:
    """``my_plugin``'s modules from the page, one entry point each, in distribution my-plugin."""
    package = tmp_path / "my_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, code in my_plugin_modules().items():
        (package / f"{module}.py").write_text(code)
    _write_distribution(
        tmp_path, "my-plugin", {f"my_plugin_{m}": f"my_plugin.{m}" for m in my_plugin_modules()}
    )
    clean_plugins.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    plugins.reload_plugins()
    return tmp_path


def _greedy(model: Path | str, **kwargs) -> list[int]:
    llm = LLM(model=str(model), num_kv_blocks=64, **kwargs)
    return (
        llm.generate({"prompt_token_ids": [5, 6, 7, 5, 6]}, GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def _renamed(src: Path, dst: Path, arch: str, rename=lambda name: name) -> Path:
    dst.mkdir()
    config = src.joinpath("config.json").read_text()
    dst.joinpath("config.json").write_text(config.replace('"LlamaForCausalLM"', f'"{arch}"'))
    tensors = load_file(src / "model.safetensors")
    save_file(
        {rename(n): t for n, t in tensors.items()},
        dst / "model.safetensors",
        metadata={"format": "pt"},
    )
    return dst


def test_model_block_serves_both_names(my_plugin, tiny_untied_llama, tmp_path):
    """``MyLlamaForCausalLM`` checkpoints load as Llamas; ``RenamedHeadLlamaForCausalLM`` ones
    with the head stored as ``output.*``: both give the plain Llama's tokens."""
    reference = _greedy(tiny_untied_llama)
    same = _renamed(tiny_untied_llama, tmp_path / "same", "MyLlamaForCausalLM")
    head = _renamed(
        tiny_untied_llama,
        tmp_path / "head",
        "RenamedHeadLlamaForCausalLM",
        lambda n: "output." + n.removeprefix("lm_head.") if n.startswith("lm_head.") else n,
    )
    assert "lm_head.weight" not in load_file(head / "model.safetensors")
    assert _greedy(same) == reference
    assert _greedy(head) == reference


def test_proposer_block_speculates_without_changing_tokens(
    my_plugin, tiny_untied_llama, monkeypatch
):
    from my_plugin.proposer import RepeatLastProposer

    calls = []
    propose = RepeatLastProposer.propose
    monkeypatch.setattr(
        RepeatLastProposer, "propose", lambda self, batch: calls.append(1) or propose(self, batch)
    )
    reference = _greedy(tiny_untied_llama)
    spec = {"method": "repeat-last", "num_speculative_tokens": 3}
    assert _greedy(tiny_untied_llama, speculative_config=spec) == reference
    assert calls


def test_quantization_block_stores_bf16_weights(my_plugin, tiny_untied_llama, monkeypatch):
    from my_plugin.quant import Bf16WeightsLinear

    dtypes = []
    apply = Bf16WeightsLinear.apply
    monkeypatch.setattr(
        Bf16WeightsLinear,
        "apply",
        lambda self, layer, x, bias: (
            dtypes.append(layer.weight.dtype) or apply(self, layer, x, bias)
        ),
    )
    assert len(_greedy(tiny_untied_llama, quantization="bf16-weights")) == GREEDY.max_tokens
    assert dtypes and set(dtypes) == {torch.bfloat16}


# --- runtime registration --------------------------------------------------------------------

MY_APP = {
    "models": """
        from tokenmill.models.llama import LlamaForCausalLM

        class MyLlama(LlamaForCausalLM):
            pass
    """,
    "npu": """
        from tokenmill.platforms.cpu import CpuPlatform

        class NpuPlatform(CpuPlatform):
            name = "my-npu"

            @classmethod
            def is_auto_selectable(cls) -> bool:
                return False
    """,
    "attn": """
        from tokenmill.attention_backends.torch_ref import TorchRefBackend

        class MyBackend(TorchRefBackend):
            pass
    """,
    "spec": """
        import numpy as np

        from tokenmill.interfaces import Proposal, ProposalBatch, Proposer

        class MyProposer(Proposer):
            def propose(self, batch: ProposalBatch) -> Proposal:
                k = batch.num_speculative_tokens
                last = batch.input_batch.token_ids[batch.rows, batch.input_batch.num_tokens[batch.rows] - 1]
                return Proposal(np.repeat(last[:, None], k, axis=1), np.full(len(batch.rows), k))
    """,
    "quant": """
        from tokenmill.quant.int8 import Int8Config

        class MyMethod(Int8Config):
            pass
    """,
}
"""The application the runtime-registration block imports from (module -> source)."""


def test_runtime_registration_block_parts_build_an_engine(
    tmp_path, clean_plugins, tiny_untied_llama, tokenmill_log
):
    package = tmp_path / "my_app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, source in MY_APP.items():
        (package / f"{module}.py").write_text(textwrap.dedent(source))
    clean_plugins.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    exec(compile(_the_block(RUNTIME_BLOCK), "plugins.md: runtime registration", "exec"), {})

    model = _renamed(tiny_untied_llama, tmp_path / "my", "MyLlamaForCausalLM")
    tokens = _greedy(
        model,
        platform="my-npu",
        attention_backend="my-attn",
        quantization="my-quant",
        speculative_config={"method": "my-spec", "num_speculative_tokens": 2},
    )
    assert len(tokens) == GREEDY.max_tokens
    used = {
        msg.split(":")[0]
        for name, level, msg in tokenmill_log
        if name == "tokenmill.plugins" and level == logging.INFO
    }
    assert {
        "using platform 'my-npu'",
        "using attention backend 'my-attn'",
        "using model 'MyLlamaForCausalLM'",
    } <= used
