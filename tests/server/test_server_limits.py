"""A server started with ``--api-key`` and a small ``--max-pending-requests``: 401 without the
key, 503 while the queue is full, and normal service once it drains."""

from __future__ import annotations

import httpx
import pytest

from server.test_server import MODEL, PROMPT, RemoteServer, assert_openai_error

openai = pytest.importorskip("openai")

API_KEY = "sk-tokenmill-test"
MAX_PENDING = 2


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--max-pending-requests", str(MAX_PENDING), api_key=API_KEY)
    yield srv
    srv.stop()


def test_api_key(server):
    assert server.client().models.list().data[0].id == MODEL
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert assert_openai_error(response, 401) == "Incorrect API key provided."
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_queue_full_answers_503(server):
    client = server.client()
    body = dict(
        model=MODEL, prompt=PROMPT, max_tokens=400, extra_body={"ignore_eos": True}, stream=True
    )
    streams = [client.completions.create(**body) for _ in range(MAX_PENDING)]
    try:
        for stream in streams:
            next(iter(stream))
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "server_overloaded"
    finally:
        for stream in streams:
            stream.close()
    server.wait_idle()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text
