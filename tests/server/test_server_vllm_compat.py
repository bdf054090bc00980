"""vLLM's extensions of the OpenAI API (issue 38), end to end: one real ``tokenmill serve``
with vLLM's server flags (a chat template of our own, ``--return-tokens-as-token-ids``,
``--enable-force-include-usage``, ``--enable-request-id-headers``, ``--root-path``, an API
key), driven by the official ``openai`` client and raw HTTP; token ids are compared with the
tokenizer's."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from server.test_server import MODEL, PROMPT, RemoteServer, assert_openai_error

openai = pytest.importorskip("openai")

API_KEY = "sk-compat"
ROOT = "/api"
TEMPLATE = (
    "{%- for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% for d in documents or [] %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}"
    "{% if greeting is defined %}<greeting>{{ greeting }}</greeting>{% endif %}"
    "{% for t in tools or [] %}<tool {{ t['function']['name'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Renders every input it gets (content parts, documents, a ``greeting`` kwarg, tools), so a
test can see what reached it; it loops over content, so ``auto`` picks the ``openai``
content format."""
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
    srv = RemoteServer(
        "--chat-template",
        str(path),
        "--trust-request-chat-template",
        "--return-tokens-as-token-ids",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
        "--enable-tokenizer-info-endpoint",
        "--root-path",
        ROOT,
        "--scheduling-policy",
        "priority",
        "--enable-server-load-tracking",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "pythonic",
        api_key=API_KEY,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def tokenize(server: RemoteServer, body: dict) -> list[int]:
    response = server.post("/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(server: RemoteServer, tokens: list[int]) -> str:
    response = server.post("/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_return_token_ids_completions(server, client, default_tokenizer):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.prompt_token_ids == default_tokenizer.encode(PROMPT)
    assert len(choice.token_ids) == out.usage.completion_tokens == 6
    assert default_tokenizer.decode(choice.token_ids) == choice.text
    stream = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for c in chunks for t in c.token_ids or []] == choice.token_ids
    for value in (False, None):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "return_token_ids": value}
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        raw = response.json()["choices"][0]
        assert raw["prompt_token_ids"] is None and raw["token_ids"] is None


def test_return_token_ids_chat(server, client, default_tokenizer):
    out = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=0,
        extra_body={"return_token_ids": True},
    )
    expected_prompt = "<|user|>[Name a colour.]<|assistant|>"
    expected_ids = default_tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert out.prompt_token_ids == expected_ids
    assert out.prompt_token_ids == tokenize(server, {"messages": USER})
    assert default_tokenizer.decode(out.choices[0].token_ids) == out.choices[0].message.content
    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert stream[0].prompt_token_ids == out.prompt_token_ids
    streamed = [t for c in stream for choice in c.choices for t in choice.token_ids or []]
    assert streamed == out.choices[0].token_ids
    raw = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2}).json()
    assert raw["prompt_token_ids"] is None and raw["choices"][0]["token_ids"] is None


def test_return_tokens_as_token_ids(client):
    """The server flag spells logprob tokens ``token_id:<id>``; a request may turn it off."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    out = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    assert all(k.startswith("token_id:") for top in logprobs.top_logprobs for k in top)
    plain = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": False})
    assert "".join(plain.choices[0].logprobs.tokens) == plain.choices[0].text
    assert plain.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert content[0].bytes == list(content[0].token.encode())


def test_truncate_prompt_tokens(server, client, default_tokenizer):
    text = "one two three four five six seven eight nine ten"
    full = default_tokenizer.encode(text)
    for side, kept in (("left", full[-4:]), ("right", full[:4])):
        out = client.completions.create(
            model=MODEL, prompt=text, max_tokens=2, temperature=0,
            extra_body={
                "truncate_prompt_tokens": 4, "truncation_side": side, "return_token_ids": True
            },
        )
        assert out.usage.prompt_tokens == 4 and out.choices[0].prompt_token_ids == kept
        by_ids = client.completions.create(model=MODEL, prompt=kept, max_tokens=2, temperature=0)
        assert by_ids.choices[0].text == out.choices[0].text
    out = client.completions.create(
        model=MODEL, prompt=full, max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert out.usage.prompt_tokens == len(full)
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
    )
    assert chat.prompt_token_ids == tokenize(server, {"messages": USER})[-3:]
    for value in (10**6, -2):
        body = {"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": value}
        assert_openai_error(server.post("/v1/completions", body), 400, "truncate_prompt_tokens")


def test_chat_template_receives_kwargs_documents_and_content_parts(server, client):
    documents = [{"title": "T", "text": "Paris is in France."}]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    options = {"chat_template_kwargs": {"greeting": "hello"}, "documents": documents}
    tokens = tokenize(server, {"messages": messages, **options})
    assert detokenize(server, tokens) == (
        "<|user|>[a][b]<doc T>Paris is in France.</doc><greeting>hello</greeting><|assistant|>"
    )
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0,
        extra_body={**options, "return_token_ids": True},
    )
    assert out.prompt_token_ids == tokens
    for kwargs in ({"tools": 1}, {"add_generation_prompt": 1}, "x"):
        body = {"messages": USER, "chat_template_kwargs": kwargs}
        assert_openai_error(server.post("/v1/chat/completions", body), 400, "chat_template_kwargs")
        message = assert_openai_error(server.post("/tokenize", body), 400, "chat_template_kwargs")
        assert "Tokenize" not in message


def test_continue_final_message_and_echo(server, client):
    messages = [*USER, {"role": "assistant", "content": "My favourite colour is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    tokens = tokenize(server, {"messages": messages, **options})
    assert detokenize(server, tokens).endswith("<|assistant|>[My favourite colour is")
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0,
        extra_body={**options, "return_token_ids": True},
    )
    assert out.prompt_token_ids == tokens
    echoed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0,
        extra_body={**options, "echo": True},
    )
    reply = out.choices[0].message.content
    assert echoed.choices[0].message.content == "My favourite colour is" + reply
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        extra_body={**options, "echo": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content
    not_echoed = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert not not_echoed.choices[0].message.content.startswith(USER[0]["content"])
    body = {"messages": messages, "continue_final_message": True}
    assert_openai_error(server.post("/v1/chat/completions", body), 400, "continue_final_message")
    assert_openai_error(server.post("/tokenize", body), 400, "continue_final_message")


def test_logprobs_of_the_whole_vocabulary(server, client):
    """``-1`` returns every token's logprob: their probabilities sum to 1."""
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, temperature=0, logprobs=True, top_logprobs=-1,
        extra_body={"return_tokens_as_token_ids": False},
    )
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert math.fsum(math.exp(t.logprob) for t in top) == pytest.approx(1, abs=1e-3)
    assert top[0].token == chat.choices[0].message.content
    body = {"prompt": "Hi there", "max_tokens": 1, "prompt_logprobs": -1}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    steps = response.json()["choices"][0]["prompt_logprobs"]
    assert steps[0] is None and len(steps) == 2
    total = math.fsum(math.exp(lp["logprob"]) for lp in steps[1].values())
    assert total == pytest.approx(1, abs=1e-3)
    chat_all = {"messages": USER, "logprobs": True, "top_logprobs": -1}
    for path, field, bad in (
        ("/v1/chat/completions", "top_logprobs", {**chat_all, "max_tokens": 50}),
        ("/v1/completions", "logprobs", {"prompt": "Hi", "max_tokens": 50, "logprobs": -1}),
        ("/v1/completions", "prompt_logprobs", {**body, "prompt": "Hi " * 20}),
        ("/v1/chat/completions", "top_logprobs", {**chat_all, "top_logprobs": -2}),
    ):
        assert_openai_error(server.post(path, bad), 400, field)


def test_usage_options(server, client):
    """``--enable-force-include-usage`` ends every stream with usage; a bad
    ``stream_options`` key is named in the error; without ``--enable-prompt-tokens-details``
    usage has no ``prompt_tokens_details`` (as in vLLM; test_server runs with it)."""
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=3, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert [c.usage.prompt_tokens_details for c in chunks] == [None] * len(chunks)
    assert whole.usage.prompt_tokens_details is None
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": "x"}}
    message = assert_openai_error(server.post("/v1/completions", body), 400, "stream_options")
    assert "continuous_usage_stats" in message


def test_priority(client):
    """Honoured under ``--scheduling-policy priority`` (refused otherwise: test_server)."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"priority": -3}
    )
    assert out.usage.completion_tokens == 2


def test_lenient_messages(client):
    """As vLLM: unknown fields inside a message are ignored, any role is taken."""
    out = client.chat.completions.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "narrator", "content": "Once", "reasoning_content": "x", "x": {"a": 1}}],
        extra_body={"return_token_ids": True},
    )
    assert out.choices[0].message.content is not None


WEATHER_DEFS = {
    "type": "object",
    "properties": {"place": {"$ref": "#/$defs/Place"}},
    "required": ["place"],
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_DEFS}}]


def test_required_tool_choice_with_defs_and_response_format(client):
    """``$defs`` / ``$ref`` in a tool's parameters failed under ``"required"`` (the schema
    nested them away from its root); ``response_format`` with ``"required"`` was refused."""
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    if choice.message.tool_calls:
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["place"]["city"] in ("Paris", "Rome")
    else:
        assert choice.finish_reason == "length"
        assert choice.message.content.lstrip().startswith("[")


def test_chat_template_flag_renders_tools_for_auto_choice(server, client):
    """``--chat-template`` gives a model whose own template ignores ``tools`` one that
    renders them, for ``tool_choice="auto"``."""
    tokens = tokenize(server, {"messages": USER, "tools": TOOLS})
    assert detokenize(server, tokens).endswith("<tool get_weather><|assistant|>")
    out = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=3, temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert out.prompt_token_ids == tokens


def test_request_chat_template_under_the_trust_flag(server, client):
    """A request's ``chat_template`` replaces the server's for that request (chat and
    ``/tokenize``), its content format resolved from it (``string`` here, ``openai`` for the
    server's); other requests keep the server's."""
    own = "{% for m in messages %}({{ m['role'] }}:{{ m['content'] }}){% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    tokens = tokenize(server, {"messages": parts, "chat_template": own})
    assert detokenize(server, tokens) == "(user:Name\na colour.)", "parts joined: string format"
    out = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=2, temperature=0,
        extra_body={"chat_template": own, "return_token_ids": True},
    )
    assert out.prompt_token_ids == tokens
    assert detokenize(server, tokenize(server, {"messages": USER})).startswith("<|user|>[Name a colour.]")


def test_named_tool_call_cut_short_has_no_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice=named, max_completion_tokens=2, temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice=named, max_completion_tokens=2, temperature=0, stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert [c for c in chunks if c.delta.tool_calls] == [], "no argument pieces that never close"
    assert not "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "length"


def test_logit_bias_errors_name_every_bad_key(server):
    body = {"prompt": "hi", "logit_bias": {"x": 1, "5": 1, "-3": 2}}
    message = assert_openai_error(server.post("/v1/completions", body), 400, "logit_bias")
    assert "'x'" in message and "'-3'" in message
    body = {"prompt": "hi", "logit_bias": {"99999998": 1, "99999999": 1}}
    message = assert_openai_error(server.post("/v1/completions", body), 400, "logit_bias")
    assert "99999998" in message and "99999999" in message


def test_root_path_request_id_and_auth(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/v1/models", ROOT + "/v1/models"):
        assert httpx.get(server.url + path, headers=headers).status_code == 200, path
        assert httpx.get(server.url + path).status_code == 401, path
    response = httpx.get(server.url + "/version", headers={"X-Request-Id": "abc-1"})
    assert response.headers["x-request-id"] == "abc-1"
    first, second = (httpx.get(server.url + "/health").headers["x-request-id"] for _ in range(2))
    assert first and second and first != second


def test_version_ping_tokenizer_info(server, default_tokenizer):
    import tokenmill

    assert httpx.get(server.url + "/version").json() == {"version": tokenmill.__version__}
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(default_tokenizer).__name__
    assert info["chat_template"] == TEMPLATE


def test_invocations(server):
    chat = server.post("/invocations", {"messages": USER, "max_tokens": 2, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    body = {"messages": USER, "max_tokens": 2, "temperature": 0}
    direct = server.post("/v1/chat/completions", body)
    assert chat.json()["choices"] == direct.json()["choices"]
    completion = server.post("/invocations", {"prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert_openai_error(server.post("/invocations", {"input": "x"}), 400)
    bad = {"prompt": PROMPT, "max_tokens": "2"}
    assert_openai_error(server.post("/invocations", bad), 400, "max_tokens")
    assert_openai_error(server.post("/invocations", "{"), 400)


VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:iteration_tokens_total_count",
    "vllm:request_max_num_generation_tokens_count",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:inter_token_latency_seconds_count",
)
"""vLLM's names (its ``vllm/v1/metrics/loggers.py``) for what tokenmill measures."""


def test_vllm_metric_names(server):
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    samples = {line.split("{", 1)[0].split(" ", 1)[0] for line in lines if not line.startswith("#")}
    for name in VLLM_METRICS:
        assert name in samples, name
        assert "tokenmill:" + name.removeprefix("vllm:") in samples, name
    labelled = [line for line in lines if line.startswith("vllm:request_params_n_count")]
    assert labelled and f'model_name="{MODEL}"' in labelled[0]
