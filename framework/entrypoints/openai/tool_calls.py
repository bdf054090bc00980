"""Tool calling on ``/v1/chat/completions``: checking ``tools`` / ``tool_choice``, the
structured-output constraint that enforces ``"required"`` and a named function, and turning
the model's output into OpenAI ``tool_calls``, whole or streamed.

- a named function: the output is constrained to the function's parameters schema and is
  that call's arguments; streamed, the call is sent once its arguments are whole JSON (or the
  output ended for another reason than ``length``), so a call cut short by ``max_tokens`` is
  left out streamed or not;
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one per call (at most one when ``parallel_tool_calls`` is false); streamed one
  complete call at a time;
- ``"auto"``: the model is free; the server's tool parser (``--tool-call-parser``) finds the
  calls in its output;
- ``"none"`` or no tools: plain content.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill import plugins
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    tool_call_id,
)
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def load_tool_parser(name: str) -> type[ToolParser]:
    """The registered tool parser ``name``; ``ValueError`` listing the registered ones."""
    return plugins.get_registry("tool_parsers").choose(name)


def tool_mode(
    request: ChatCompletionRequest, parser_cls: type[ToolParser] | None
) -> str | None:
    """``"named"``, ``"required"``, ``"auto"`` or None (plain content); a 400 for a
    ``tool_choice`` the request or server cannot honour."""
    choice = request.tool_choice
    if choice is not None and choice != "none" and not request.tools:
        raise OpenAIError("tool_choice needs tools to be set", param="tool_choice")
    if not request.tools or choice == "none":
        return None
    names = [t.function.name for t in request.tools]
    if len(set(names)) != len(names):
        raise OpenAIError("tools must have distinct function names", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise OpenAIError(
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"tools ({', '.join(names)})",
                param="tool_choice",
            )
        return "named"
    if choice == "required":
        return "required"
    if parser_cls is None:
        raise OpenAIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
            param="tool_choice",
        )
    return "auto"


def tool_constraint(request: ChatCompletionRequest, mode: str | None) -> StructuredOutputsParams | None:
    """The JSON schema that enforces a named or required tool choice."""
    assert request.tools is not None or mode is None
    if mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        tool = next(t for t in request.tools if t.function.name == request.tool_choice.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or EMPTY_PARAMETERS)
    if mode != "required":
        return None
    definitions: dict[str, Any] = {}
    items = []
    for t in request.tools:
        parameters = dict(t.function.parameters or EMPTY_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise OpenAIError(
                    f"tools define $defs.{name} differently; tool_choice=\"required\" needs "
                    "each name in $defs to mean one schema",
                    param="tools",
                )
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if definitions:
        # References ("#/$defs/...") resolve from the root of the schema they are in.
        schema["$defs"] = definitions
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def extract(
    request: ChatCompletionRequest,
    mode: str | None,
    parser: ToolParser | None,
    text: str,
    reason: str | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of a finished output (``reason``: its finish reason). A
    named call cut short (``length``) before its arguments are whole JSON is left out, as
    OpenAI leaves it out."""
    if mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        if not _named_call_whole(text, reason):
            return None, []
        name = request.tool_choice.function.name
        return None, [ToolCall(function=FunctionCall(name=name, arguments=text))]
    if mode == "required":
        calls = _required_calls(text, 0)[0]
        return (None, calls) if calls else (text, [])
    if mode == "auto":
        assert parser is not None
        info = parser.extract_tool_calls(text, request)
        return info.content, info.tool_calls
    return text, []


def finish_reason(mode: str | None, called: bool, reason: str | None) -> str | None:
    """OpenAI's: ``tool_calls`` when the model stopped after calling tools it chose (not
    for a named function, which OpenAI reports as ``stop``)."""
    if called and reason == "stop" and mode in ("required", "auto"):
        return "tool_calls"
    return reason


class ToolCallStream:
    """Turns the text deltas of one completion into ``DeltaMessage``s with ``tool_calls``."""

    def __init__(
        self, request: ChatCompletionRequest, mode: str | None, parser: ToolParser | None, index: int
    ) -> None:
        self.request = request
        self.mode = mode
        self.parser = parser
        self.index = index
        self.text = ""
        self.num_calls = 0
        self._call_id = tool_call_id()
        self._parsed_upto = 0

    def delta(self, delta_text: str, reason: str | None = None) -> DeltaMessage | None:
        """The message for the next ``delta_text``; ``reason``: the completion's finish reason
        once it has one."""
        previous, self.text = self.text, self.text + delta_text
        if self.mode is None:
            return DeltaMessage(content=delta_text) if delta_text else None
        if self.mode == "auto":
            assert self.parser is not None
            message = self.parser.extract_tool_calls_streaming(
                previous, self.text, delta_text, self.index
            )
            self.num_calls = self.parser.streamed_tool_calls(self.index)
            return message
        if self.mode == "named":
            return self._named(delta_text, reason)
        calls, self._parsed_upto = _required_calls(self.text, self._parsed_upto)
        if not calls:
            return None
        deltas = [
            DeltaToolCall(
                index=self.num_calls + i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]
        self.num_calls += len(deltas)
        return DeltaMessage(tool_calls=deltas)

    def _named(self, delta_text: str, reason: str | None) -> DeltaMessage | None:
        if self.num_calls == 0:
            if not _named_call_whole(self.text, reason):
                return None
            assert isinstance(self.request.tool_choice, NamedToolChoice)
            self.num_calls = 1
            function = DeltaFunctionCall(
                name=self.request.tool_choice.function.name, arguments=self.text
            )
            call = DeltaToolCall(index=0, id=self._call_id, type="function", function=function)
            return DeltaMessage(tool_calls=[call])
        if not delta_text:
            return None
        return DeltaMessage(
            tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))]
        )


def _required_calls(text: str, pos: int) -> tuple[list[ToolCall], int]:
    """The complete ``{"name", "parameters"}`` objects of the JSON array ``text`` from
    ``pos`` on (0: the start), and where parsing stopped."""
    decoder = json.JSONDecoder()
    calls = []
    while True:
        pos = _skip(text, pos, " \t\r\n[,")
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls, pos
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls, pos
        arguments = json.dumps(obj.get("parameters", {}), ensure_ascii=False)
        calls.append(ToolCall(function=FunctionCall(name=obj["name"], arguments=arguments)))
        pos = end


def _named_call_whole(text: str, reason: str | None) -> bool:
    """Whether a named call's output so far (``reason``: its finish reason, None while it
    runs) is a call to send: its arguments are whole JSON, or it ended other than cut short."""
    return reason not in (None, "length") or _is_json(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
