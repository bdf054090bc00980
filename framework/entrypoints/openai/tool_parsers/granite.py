"""IBM Granite tool calls: ``<|tool_call|>`` (Granite 3.0) or ``<tool_call>`` (3.1) then a
JSON array of ``{"name", "arguments"}`` objects."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    start_marker = MARKERS[0]
    markers_are_special_tokens = True
    other_start_markers = MARKERS[1:]

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(MARKERS):
            return len(text) - len(stripped)
        return None

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        text = section.lstrip()
        for marker in MARKERS:
            text = text.removeprefix(marker)
        return json_calls(text)
