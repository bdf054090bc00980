"""Prompt logprobs on the server: ``echo`` with ``logprobs`` in OpenAI's format, vLLM's
``prompt_logprobs`` field, and the ``/tokenize`` and ``/detokenize`` endpoints."""

from __future__ import annotations

import pytest
import torch

from server.test_server import MODEL, assert_openai_error

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[int]:
    return default_tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(hf_default_model, prompt_ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_default_model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("prompt_form", ["text", "token_ids"])
def test_echo_with_logprobs_returns_the_prompt_logprobs(client, prompt_ids, reference, default_tokenizer, prompt_form):
    prompt = PROMPT if prompt_form == "text" else prompt_ids
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.tokens[:n] == [default_tokenizer.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, n):
        expected = float(reference[p - 1, prompt_ids[p]])
        assert lp.token_logprobs[p] == pytest.approx(expected, abs=1e-4), p
        top = reference[p - 1].topk(2)
        want = {default_tokenizer.decode([int(t)]): float(v) for t, v in zip(top.indices, top.values)}
        for token, value in want.items():
            assert lp.top_logprobs[p][token] == pytest.approx(value, abs=1e-4)
        assert max(lp.top_logprobs[p].values()) == pytest.approx(float(top.values[0]), abs=1e-4)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert lp.text_offset[n] == len(PROMPT)
    assert all(v is not None for v in lp.token_logprobs[n:])


def test_echo_with_logprobs_streamed_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kwargs)
    streamed: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            acc = streamed.setdefault(c.index, {"text": [""], "tokens": [], "token_logprobs": []})
            acc["text"][0] += c.text
            if c.logprobs is not None:
                acc["tokens"] += c.logprobs.tokens
                acc["token_logprobs"] += c.logprobs.token_logprobs
    for c in whole.choices:
        got = streamed[c.index]
        assert got["text"][0] == c.text
        assert got["tokens"] == c.logprobs.tokens
        assert got["token_logprobs"] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)


def test_lm_eval_loglikelihood_request(server, prompt_ids, reference):
    """The body lm-eval's ``local-completions`` sends for loglikelihood: a batch of token-id
    prompts, echo, logprobs=1, max_tokens=1."""
    body = {"model": MODEL, "prompt": [prompt_ids, prompt_ids[:5]], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [len(c["logprobs"]["token_logprobs"]) for c in choices] == [len(prompt_ids) + 1, 6]
    logprobs = choices[0]["logprobs"]
    for p in range(1, len(prompt_ids)):
        assert logprobs["token_logprobs"][p] == pytest.approx(float(reference[p - 1, prompt_ids[p]]), abs=1e-4)
        greedy = int(reference[p - 1].argmax()) == prompt_ids[p]
        assert (logprobs["token_logprobs"][p] == max(logprobs["top_logprobs"][p].values())) == greedy


def test_prompt_logprobs_field(server, prompt_ids, reference):
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 2}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    prompt_logprobs = response.json()["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for p in range(1, len(prompt_ids)):
        entry = prompt_logprobs[p][str(prompt_ids[p])]
        assert entry["logprob"] == pytest.approx(float(reference[p - 1, prompt_ids[p]]), abs=1e-4)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "prompt_logprobs": 0}
    response = server.post("/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    assert response.json()["prompt_logprobs"][0] is None


def test_suffix_is_refused(server):
    response = server.post("/v1/completions", {"model": MODEL, "prompt": "def f():", "suffix": "return 1"})
    assert "suffix" in assert_openai_error(response, 400, "suffix")


def test_tokenize_and_detokenize(server, default_tokenizer):
    response = server.post("/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = default_tokenizer.encode(PROMPT)
    max_model_len = server.client().models.retrieve(MODEL).max_model_len
    assert body == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    strs = server.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert strs == default_tokenizer.convert_ids_to_tokens(ids)

    messages = [{"role": "user", "content": "Hi there"}]
    chat = server.post("/tokenize", {"model": MODEL, "messages": messages}).json()
    expected = default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["tokens"] == list(expected) and chat["count"] == len(expected)
    no_prompt = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert len(no_prompt["tokens"]) < len(expected)

    response = server.post("/detokenize", {"model": MODEL, "tokens": ids})
    assert response.status_code == 200 and response.json() == {"prompt": PROMPT}


def test_tokenize_errors(server):
    assert_openai_error(server.post("/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(server.post("/tokenize", {"model": "nope", "prompt": "x"}), 404)
    assert_openai_error(server.post("/tokenize", {"prompt": 5}), 400)
    assert_openai_error(server.post("/tokenize", {"messages": []}), 400, "messages")


def test_models_report_max_model_len(client):
    model = client.models.list().data[0]
    assert model.max_model_len > 0
