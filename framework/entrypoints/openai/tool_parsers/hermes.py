"""Hermes / Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, optionally after some content."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, parse_call

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Hermes2ProToolParser(ToolParser):
    start_marker = "<tool_call>"

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep ``<tool_call>`` in the text where the tokenizer makes it a special token."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def find_start(self, text: str) -> int | None:
        start = text.find(self.start_marker)
        return None if start < 0 else start

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
