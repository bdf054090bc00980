"""The web UI without a browser: the pages and assets served, the ``--disable-web-ui`` flag,
pages that are public but hold nothing of the server's, no request to another host, and the
files in the wheel. ``test_web_ui_browser.py`` drives the pages in Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer
from fastapi.testclient import TestClient

from tokenmill import cli
from tokenmill.entrypoints import serve
from tokenmill.entrypoints.web_ui import PAGES, WEB_DIR, web_files

ROOT = Path(__file__).resolve().parents[2]
KEY = "sekrit-key"
ASSETS = sorted(f"/ui/{name}" for name in web_files() if not name.endswith(".html"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    save_byte_tokenizer(path)
    return path


def serve_app(model: str, *flags: str):
    """The app ``tokenmill serve`` builds from these command-line flags."""
    args = cli.build_parser().parse_args(
        ["serve", "--model", model, "--no-engine-process", "--num-kv-blocks", "16", *flags]
    )
    return serve.make_app(args)


def test_pages_are_public_and_the_api_needs_the_key(tiny_model):
    with TestClient(serve_app(tiny_model, "--api-key", KEY, "--served-model-name", "tiny-x")) as c:
        for path in [*PAGES, *ASSETS]:
            response = c.get(path)
            assert response.status_code == 200, path
            assert "default-src 'none'" in response.headers["content-security-policy"]
            assert response.headers["x-content-type-options"] == "nosniff"
            assert b"tiny-x" not in response.content and KEY.encode() not in response.content
        assert c.get("/").headers["content-type"] == "text/html; charset=utf-8"
        assert c.get("/ui/chat.js").headers["content-type"] == "text/javascript; charset=utf-8"
        assert c.get("/ui/missing.js").status_code == 404
        assert c.get("/v1/models").status_code == 401
        models = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert [m["id"] for m in models.json()["data"]] == ["tiny-x"]


def test_disable_web_ui_flag_removes_every_page(tiny_model):
    with TestClient(serve_app(tiny_model, "--disable-web-ui")) as c:
        for path in [*PAGES, *ASSETS]:
            assert c.get(path).status_code == 404, path
        assert c.get("/health").status_code == 200


def test_pages_link_only_files_that_exist():
    names = set(web_files())
    for page in PAGES.values():
        html = (WEB_DIR / page).read_text()
        linked = re.findall(r'(?:src|href)="/ui/([^"]+)"', html)
        assert linked and set(linked) <= names, (page, linked)


def test_no_request_to_another_host():
    """No URL with a scheme or a host in any file (fonts, scripts, images: none from outside),
    no CSS import or url() and no dynamic script loading."""
    offenders = []
    for name, content in web_files().items():
        text = content.decode()
        for pattern in (
            r"[a-z][a-z0-9+.-]*://",
            r"""["'(=]\s*//[^/\s]""",
            r"@import",
            r"url\(",
            r"importScripts",
            r"import\(",
            r"createElement\(\s*[\"']script",
        ):
            offenders += [(name, m.group()) for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert not offenders


def test_wheel_ships_the_web_files(tmp_path):
    """A wheel built from a copy of the source tree holds every file of ``WEB_DIR``."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    source = tmp_path / "src"
    for folder in set(setuptools["package-dir"].values()):
        ignore = shutil.ignore_patterns("__pycache__", "*.safetensors")
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
    )
    [wheel] = (tmp_path / "dist").glob("tokenmill-*.whl")
    shipped = {
        Path(name).name
        for name in zipfile.ZipFile(wheel).namelist()
        if name.startswith("tokenmill/entrypoints/web/")
    }
    assert shipped == set(web_files())
