"""Tool calling and structured outputs over HTTP: the official ``openai`` client's ``tools=``
round trip on the default model, streamed and not, and the 400s for bad tool choices and
constraints that do not compile."""

from __future__ import annotations

import json

import pytest

from server.test_server import MODEL, assert_openai_error

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_server):
    """The shared server, which runs the Hermes tool-call parser; left idle for the next module."""
    yield default_server
    default_server.wait_idle()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _check_call(name: str, arguments: str) -> dict:
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def _answer_with_result(client, call_id: str, name: str, arguments: str) -> str:
    messages = QUESTION + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees and sunny"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    )
    assert out.choices[0].message.tool_calls in (None, [])
    return out.choices[0].message.content


def test_required_round_trip(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    _check_call(call.function.name, call.function.arguments)
    assert _answer_with_result(client, call.id, call.function.name, call.function.arguments)


def test_required_round_trip_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or piece.id
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    [call] = calls.values()
    _check_call(call["name"], call["arguments"])
    assert _answer_with_result(client, call["id"], call["name"], call["arguments"])


def test_named_function_streams_its_call_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0
    )
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "stop"
    _check_call("get_weather", call.function.arguments)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=60,
        temperature=0, stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    pieces = [c.delta.tool_calls for c in chunks if c.delta.tool_calls]
    assert pieces[0][0].function.name == "get_weather" and pieces[0][0].id
    assert "".join(p[0].function.arguments or "" for p in pieces) == call.function.arguments
    assert json.loads(pieces[0][0].function.arguments), "sent once its arguments are whole JSON"
    assert chunks[-1].finish_reason == "stop"


def test_auto_choice_answers_with_content_or_parsed_calls(client):
    for stream in (False, True):
        out = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0, stream=stream
        )
        if stream:
            chunks = [c.choices[0] for c in out if c.choices]
            content = "".join(c.delta.content or "" for c in chunks)
            calls = [t for c in chunks for t in c.delta.tool_calls or []]
            finish = chunks[-1].finish_reason
        else:
            content, calls = out.choices[0].message.content, out.choices[0].message.tool_calls
            finish = out.choices[0].finish_reason
        assert "<tool_call>" not in (content or "")
        if calls:
            assert finish == "tool_calls"
            for call in calls:
                json.loads(call.function.arguments)
        else:
            assert content


def test_response_format_and_guided_fields(server, client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        max_tokens=30,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = client.completions.create(
        model=MODEL, prompt="Colour:", max_tokens=8, temperature=1.0,
        extra_body={"guided_choice": ["red", "blue"]}, n=4, seed=3,
    )
    assert {c.text for c in out.choices} <= {"red", "blue"}
    out = client.completions.create(
        model=MODEL, prompt="Year:", max_tokens=8, temperature=1.0,
        extra_body={"structured_outputs": {"regex": "19[0-9]{2}"}},
    )
    assert out.choices[0].text.startswith("19") and len(out.choices[0].text) == 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_json": {"type": "nonsense"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_tools_and_constraints_are_400(server, body, param):
    message = assert_openai_error(
        server.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, **body}), 400, param
    )
    assert message


def test_still_serving_after_bad_requests(server, client):
    bad = server.post("/v1/chat/completions", {"messages": QUESTION, "guided_json": {"type": "nonsense"}})
    assert "nonsense" in assert_openai_error(bad, 400)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert out.choices[0].message.content
