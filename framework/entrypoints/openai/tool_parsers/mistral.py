"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``
objects, optionally after some content."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls


class MistralToolParser(ToolParser):
    start_marker = "[TOOL_CALLS]"
    markers_are_special_tokens = True

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        return json_calls(section[len(self.start_marker) :])
