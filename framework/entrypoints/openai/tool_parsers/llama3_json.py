"""Llama 3 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_marker = PYTHON_TAG

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        text = section.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :]
        return json_calls(text, "parameters")
