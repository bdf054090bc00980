"""A server under large inputs: tokenization runs off the event loop (``/health`` keeps
answering), oversized fields are 400s naming the field and the limit, and structured-output
constraints compile side by side, so a huge or abandoned compile holds back no one else."""

from __future__ import annotations

import random
import string
import threading
import time

import httpx
import pytest

from server.test_server import MODEL, PROMPT, RemoteServer, assert_openai_error

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def post(server: RemoteServer, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def huge_choice(seed: int) -> list[str]:
    """10,000 options of 16 letters and spaces: within the limits, and seconds to compile
    (each seed a constraint of its own, so no compile is served from the cache)."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase + " ", k=16)) for _ in range(10_000)]


def yes_no(server: RemoteServer, seed: int) -> tuple[float, httpx.Response]:
    """A small constrained completion (its own options, so it compiles too): seconds taken
    and the response."""
    body = {
        "model": MODEL,
        "prompt": "Is the sky blue? Answer:",
        "max_tokens": 4,
        "temperature": 0,
        "structured_outputs": {"choice": [f" yes{seed}", f" no{seed}"]},
    }
    start = time.monotonic()
    response = post(server, "/v1/completions", body)
    return time.monotonic() - start, response


def test_health_answers_during_10mb_tokenize(server):
    text = " ".join(random.Random(0).choices(["hello", "world", "tokens", "x1"], k=2_000_000))
    text = text[: 10 * 2**20]
    result: dict[str, httpx.Response] = {}

    def tokenize() -> None:
        result["r"] = post(server, "/tokenize", {"model": MODEL, "prompt": text}, timeout=300)

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies = []
    while worker.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.1)
    worker.join()
    response = result["r"]
    assert response.status_code == 200, response.text
    assert response.json()["count"] > 1_000_000
    assert len(latencies) >= 5
    assert max(latencies) < 1.0, latencies


LIMIT_CASES = [
    ("/v1/completions", {"prompt": PROMPT, "n": 129}, "n", "128"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, "prompt", "1024"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"] * 129}, "stop", "128"),
    ("/v1/completions", {"prompt": PROMPT, "stop": "x" * 1025}, "stop", "1024"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": ["x"] * 20_000}, "bad_words", "1024"),
    ("/v1/completions", {"prompt": PROMPT, "cache_salt": "s" * 1025}, "cache_salt", "1024"),
    (
        "/v1/completions",
        {"prompt": PROMPT, "allowed_token_ids": [5] * 1_000_000},
        "allowed_token_ids",
        "262144",
    ),
    (
        "/v1/completions",
        {"prompt": PROMPT, "logit_bias": {str(i): 1.0 for i in range(300_000)}},
        "logit_bias",
        "262144",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}] * 20_001},
        "messages",
        "10000",
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}] * 20_001}, "messages", "10000"),
    (
        "/v1/completions",
        {"prompt": PROMPT, "structured_outputs": {"choice": [str(i) for i in range(20_000)]}},
        "structured_outputs",
        "10000",
    ),
    (
        "/v1/completions",
        {"prompt": PROMPT, "guided_regex": "a" * 300_000},
        "guided_regex",
        "262144",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": {"enum": ["x" * 100] * 3000}},
            },
        },
        "response_format",
        "262144",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "limit"), LIMIT_CASES)
def test_oversized_fields_are_400s(server, path, body, param, limit):
    if path == "/tokenize":
        # Either of two request bodies: the error's param names the alternative.
        message = assert_openai_error(post(server, path, {"model": MODEL, **body}), 400)
    else:
        response = post(server, path, {"model": MODEL, "max_tokens": 1, **body})
        message = assert_openai_error(response, 400, param)
    assert param in message and limit in message, message
    assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


@pytest.fixture(scope="module")
def idle_seconds(server) -> float:
    """How long a small constrained completion takes with nothing else running."""
    yes_no(server, 100)
    seconds, response = yes_no(server, 101)
    assert response.status_code == 200, response.text
    return seconds


def test_small_constraint_is_prompt_while_a_huge_one_compiles(server, idle_seconds):
    huge_body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "structured_outputs": {"choice": huge_choice(1)},
    }
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.update(r=post(server, "/v1/completions", huge_body, timeout=300))
    )
    worker.start()
    time.sleep(1.0)
    seconds, response = yes_no(server, 1)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) in ((" yes1", "stop"), (" no1", "stop"))
    assert worker.is_alive(), "the huge constraint compiled before the small one finished"
    assert seconds < idle_seconds + 5.0, (seconds, idle_seconds)
    worker.join()
    [choice] = result["r"].json()["choices"]
    # On a slow machine the huge compile may pass TOKENMILL_GRAMMAR_COMPILE_TIMEOUT: an error.
    if choice["finish_reason"] == "error":
        assert choice["text"] == ""
    else:
        assert choice["finish_reason"] == "length"
        assert any(c.startswith(choice["text"]) for c in huge_body["structured_outputs"]["choice"])


def test_aborted_huge_compile_does_not_delay_later_requests(server, idle_seconds):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "structured_outputs": {"choice": huge_choice(2)},
    }
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=1.5)
    for seed in range(2, 5):
        seconds, response = yes_no(server, seed)
        assert response.status_code == 200, response.text
        assert seconds < idle_seconds + 5.0, (seed, seconds, idle_seconds)
    server.wait_idle()
    out = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"
