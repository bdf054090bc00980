"""``pyproject.toml``'s package list matches the source tree: every folder with an
``__init__.py`` under a mapped package folder is listed, nothing else is, and no folder of
modules lacks its ``__init__.py`` (it would not be installed)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_package_list_matches_the_source_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = setuptools["packages"]
    in_tree = set()
    for package, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            in_tree.add(".".join((package, *init.parent.relative_to(base).parts)))
        for module in base.rglob("*.py"):
            assert (module.parent / "__init__.py").exists(), f"{module.parent} has no __init__.py"
    assert len(listed) == len(set(listed)), "a package is listed twice"
    assert set(listed) == in_tree
