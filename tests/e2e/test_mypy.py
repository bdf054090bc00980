"""mypy passes in strict mode on ``tokenmill.interfaces`` (the plugin contracts),
``tokenmill.core`` and ``tokenmill.engine``, with the settings of pyproject.toml's
``[tool.mypy]``; run over a copy of the tree laid out as one package, as the editable install
maps six folders onto ``tokenmill``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenmill.testing import layering

ROOT = Path(__file__).resolve().parents[2]


def test_interfaces_core_and_engine_type_check_strictly(tmp_path):
    layering.namespace_copy(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--no-incremental", "--strict",
         "-p", "tokenmill.interfaces", "-p", "tokenmill.core", "-p", "tokenmill.engine"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
