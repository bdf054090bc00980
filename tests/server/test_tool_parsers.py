"""Tool-call parsers and the tool-choice helpers, without a model: whole outputs and streams
cut at every character give the same calls and content."""

from __future__ import annotations

import json

import pytest

from tokenmill import plugins
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.tool_calls import (
    ToolCallStream,
    extract,
    load_tool_parser,
    tool_constraint,
    tool_mode,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    )


def _stream_all(stream: ToolCallStream, text: str) -> tuple[str, dict[int, dict]]:
    content = ""
    calls: dict[int, dict] = {}
    for ch in text:
        delta = stream.delta(ch)
        if delta is None:
            continue
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": "", "id": piece.id})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    return content, calls


HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'

MISTRAL = 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
GRANITE = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
GRANITE_31 = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}},\n{"name": "get_time", "arguments": {}}]'
PYTHONIC = '[get_weather(city="Paris"), get_time()]'
PYTHONIC_PAREN = '[get_weather(city="Paris (FR)"), get_time()]'
LLAMA4 = '<|python_start|>[get_weather(city="Paris"), get_time()]<|python_end|>'
FORMATS = [
    ("hermes", HERMES, "Let me check."),
    ("llama3_json", LLAMA, None),
    ("mistral", MISTRAL, "Let me check."),
    ("granite", GRANITE, None),
    ("granite", GRANITE_31, None),
    ("pythonic", PYTHONIC, None),
    ("llama4_pythonic", LLAMA4, None),
    ("llama4_pythonic", PYTHONIC, None),
]


@pytest.mark.parametrize("name, text, content", FORMATS)
def test_parsers_whole_and_streamed(name, text, content):
    parser_cls = load_tool_parser(name)
    request = _request(tool_choice="auto")
    info = parser_cls(None).extract_tool_calls(text, request)
    assert info.tools_called and info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    streamed_content, calls = _stream_all(ToolCallStream(request, "auto", parser_cls(None), 0), text)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["id"] for c in calls.values())


def test_internlm_whole_and_streamed():
    """InternLM2 makes one call per action block."""
    text = 'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>'
    parser_cls = load_tool_parser("internlm")
    request = _request(tool_choice="auto")
    info = parser_cls(None).extract_tool_calls(text, request)
    assert info.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content, calls = _stream_all(ToolCallStream(request, "auto", parser_cls(None), 0), text)
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_pythonic_arguments_are_literals():
    parser = load_tool_parser("pythonic")(None)
    info = parser.extract_tool_calls(PYTHONIC_PAREN, _request(tool_choice="auto"))
    assert json.loads(info.tool_calls[0].function.arguments) == {"city": "Paris (FR)"}
    for text in ("[get_weather(city=x)]", "[print('hi')]", "[1, 2]"):
        assert not parser.extract_tool_calls(text, _request(tool_choice="auto")).tools_called


@pytest.mark.parametrize(
    "name", ["hermes", "llama3_json", "mistral", "granite", "internlm", "pythonic", "llama4_pythonic"]
)
def test_parsers_leave_plain_answers_alone(name):
    parser = load_tool_parser(name)(None)
    text = "Paris is sunny <tool today."
    info = parser.extract_tool_calls(text, _request(tool_choice="auto"))
    assert not info.tools_called and info.content == text
    content, calls = _stream_all(ToolCallStream(_request(), "auto", parser, 0), text)
    assert not calls and content.startswith("Paris is sunny ")


def test_required_and_named_outputs():
    request = _request(tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = extract(request, "required", None, text)
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    _, streamed = _stream_all(ToolCallStream(request, "required", None, 0), text)
    assert [json.loads(c["arguments"]) for c in streamed.values()] == [{"city": "Rome"}, {}]
    named = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, streamed = _stream_all(ToolCallStream(named, "named", None, 0), '{"city": "Oslo"}')
    assert streamed == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}', "id": streamed[0]["id"]}}
    cut = ToolCallStream(named, "named", None, 0)
    assert [cut.delta(ch) for ch in '{"city": "Os'] == [None] * 12
    assert cut.delta('l', "length") is None and extract(named, "named", None, cut.text, "length") == (None, [])
    ended = ToolCallStream(named, "named", None, 0)
    assert ended.delta('{"city"') is None
    [call] = ended.delta("", "stop").tool_calls
    assert call.function.arguments == '{"city"' == extract(named, "named", None, ended.text, "stop")[1][0].function.arguments


def test_tool_choice_checks_and_constraints():
    parser = load_tool_parser("hermes")
    assert tool_mode(_request(tool_choice="none"), parser) is None
    assert tool_mode(_request(), parser) == "auto"
    with pytest.raises(OpenAIError, match="enable-auto-tool-choice"):
        tool_mode(_request(tool_choice="auto"), None)
    with pytest.raises(OpenAIError, match="not in tools"):
        tool_mode(_request(tool_choice={"type": "function", "function": {"name": "x"}}), parser)
    required = tool_constraint(_request(tool_choice="required", parallel_tool_calls=False), "required")
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    named = _request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_constraint(named, "named").json == {"type": "object", "properties": {}}


def test_unknown_parser_lists_the_registered_ones():
    with pytest.raises(ValueError, match="granite, hermes, internlm, llama3_json, llama4_pythonic"):
        plugins.get_registry("tool_parsers").get("nope")
