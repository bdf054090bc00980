"""``tokenmill.envs``: every ``TOKENMILL_*`` variable is read through it, at access time, with
its type and default, documented, and listed by ``tokenmill --help``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import help_without_torch
from tokenmill import envs
from tokenmill.envs import ENVIRONMENT_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = (
    "framework", "platforms", "attention_backends", "models", "spec_decode", "quant", "benchmarks"
)
ENVS_PY = ROOT / "framework" / "envs.py"
EXAMPLE_OWN = {"TOKENMILL_EXAMPLE_PLATFORM"}
"""The example plugin's own switch, read and documented by that distribution."""

NAME = re.compile(r"TOKENMILL_[A-Z0-9_]+")


def _sources() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return [*files, ROOT / "tests" / "conftest.py"]


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and NAME.fullmatch(str(node.value)) is not None


def _stray_reads(tree: ast.AST) -> list[ast.AST]:
    """``os.environ.get("TOKENMILL_X")``, ``os.getenv(...)``, ``os.environ[...]``,
    ``"TOKENMILL_X" in os.environ``, and a name kept aside to read later
    (``KEY = "TOKENMILL_X"``)."""
    strays: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            source, keys = node.func, node.args
        elif isinstance(node, ast.Subscript):
            source, keys = node.value, [node.slice]
        elif isinstance(node, ast.Compare):
            source, keys = node.comparators[-1], [node.left]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            strays += [node] if _is_name(node.value) else []
            continue
        else:
            continue
        if re.search(r"environ|getenv", ast.unparse(source)):
            strays += [key for key in keys if _is_name(key)]
    return strays


def test_no_variable_is_read_outside_envs():
    strays = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _sources()
        if path != ENVS_PY
        for node in _stray_reads(ast.parse(path.read_text(), str(path)))
    ]
    assert not strays, "read these through tokenmill.envs:\n" + "\n".join(strays)


@pytest.mark.parametrize(
    "line",
    [
        'os.environ.get("TOKENMILL_A")',
        'os.getenv("TOKENMILL_A", "1")',
        'environ["TOKENMILL_A"]',
        '"TOKENMILL_A" in os.environ',
        'KEY = "TOKENMILL_A"',
    ],
)
def test_stray_read_is_found(line):
    assert len(_stray_reads(ast.parse(line))) == 1


def test_every_mentioned_variable_is_in_envs():
    texts = [p.read_text() for p in _sources()]
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    texts += [p.read_text() for p in docs]
    mentioned = {name for text in texts for name in NAME.findall(text)}
    assert mentioned - EXAMPLE_OWN - set(ENVIRONMENT_VARIABLES) == set()


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("TOKENMILL_CPU_THREADS", None, None),
        ("TOKENMILL_CPU_THREADS", "3", 3),
        ("TOKENMILL_CPU_KVCACHE_SPACE", None, 2.0),
        ("TOKENMILL_CPU_KVCACHE_SPACE", "0.5", 0.5),
        ("TOKENMILL_DISABLE_CPU_KERNELS", "", False),
        ("TOKENMILL_DISABLE_CPU_KERNELS", "1", True),
        ("TOKENMILL_DISABLE_CPU_KERNELS", "0", False),
        ("TOKENMILL_CONFIGURE_LOGGING", "False", False),
        ("TOKENMILL_CONFIGURE_LOGGING", None, True),
        ("TOKENMILL_PLUGINS", " models , example ,", ["models", "example"]),
        ("TOKENMILL_PLUGINS", " , ", None),
        ("TOKENMILL_PLATFORM", "cpu", "cpu"),
        ("TOKENMILL_LOGGING_LEVEL", " ", "INFO"),
    ],
)
def test_values_are_read_when_accessed(monkeypatch, name, text, value):
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert getattr(envs, name) == value


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("TOKENMILL_CPU_THREADS", "four", "TOKENMILL_CPU_THREADS='four' is not a valid int: "),
        (
            "TOKENMILL_DISABLE_CPU_KERNELS",
            "maybe",
            "TOKENMILL_DISABLE_CPU_KERNELS='maybe' is not a valid bool: expected one of 1, true, "
            "yes, on, 0, false, no, off",
        ),
    ],
)
def test_bad_value_is_an_error_naming_the_variable(monkeypatch, name, text, message):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as err:
        getattr(envs, name)
    assert str(err.value).startswith(message)


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        _ = envs.TOKENMILL_NO_SUCH_VARIABLE
    assert set(ENVIRONMENT_VARIABLES) <= set(dir(envs))


def test_help_lists_every_variable_without_importing_torch():
    done = help_without_torch({"COLUMNS": "100", "PATH": "/usr/bin:/bin"})
    epilog = " ".join(done.stdout.partition("\nenvironment variables:\n")[2].split())
    for name, var in ENVIRONMENT_VARIABLES.items():
        assert f"{name} {var.describe()}" in epilog
