"""Disaggregated serving end to end: ``tokenmill router`` over a prefill instance and a decode
instance (real ``tokenmill serve`` subprocesses on the default model, the ``p2p`` connector)
answers greedy requests exactly as one instance does alone, the decode instance computing only
the prompt's last token (its counters say so); and a decode instance that cannot pull the KV (prefill gone,
blocks timed out, params forged or stale) computes the prompt itself, holding no block after."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from server.test_router import RouterProcess, free_port
from server.test_server import MODEL, RemoteServer

pytest.importorskip("openai")

BLOCK = 16
SEND_TIMEOUT_S = 25
WORDS = (
    "river stone lantern quiet orchard copper violet harbor meadow ember falcon glacier "
    "thistle cobalt saffron willow canyon marble quill tundra"
).split()

pytestmark = pytest.mark.slow


def prompt_of(n_words: int, seed: int) -> str:
    """A prompt of ``n_words`` words no other seed's prompt shares a block with."""
    rng = random.Random(seed)
    return f"Note {seed}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def instances():
    port = free_port()
    producer = {
        "kv_connector": "p2p",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"port": port, "send_timeout_s": SEND_TIMEOUT_S},
    }
    consumer = {
        "kv_connector": "p2p",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"pull_timeout_s": 5},
    }
    # Usage carries cached_tokens (the pulled blocks) only with --enable-prompt-tokens-details.
    details = "--enable-prompt-tokens-details"
    prefill = RemoteServer(details, "--kv-transfer-config", json.dumps(producer))
    try:
        decode = RemoteServer(details, "--kv-transfer-config", json.dumps(consumer))
    except BaseException:
        prefill.stop()
        raise
    router = RouterProcess([prefill.url], [decode.url], "--health-interval", "0.5")
    yield prefill, decode, router
    router.stop()
    decode.stop()
    prefill.stop()


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    body.update(return_token_ids=True, logprobs=1, **extra)
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def same_completion(got: dict, want: dict) -> None:
    g, w = got["choices"][0], want["choices"][0]
    for key in ("text", "token_ids", "prompt_token_ids", "finish_reason"):
        assert g[key] == w[key], key
    assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert g["logprobs"]["token_logprobs"] == pytest.approx(
        w["logprobs"]["token_logprobs"], abs=1e-3
    )


def remote_block_tokens(num_prompt_tokens: int) -> int:
    """Prompt tokens a decode instance pulls: all but the last, partial last block included."""
    return num_prompt_tokens - 1


def computed_prompt_tokens(metrics: dict[str, float]) -> float:
    """Prompt tokens an instance computed: looked up, neither a local hit nor a connector's."""
    return (
        metrics["tokenmill:prefix_cache_queries_total"]
        - metrics["tokenmill:prefix_cache_hits_total"]
        - metrics["tokenmill:external_prefix_cache_hits_total"]
    )


def test_router_answers_as_one_instance_and_decode_computes_only_the_tail(instances):
    prefill, decode, router = instances
    prompts = [prompt_of(n, seed) for seed, n in enumerate((40, 90, 150))]
    # the colocated reference: the prefill instance serving each request alone
    want = [complete(prefill.url, p) for p in prompts]
    prefill.wait_idle()
    for prompt, ref in zip(prompts, want, strict=True):
        got = complete(router.url, prompt)
        same_completion(got, ref)
        n = got["usage"]["prompt_tokens"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == remote_block_tokens(n)

    streamed = httpx.post(
        router.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompts[0],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    )
    assert streamed.status_code == 200
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want[0]["choices"][0]["text"]

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompts[2]}],
        "max_completion_tokens": 10,
        "temperature": 0,
    }
    ref = httpx.post(prefill.url + "/v1/chat/completions", json=chat, timeout=120).json()
    got = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert got["choices"][0]["message"] == ref["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == remote_block_tokens(
        got["usage"]["prompt_tokens"]
    )

    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    prefill.wait_idle()
    decode.wait_idle()


def test_32_long_prompts_through_the_router_equal_one_instance(instances):
    """The issue's must-show: 32 prompts of 100-1,000 tokens, greedy, token for token."""
    prefill, decode, router = instances
    prompts = [prompt_of(85 + 25 * i, 100 + i) for i in range(32)]
    want = [complete(prefill.url, p) for p in prompts]
    lengths = [w["usage"]["prompt_tokens"] for w in want]
    assert min(lengths) >= 100 and max(lengths) <= 1000
    prefill.wait_idle()
    before = decode.wait_idle()
    for ref in want:
        got = complete(router.url, ref["choices"][0]["prompt_token_ids"])
        same_completion(got, ref)
        n = got["usage"]["prompt_tokens"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == remote_block_tokens(n)
    prefill.wait_idle()
    after = decode.wait_idle()
    # the decode instance computed one prompt token per request, the one giving its logits
    assert computed_prompt_tokens(after) - computed_prompt_tokens(before) == len(prompts)
    assert after["tokenmill:kv_transfer_recomputed_total"] == before["tokenmill:kv_transfer_recomputed_total"]


def test_prefix_affinity_follows_the_decode_instance_kv_events(instances):
    prefill, decode, router = instances
    held = complete(
        prefill.url, prompt_of(60, 11), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )["kv_transfer_params"]
    complete(decode.url, prompt_of(60, 11), kv_transfer_params=held)
    events = httpx.get(decode.url + "/kv_events", timeout=10).json()
    assert set(held["block_hashes"]) <= set(events["blocks"])


def prefill_only(prefill: RemoteServer, prompt: str) -> dict:
    out = complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"]
    return params


def test_params_forged_with_another_requests_id_get_none_of_its_blocks(instances):
    prefill, decode, _ = instances
    victim, forger = prompt_of(70, 21), prompt_of(70, 22)
    want = complete(prefill.url, forger)
    params = prefill_only(prefill, victim)
    got = complete(decode.url, forger, kv_transfer_params=params)
    same_completion(got, want)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the rightful puller still gets the blocks
    rightful = complete(decode.url, victim, kv_transfer_params=params)
    n = rightful["usage"]["prompt_tokens"]
    assert rightful["usage"]["prompt_tokens_details"]["cached_tokens"] == remote_block_tokens(n)
    prefill.wait_idle()
    decode.wait_idle()


def test_unreachable_prefill_instance_means_local_recompute(instances):
    prefill, decode, _ = instances
    prompt = prompt_of(50, 31)
    want = complete(prefill.url, prompt)
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_request_id": "gone",
    }
    start = time.monotonic()
    got = complete(decode.url, prompt, kv_transfer_params=params)
    assert time.monotonic() - start < 30
    same_completion(got, want)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    decode.wait_idle()


def test_blocks_not_pulled_in_time_are_freed_and_the_decode_recomputes(instances):
    prefill, decode, _ = instances
    prompt = prompt_of(80, 41)
    want = complete(prefill.url, prompt)
    prefill.wait_idle()
    params = prefill_only(prefill, prompt)
    prefill.wait_idle(timeout=SEND_TIMEOUT_S + 20)
    got = complete(decode.url, prompt, kv_transfer_params=params)
    same_completion(got, want)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    decode.wait_idle()
