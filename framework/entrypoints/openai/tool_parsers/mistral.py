"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``
objects, optionally after some content."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls


class MistralToolParser(ToolParser):
    start_marker = "[TOOL_CALLS]"

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep ``[TOOL_CALLS]``, a special token, in the text."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def find_start(self, text: str) -> int | None:
        start = text.find(self.start_marker)
        return None if start < 0 else start

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        return json_calls(section[len(self.start_marker) :])
