"""MkDocs hook: the API reference pages, generated from the lists the code keeps.

One page for the user API (the names ``tokenmill`` exports) and one per module of the public
API that plugins may import (``tokenmill.testing.layering.PUBLIC_API``), each rendered by
mkdocstrings from the docstrings; the pages are added to the navigation under "API reference".
"""

from __future__ import annotations

import tokenmill
from mkdocs.structure.files import File, Files
from tokenmill.testing.layering import PUBLIC_API

SECTION = "API reference"


def api_pages() -> dict[str, str]:
    """Page path (under docs/) -> its Markdown."""
    user = "\n\n".join(_user_entry(name, module) for name, module in tokenmill._LAZY.items())
    pages = {
        "api/tokenmill.md": "# `tokenmill`: the user API\n\n"
        "What `from tokenmill import ...` gives an application.\n\n" + user + "\n",
    }
    for name, use in PUBLIC_API.items():
        pages[f"api/tokenmill.{name}.md"] = (
            f"# `tokenmill.{name}`\n\nPublic to plugins: {use}.\n\n::: tokenmill.{name}\n"
        )
    return pages


def _user_entry(name: str, module: str) -> str:
    """Rendered here, or a link to the public module's page that renders it."""
    public = module.split(".")[1]
    if public in PUBLIC_API:
        return f"`{name}`: see [`tokenmill.{public}.{name}`][{module}.{name}]."
    return f"::: {module}.{name}\n    options:\n      show_root_heading: true"


def on_config(config):
    nav = config["nav"]
    [entry] = [item for item in nav if isinstance(item, dict) and SECTION in item]
    entry[SECTION] = [entry[SECTION], *api_pages()]
    return config


def on_files(files: Files, config) -> Files:
    for path, content in api_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
