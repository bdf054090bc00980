"""mypy passes on ``tokenmill.interfaces`` (the plugin contracts), with the settings of
pyproject.toml's ``[tool.mypy]``; run over a copy of the tree laid out as one package, as the
editable install maps six folders onto ``tokenmill``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenmill.testing import layering

ROOT = Path(__file__).resolve().parents[2]


def test_interfaces_type_check(tmp_path):
    layering.namespace_copy(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--no-incremental", "-p", "tokenmill.interfaces"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
