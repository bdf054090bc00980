"""Hermes / Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, optionally after some content."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, parse_call

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Hermes2ProToolParser(ToolParser):
    start_marker = "<tool_call>"
    markers_are_special_tokens = True

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        calls = []
        for block in _BLOCK.findall(section):
            try:
                call = parse_call(json.loads(block), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                break
            calls.append(call)
        return calls
