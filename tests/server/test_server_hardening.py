"""A server that one client cannot break (issue 36, items 10, 11 and 14): out-of-range and
unencodable values get a 400 (or, where vLLM clamps, are served) and leave nothing behind, a
concurrent stream completes, later requests succeed, and ``/health`` tells when the engine core
stopped stepping. The server runs with two sequence slots and three pending requests, so a
leaked slot shows within a few requests."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import make_tiny_checkpoint, save_byte_tokenizer
from engine.test_engine_process import engine_children
from server.test_server import MODEL, PROMPT, RemoteServer, assert_openai_error
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.api_server import build_app

openai = pytest.importorskip("openai")

API_KEY = "sk-hardening"
MAX_NUM_SEQS = 2
MAX_PENDING = 3
STALL_TIMEOUT_S = 3.0
REPEAT = MAX_PENDING + 1
"""Bad requests of each kind: more than the slots a leak could take."""


@pytest.fixture(scope="module")
def server():
    os.environ["TOKENMILL_ENGINE_STALL_TIMEOUT_S"] = str(STALL_TIMEOUT_S)
    try:
        srv = RemoteServer(
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-pending-requests",
            str(MAX_PENDING),
            api_key=API_KEY,
        )
    finally:
        del os.environ["TOKENMILL_ENGINE_STALL_TIMEOUT_S"]
    yield srv
    srv.stop()


class BackgroundStream:
    """A normal streamed completion of ``max_tokens`` tokens, read on a thread; ``join``
    returns its text, token count and finish reason."""

    def __init__(self, server: RemoteServer, max_tokens: int = 48) -> None:
        self.max_tokens = max_tokens
        self.chunks: list = []
        self.error: BaseException | None = None
        stream = server.client().completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        self.chunks.append(next(iter(stream)))
        self._thread = threading.Thread(target=self._read, args=(stream,))
        self._thread.start()

    def _read(self, stream) -> None:
        try:
            self.chunks.extend(stream)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float = 180) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the concurrent stream hangs"
        assert self.error is None, f"the concurrent stream failed: {self.error!r}"
        finishes = [c.choices[0].finish_reason for c in self.chunks if c.choices]
        assert finishes[-1] == "length"
        assert self.chunks[-1].usage.completion_tokens == self.max_tokens


def assert_still_serving(server: RemoteServer) -> None:
    server.wait_idle()
    response = server.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def sampled(server: RemoteServer, top_k: int) -> dict:
    """Every field of a seeded random completion with its tokens' logprobs."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "top_k": top_k,
        "logprobs": 2,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    [choice] = out["choices"]
    logprobs = choice.pop("logprobs")
    return {
        **choice,
        "tokens": logprobs["tokens"],
        "text_offset": logprobs["text_offset"],
        "token_logprobs": logprobs["token_logprobs"],
        "top_logprobs": logprobs["top_logprobs"],
        "usage": out["usage"],
    }


def approximately(out: dict) -> dict:
    return {
        **out,
        "token_logprobs": pytest.approx(out["token_logprobs"], abs=1e-4),
        "top_logprobs": [pytest.approx(top, abs=1e-4) for top in out["top_logprobs"]],
    }


def test_top_k_beyond_the_vocabulary_is_off_and_fails_nothing(server):
    """Item 10: ``top_k`` of 2**63 overflowed the int64 top-k row, failing the step, every
    other request the core held, and leaking the row until no request could run. As in
    vLLM, a ``top_k`` of at least the vocabulary size keeps every token."""
    vocab_size = 49152
    off = sampled(server, -1)
    assert off["finish_reason"] == "length" and len(off["tokens"]) == 8
    # Logprobs to 1e-4: the batch a request shares a step with changes the logits' last bits.
    off = approximately(off)
    stream = BackgroundStream(server)
    for _ in range(MAX_NUM_SEQS + 1):
        for top_k in (2**63, 2**64 - 1, vocab_size):
            assert sampled(server, top_k) == off
    stream.join()
    assert_still_serving(server)


BAD_VALUES = [
    ({"top_k": 2**64}, "top_k"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"temperature": 10**400}, "temperature"),
    ({"cache_salt": "tenant-\ud800"}, "cache_salt"),
    ({"stop": ["\udfff"]}, "stop"),
    ({"bad_words": ["ok", "\ud800x"]}, "bad_words"),
    ({"structured_outputs": {"choice": ["a\ud800"]}}, "structured_outputs"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_unencodable_values_are_400s_and_leave_nothing_behind(server, endpoint):
    """Item 11: values msgpack cannot carry to the engine core failed after the request's
    stream was registered, which then stayed pending until every request got 503."""
    stream = BackgroundStream(server)
    for fields, param in BAD_VALUES:
        if endpoint == "/v1/completions":
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}
        else:
            messages = [{"role": "user", "content": "hi"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}
        for _ in range(REPEAT):
            message = assert_openai_error(server.post(endpoint, body), 400, param)
            assert param in message, message
    stream.join()
    assert_still_serving(server)


def test_lone_surrogates_in_prompts_are_400s(server):
    """Item 14: a lone surrogate reached the tokenizer, whose TypeError was a 500."""
    messages = [{"role": "user", "content": "bad \ud800 text"}]
    cases = [
        ("/v1/completions", {"prompt": "The \ud800 capital"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udc00"]}, "prompt"),
        ("/v1/chat/completions", {"messages": messages}, "messages"),
        ("/tokenize", {"prompt": "x\ud800"}, "prompt"),
        ("/tokenize", {"messages": messages}, "messages"),
    ]
    for path, body, param in cases:
        message = assert_openai_error(server.post(path, {"model": MODEL, **body}), 400, param)
        assert "lone surrogate" in message
    assert_still_serving(server)


def test_error_messages_name_the_request_fields(server):
    """Item 14: 400s named ``TokenizeChatRequest`` (an internal class) for a prompt body,
    and ``max_tokens`` for ``max_completion_tokens``."""
    for body, param in [({"prompt": 5}, "prompt"), ({"messages": "hi"}, "messages")]:
        message = assert_openai_error(server.post("/tokenize", body), 400, param)
        assert "Tokenize" not in message and param in message, message
    assert assert_openai_error(server.post("/tokenize", {}), 400, "prompt") == (
        "Missing required parameter: 'prompt'"
    )
    messages = [{"role": "user", "content": 5}]
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    message = assert_openai_error(response, 400, "messages")
    assert message.startswith("Invalid value for 'messages': messages.0.content: ")
    assert "TextContentPart" not in message and "list[" not in message, message
    messages = [{"role": "user", "content": "hi"}]
    for value in (0, 10**6):
        body = {"model": MODEL, "messages": messages, "max_completion_tokens": value}
        response = server.post("/v1/chat/completions", body)
        message = assert_openai_error(response, 400, "max_completion_tokens")
        assert "max_completion_tokens" in message or "context length" in message, message
    body = {"model": MODEL, "messages": messages, "max_tokens": 0}
    message = assert_openai_error(server.post("/v1/chat/completions", body), 400, "max_tokens")
    assert message == "max_tokens must be >= 1, got 0"


def test_unexpected_errors_are_plain_500s_logged_once(tmp_path, caplog):
    """Item 14: a 500's body carried the exception's repr, and Starlette re-raised it after
    the handler answered, so the server logged it a second time."""
    path = make_tiny_checkpoint(tmp_path)
    save_byte_tokenizer(path)
    engine = AsyncLLM.from_engine_args(model=path, engine_process=False, num_kv_blocks=16)
    try:
        app = build_app(engine, ["tiny"])

        async def boom() -> None:
            raise KeyError("internal detail")

        app.add_api_route("/boom", boom)
        with caplog.at_level(logging.ERROR):
            response = TestClient(app).get("/boom")
        assert response.status_code == 500
        assert response.json() == {
            "error": {
                "message": "The server had an error while processing your request.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        [record] = [r for r in caplog.records if r.exc_info]
        assert repr(record.exc_info[1]) == "KeyError('internal detail')"
    finally:
        engine.shutdown()


def test_api_key_scheme_in_any_case(server):
    """Item 14: ``Authorization: bearer KEY`` was refused; vLLM takes the scheme in any case."""
    for header, status in [
        (f"bearer {API_KEY}", 200),
        (f"BEARER {API_KEY}", 200),
        (f"Bearer  {API_KEY}", 200),
        (f"Basic {API_KEY}", 401),
        (f"bearer {API_KEY}x", 401),
        ("bearer", 401),
    ]:
        response = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
        assert response.status_code == status, (header, response.text)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(server, chat):
    """Item 14: ``stream_options.continuous_usage_stats`` was refused; every chunk now
    carries the usage so far, and the final usage chunk the total."""
    client = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=10, temperature=0)
    if chat:
        kwargs["messages"] = [{"role": "user", "content": "Name a colour."}]
        create = client.chat.completions.create
    else:
        kwargs["prompt"] = PROMPT
        create = client.completions.create
    full = create(**kwargs)
    chunks = list(create(stream=True, stream_options=options, **kwargs))
    assert all(c.usage is not None for c in chunks)
    usage = [c.usage for c in chunks]
    prompt_tokens = full.usage.prompt_tokens
    assert all(u.prompt_tokens == prompt_tokens for u in usage)
    generated = [u.completion_tokens for u in usage]
    assert generated == sorted(generated) and generated[-1] == full.usage.completion_tokens
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usage)
    content = [c.choices[0] for c in chunks if c.choices]
    if chat:
        assert usage[0].completion_tokens == 0
        text = "".join(c.delta.content or "" for c in content)
        assert text == full.choices[0].message.content
    else:
        assert "".join(c.text for c in content) == full.choices[0].text
    assert content[-1].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(full.usage)
    without = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.usage is None for c in without[:-1])
    assert counts(without[-1].usage) == counts(full.usage)


def counts(usage) -> tuple[int, int, int]:
    """The token counts of a usage (the cached ones depend on the requests before)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def health(server: RemoteServer) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=5)


def wait_for_health(server: RemoteServer, status: int, within: float) -> httpx.Response:
    deadline = time.monotonic() + within
    while (response := health(server)).status_code != status:
        assert time.monotonic() < deadline, f"/health still {response.status_code}"
        time.sleep(0.1)
    return response


def test_health_reports_an_engine_core_that_stopped_stepping(server):
    """Item 14: ``/health`` said 200 while the engine core process was stopped; it answers
    503 once the core holds work and has not stepped for TOKENMILL_ENGINE_STALL_TIMEOUT_S,
    and 200 again once it steps."""
    [core_pid] = engine_children(server.proc.pid)
    stream = BackgroundStream(server, max_tokens=64)
    os.kill(core_pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        response = wait_for_health(server, 503, within=STALL_TIMEOUT_S + 3)
        # The stall counts from the core's last step, which came before the stop by up to a step.
        assert time.monotonic() - stopped >= STALL_TIMEOUT_S - 0.5
        message = assert_openai_error(response, 503)
        assert "no progress" in message, message
    finally:
        os.kill(core_pid, signal.SIGCONT)
    wait_for_health(server, 200, within=5)
    stream.join()

    os.kill(core_pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_TIMEOUT_S + 0.5)
        assert health(server).status_code == 200, "an idle stopped core owes nothing yet"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        answer: dict[str, httpx.Response] = {}
        request = threading.Thread(
            target=lambda: answer.update(response=server.post("/v1/completions", body))
        )
        request.start()
        assert health(server).status_code == 200
        wait_for_health(server, 503, within=STALL_TIMEOUT_S + 3)
    finally:
        os.kill(core_pid, signal.SIGCONT)
    request.join(120)
    assert answer["response"].status_code == 200, answer["response"].text
    assert json.loads(answer["response"].text)["usage"]["completion_tokens"] == 3
    assert_still_serving(server)
