"""InternLM2 tool calls: ``<|action_start|><|plugin|>`` then one ``{"name", "parameters"}``
JSON object, closed by ``<|action_end|>``, optionally after some content."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls

PLUGIN = "<|plugin|>"
END = "<|action_end|>"


class InternLM2ToolParser(ToolParser):
    start_marker = "<|action_start|>"
    markers_are_special_tokens = True

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        body = section[len(self.start_marker) :].lstrip().removeprefix(PLUGIN)
        if END not in body:
            return []
        return json_calls(body.split(END, 1)[0], "parameters")[:1]
