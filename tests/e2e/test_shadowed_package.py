"""``python -m tokenmill`` from a folder holding a directory named ``tokenmill`` (a checkout):
Python imports that directory as a namespace package instead of the installed tokenmill, and
the command says so."""

from __future__ import annotations

import subprocess
import sys


def _python_m_tokenmill(cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill", "--help"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_shadowing_folder_is_named(tmp_path):
    (tmp_path / "tokenmill").mkdir()
    proc = _python_m_tokenmill(tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"error: Python imported {tmp_path / 'tokenmill'} as the package 'tokenmill' (a folder "
        "without __init__.py, such as a checkout named tokenmill in the current directory), not "
        "the installed tokenmill; run from another directory or use the `tokenmill` command\n"
    )


def test_without_one_the_command_runs(tmp_path):
    proc = _python_m_tokenmill(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tokenmill")
