"""The import rules (R1-R3 in docs/plugins.md), checked by import-linter over a copy of the
installed tree: they hold, a forbidden import breaks them with its module named, and the docs'
public-API table is the code's list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenmill.testing import layering

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return layering.namespace_copy(tmp_path_factory.mktemp("namespace"))


def lint(root: Path, contracts=layering.contracts) -> tuple[int, str]:
    config = root / f"{contracts.__name__}.toml"
    config.write_text(contracts(root))
    result = layering.lint_imports(root, config)
    return result.returncode, result.stdout + result.stderr


def test_the_rules_hold(tree):
    code, out = lint(tree)
    assert code == 0, out
    assert re.search(r"Contracts: 4 kept, 0 broken", out), out


def test_base_modules_import_only_base_modules(tree):
    code, out = lint(tree, layering.base_contract)
    assert code == 0, out
    assert re.search(r"Contracts: 1 kept, 0 broken", out), out


def test_a_base_module_importing_the_core_breaks_the_rule(tmp_path):
    root = layering.namespace_copy(tmp_path)
    path = root / "tokenmill" / "config.py"
    path.write_text(path.read_text() + "\n\ndef _added():\n    from tokenmill.selector import select_platform\n")
    code, out = lint(root, layering.base_contract)
    assert code != 0
    assert "tokenmill.config -> tokenmill.selector" in out.replace("\n", " "), out


@pytest.mark.parametrize(
    "module, statement, broken",
    [
        ("platforms/cpu.py", "from tokenmill.worker import model_runner", "tokenmill.platforms.cpu -> tokenmill.worker.model_runner"),
        ("interfaces/proposer.py", "import tokenmill.engine.llm_engine", "tokenmill.interfaces.proposer -> tokenmill.engine.llm_engine"),
        ("layers/linear.py", "from tokenmill.quant import int8", "tokenmill.layers.linear -> tokenmill.quant.int8"),
        ("models/llama.py", "import tokenmill.spec_decode.ngram", "tokenmill.models.llama -> tokenmill.spec_decode.ngram"),
    ],
    ids=["R3-worker", "R1", "R2", "R3-other-plugin"],
)
def test_a_forbidden_lazy_import_breaks_a_rule(tmp_path, module, statement, broken):
    root = layering.namespace_copy(tmp_path)
    path = root / "tokenmill" / module
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {statement}\n")
    code, out = lint(root)
    assert code != 0
    assert broken in out.replace("\n", " "), out


def test_the_one_import_circle_is_the_executor_factory(tree):
    """``Executor.get_class`` names its subclasses, which subclass it (as vLLM's)."""
    assert layering.import_cycles(tree) == [
        ["tokenmill.worker.executor", "tokenmill.worker.multiproc_executor", "tokenmill.worker.ray_executor"]
    ]


def test_docs_show_the_public_api_list():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    shown = re.search(r"<!-- public-api[^\n]*-->\n(.*?)\n<!-- /public-api -->", docs, re.S)
    assert shown is not None, "docs/plugins.md lost its public-api table markers"
    assert shown.group(1) == layering.public_api_table()


def test_first_party_plugin_packages_import_only_the_public_api(tree):
    for package in layering.PLUGIN_PACKAGES:
        assert layering.public_api_violations(f"tokenmill.{package}", tree) == [], package
