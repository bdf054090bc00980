"""The OpenAI-compatible server, end to end: one real ``tokenmill serve`` subprocess driven by
the official ``openai`` client (and raw HTTP for what the client cannot send)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
KV_CACHE_BYTES = "268435456"


class RemoteServer:
    """A ``tokenmill serve`` subprocess on 127.0.0.1 at a free port, up once /health says so."""

    def __init__(
        self, *args: str, api_key: str | None = None, start_timeout: float = 240.0
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            "-m",
            "tokenmill",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-cache-memory-bytes",
            KV_CACHE_BYTES,
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-5000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0
        )

    def post(self, path: str, body: str | dict, **kwargs) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``tokenmill:`` samples without labels or buckets: name -> value (summed over labels)."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("tokenmill:") and "_bucket" not in line:
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["tokenmill:num_requests_running"] == 0
                and m["tokenmill:num_requests_waiting"] == 0
            )
            if idle and m["tokenmill:kv_blocks_free"] == m["tokenmill:kv_blocks_total"]:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {m}")
            time.sleep(0.2)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.created > 0
    [choice] = out.choices
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == 5
    assert 0 < out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_prompt_forms(client):
    ids = [504, 3575, 282, 4649, 314]
    by_text = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0
    )
    assert [c.index for c in by_text.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    by_id_lists = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0
    )
    assert [c.index for c in by_id_lists.choices] == [0, 1]
    assert by_id_lists.choices[0].text == by_ids.choices[0].text
    assert by_id_lists.usage.prompt_tokens == len(ids) + 3


def test_streaming_equals_non_streaming(client):
    """The stop string starts inside an earlier token ("The" + " answer"), so a stream that
    showed text before knowing it is not a stop string would differ from the full text."""
    stop = "e answ"
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert stop not in text and "The" not in text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_chat(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert out.usage.prompt_tokens > 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_n2(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7, stream=True
        )
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in out.choices}


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    assert all(v <= 0 for v in lp.token_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        for t in content
    )


def test_echo(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_32_concurrent_requests(server):
    async def main() -> list:
        async with server.async_client() as aclient:
            return await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=MODEL, prompt=f"Count to {i}:", max_tokens=6, temperature=0
                    )
                    for i in range(32)
                )
            )

    outs = asyncio.run(main())
    assert len(outs) == 32 and all(
        o.choices[0].text and o.usage.completion_tokens > 0 for o in outs
    )
    server.wait_idle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "hi", "max_tokens": 5', None),
        ("[1, 2]", None),
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"60000": 1}}, "logit_bias"),
        ({"prompt": "hi", "allowed_token_ids": [60000]}, "allowed_token_ids"),
        ({"prompt": "hi", "bad_words": [""]}, "bad_words"),
        ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "hi", "priority": 1}, "priority"),
        ({"prompt": "hi", "prompt_logprobs": 50}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [100] * 6000}, "prompt"),
        ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "hi", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_completion_errors(server, body, param):
    assert_openai_error(server.post("/v1/completions", body), 400, param)


def test_penalties_and_logit_bias(client, server):
    plain = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0)
    biased = client.completions.create(
        model=MODEL,
        prompt="The cat",
        max_tokens=8,
        temperature=0,
        logit_bias={"28": 100},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert plain.choices[0].text != biased.choices[0].text
    assert biased.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        presence_penalty=1.0,
        logit_bias={"28": 100},
        extra_body={"repetition_penalty": 1.1, "top_k": 5, "min_p": 0.1},
    )
    assert chat.choices[0].message.content == "," * 4


def test_vllm_bench_serve_payloads(server):
    """The bodies ``vllm bench serve`` sends (openai and openai-chat backends) succeed, and
    unknown fields are ignored as vLLM ignores them."""
    completion = {
        "model": MODEL,
        "prompt": "Hello there",
        "repetition_penalty": 1.0,
        "temperature": 0.0,
        "max_tokens": 5,
        "logprobs": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "some_future_field": {"x": 1},
    }
    response = server.post("/v1/completions", completion)
    assert response.status_code == 200, response.text
    assert '"completion_tokens":5' in response.text and response.text.rstrip().endswith("[DONE]")
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0.0,
        "max_completion_tokens": 5,
        "ignore_eos": True,
        "repetition_penalty": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "use_beam_search": False,
    }
    response = server.post("/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    assert '"completion_tokens":5' in response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"content": "x"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "min_p": 2.0}, "min_p"),
        ({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, "cache_salt"),
    ],
)
def test_chat_errors(server, body, param):
    assert_openai_error(server.post("/v1/chat/completions", body), 400, param)


def test_request_chat_template_needs_the_trust_flag(server):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"}
    for path in ("/v1/chat/completions", "/tokenize"):
        message = assert_openai_error(server.post(path, body), 400, "chat_template")
        assert "--trust-request-chat-template" in message, message


def test_cache_salt_isolates_tenants(client):
    """Same prompt, other salt: no prefix-cache hit (``usage.prompt_tokens_details``)."""
    prompt = "Tenants of one server must never read each other's cached prefixes. " * 3

    def completion_cached(salt: str) -> int:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert [completion_cached(s) for s in ("tenant-a", "tenant-b")] == [0, 0]
    assert completion_cached("tenant-a") > 0 and completion_cached("tenant-b") > 0

    messages = [{"role": "user", "content": prompt}]

    def chat_cached(salt: str, **kwargs) -> int:
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": salt}, **kwargs
        )
        if kwargs.get("stream"):
            out = list(out)[-1]
        return out.usage.prompt_tokens_details.cached_tokens

    assert chat_cached("tenant-a") == 0
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    assert chat_cached("tenant-a", **stream) > 0
    assert chat_cached("tenant-c", **stream) == 0


def test_client_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nonexistent", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-0.5)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[7] * 6000, max_tokens=2)


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert (
            server.metrics()["tokenmill:kv_blocks_free"]
            < server.metrics()["tokenmill:kv_blocks_total"]
        )
    metrics = server.wait_idle()
    assert metrics["tokenmill:request_success_total"] >= 1


def test_disconnect_before_non_stream_response_frees_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    server.wait_idle()


def test_metrics(server):
    m = server.metrics()
    for name in (
        "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total",
        "tokenmill:time_to_first_token_seconds_count",
        "tokenmill:request_time_per_output_token_seconds_count",
        "tokenmill:e2e_request_latency_seconds_count",
        "tokenmill:request_queue_time_seconds_count",
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_blocks_total",
        "tokenmill:kv_blocks_free",
        "tokenmill:prefix_cache_queries_total",
        "tokenmill:prefix_cache_hits_total",
        "tokenmill:num_preemptions_total",
        "tokenmill:request_success_total",
    ):
        assert name in m, name
    assert m["tokenmill:generation_tokens_total"] > 0 and m["tokenmill:prefix_cache_hits_total"] > 0


def test_still_serving_after_everything(server, client):
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text
    server.wait_idle()


def test_kv_events_publish_the_prompt_blocks(server, client):
    """``GET /kv_events``: the prefix cache's BlockStored events, which a router follows."""
    start = httpx.get(server.url + "/kv_events", timeout=10).json()
    assert start["reset"] and start["events"] == []
    prompt = "one two three four five six seven eight nine ten " * 8
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    params = {"after": start["seq"], "log_id": start["log_id"]}
    after = httpx.get(server.url + "/kv_events", params=params, timeout=10).json()
    assert not after["reset"] and after["seq"] > start["seq"]
    stored = [h for e in after["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert len(stored) >= usage.prompt_tokens // 16
    assert all(len(h) == 64 for h in stored)
    snapshot = httpx.get(server.url + "/kv_events", timeout=10).json()
    assert set(stored) <= set(snapshot["blocks"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_are_checked_and_need_a_connector(server, path):
    body = {"model": MODEL, "max_tokens": 1}
    body.update(
        {"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    )
    for bad, field in (
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
        ({"remote_port": 70000}, "remote_port"),
        ([True], None),
    ):
        answer = server.post(path, {**body, "kv_transfer_params": bad})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "kv_transfer_params" in error["message"] and (field is None or field in error["message"])
    answer = server.post(path, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert "need a KV connector and this server has none" in error["message"]
    plain = server.post(path, body).json()
    assert plain["kv_transfer_params"] is None
