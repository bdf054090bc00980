"""Pythonic tool calls: a Python list of calls, ``[get_weather(city="Paris"), get_time()]``
(Llama 3.2, ToolACE); ``llama4_pythonic`` also takes it between ``<|python_start|>`` and
``<|python_end|>``. Argument values are Python literals."""

from __future__ import annotations

import ast
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    start_marker = "["

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.start_marker) else None

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        """The calls of the longest prefix of ``section`` that closes after a call."""
        text = section.strip()
        if text.endswith("]"):
            calls = _parse(text)
            if calls is not None:
                return calls
        end = text.rfind(")")
        while end > 0:
            calls = _parse(text[: end + 1] + "]")
            if calls is not None:
                return calls
            end = text.rfind(")", 0, end)
        return []


class Llama4PythonicToolParser(PythonicToolParser):
    start_marker = PYTHON_START
    markers_are_special_tokens = True
    other_start_markers = ("[",)

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_START) or stripped.startswith("["):
            return len(text) - len(stripped)
        return None

    def complete_calls(self, section: str) -> list[dict[str, Any]]:
        text = section.strip().removeprefix(PYTHON_START).split(PYTHON_END, 1)[0]
        return super().complete_calls(text)


def _parse(text: str) -> list[dict[str, Any]] | None:
    """The calls of ``text``, a Python list of calls with literal keyword arguments; None if
    it is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        if None in arguments:
            return None
        calls.append({"name": node.func.id, "arguments": arguments})
    return calls
