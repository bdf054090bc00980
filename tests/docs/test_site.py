"""The docs site: `mkdocs build --strict` passes (no broken link or anchor, no page missing from
the navigation, every API reference page rendered), the README's map names every page and
benchmarks/README.md every script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tokenmill.testing.layering import PUBLIC_API

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    for name in ["", *(f".{module}" for module in PUBLIC_API)]:
        page = (tmp_path / "api" / f"tokenmill{name}" / "index.html").read_text()
        assert 'class="doc doc-heading"' in page, f"tokenmill{name}: nothing rendered"


def test_readme_maps_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w/]+\.md)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages - linked == set(), "add these pages to the README's documentation table"


def test_benchmarks_readme_lists_every_script():
    index = (ROOT / "benchmarks" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", index, re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert listed == scripts
