"""Llama 3 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, parse_call

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
        decoder = json.JSONDecoder()
        calls = []
        pos = 0
        while True:
            pos = _skip(text, pos, " \n\t;")
            if pos >= len(text):
                return calls
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return calls
            call = parse_call(obj, "parameters")
            if call is None:
                return calls
            calls.append(call)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
