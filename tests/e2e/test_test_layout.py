"""tests/ follows the source layout (docs/testing.md): no test module at the top, each folder
documented, no two test files with one name (pytest imports them by file name)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_only_conftest_at_the_top():
    assert [p.name for p in TESTS.glob("*.py")] == ["conftest.py"]


def test_every_folder_is_documented():
    documented = set(re.findall(r"^\| `tests/(\w+)/` \|", (TESTS.parent / "docs" / "testing.md").read_text(), re.M))
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == documented


def test_test_file_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
