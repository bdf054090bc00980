"""InternLM2 tool calls: ``<|action_start|><|plugin|>`` then one ``{"name", "parameters"}``
JSON object, closed by ``<|action_end|>``, optionally after some content."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import json_calls

PLUGIN = "<|plugin|>"
END = "<|action_end|>"


class InternLM2ToolParser(ToolParser):
    start_marker = "<|action_start|>"

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Keep the action markers, special tokens, in the text."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def find_start(self, text: str) -> int | None:
        start = text.find(self.start_marker)
        return None if start < 0 else start

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        body = section[len(self.start_marker) :].lstrip().removeprefix(PLUGIN)
        if END not in body:
            return []
        return json_calls(body.split(END, 1)[0], "parameters")[:1]
