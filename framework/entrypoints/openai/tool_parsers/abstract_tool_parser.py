"""The interface of a tool-call parser (vLLM's ``ToolParser``): it finds the tool calls in a
model's text output, whole or as it streams."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_call_id,
)


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None
    """The text outside the tool calls; None when there is none."""


@dataclass
class _StreamState:
    content_sent: int = 0
    calls_sent: int = 0


class ToolParser(ABC):
    """A format of tool calls in text. A subclass says where the tool-call section of an
    output starts (``find_start``) and which complete calls it holds so far
    (``complete_calls``); extraction, whole and streamed, is built on those two.

    Streaming sends the text before the section as content, holding back a tail that may
    still become the section's start marker, and each tool call once it is complete (its
    name and whole arguments in one delta)."""

    start_marker: str = ""
    """The text that opens the tool-call section, held back while it may be forming."""
    other_start_markers: tuple[str, ...] = ()
    """Other texts that may open it, held back likewise."""
    markers_are_special_tokens: bool = False
    """The format's markers are special tokens: requests with tools keep them in the text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[int, _StreamState] = {}

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before it runs: by default, keep the special tokens the format
        uses (``markers_are_special_tokens``) when the request has tools."""
        if self.markers_are_special_tokens and request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def find_start(self, text: str) -> int | None:
        """Where the tool-call section of ``text`` starts, or None if it has not begun: by
        default, where ``start_marker`` first occurs."""
        start = text.find(self.start_marker)
        return None if start < 0 else start

    @abstractmethod
    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        """The complete calls in the tool-call section so far, as ``{"name", "arguments"}``."""

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        """The tool calls and remaining content of a finished output."""
        start = self.find_start(model_output)
        calls = [] if start is None else self.complete_calls(model_output[start:])
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[:start].strip() or None
        return ExtractedToolCallInformation(True, [_tool_call(c) for c in calls], content)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, index: int = 0
    ) -> DeltaMessage | None:
        """What to stream for completion ``index`` now that its text grew from
        ``previous_text`` to ``current_text`` by ``delta_text``; None for nothing yet."""
        state = self._streams.setdefault(index, _StreamState())
        start = self.find_start(current_text)
        if start is None:
            visible = _without_marker_prefix(
                current_text, (self.start_marker, *self.other_start_markers)
            )
            calls: list[dict[str, Any]] = []
        else:
            visible = current_text[:start]
            calls = self.complete_calls(current_text[start:])
        content = visible[state.content_sent :] if len(visible) > state.content_sent else ""
        state.content_sent = max(state.content_sent, len(visible))
        new_calls = [
            DeltaToolCall(
                index=state.calls_sent + i,
                id=tool_call_id(),
                type="function",
                function=DeltaFunctionCall(name=c["name"], arguments=_arguments_text(c)),
            )
            for i, c in enumerate(calls[state.calls_sent :])
        ]
        state.calls_sent += len(new_calls)
        if not content and not new_calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=new_calls or None)

    def streamed_tool_calls(self, index: int = 0) -> int:
        """How many tool calls the stream of completion ``index`` has sent."""
        state = self._streams.get(index)
        return state.calls_sent if state else 0


def _without_marker_prefix(text: str, markers: tuple[str, ...]) -> str:
    """``text`` less the longest tail that could be the beginning of one of ``markers``."""
    for n in range(min(max(map(len, markers)), len(text)), 0, -1):
        if any(marker.startswith(text[-n:]) for marker in markers):
            return text[:-n]
    return text


def _arguments_text(call: dict[str, Any]) -> str:
    arguments = call["arguments"]
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _tool_call(call: dict[str, Any]) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call["name"], arguments=_arguments_text(call)))


def parse_call(obj: Any, arguments_key: str) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` from a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return {"name": obj["name"], "arguments": arguments}
