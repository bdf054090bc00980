"""Complete tool calls in text made of JSON call objects, alone or in JSON arrays, as several
formats write them (Llama 3, Mistral, Granite, InternLM)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import parse_call


def json_calls(text: str, arguments_key: str = "arguments") -> list[dict[str, Any]]:
    """The complete ``{"name", "arguments"}`` calls of ``text``: JSON objects, or arrays of
    them, separated by whitespace, commas or semicolons; an array still open yields the
    objects it has closed so far."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        pos = _skip(text, pos, " \t\r\n,;[]")
        if pos >= len(text):
            return calls
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls
        for item in obj if isinstance(obj, list) else [obj]:
            call = parse_call(item, arguments_key)
            if call is None:
                return calls
            calls.append(call)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
