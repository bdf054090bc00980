"""A bounded fuzz pass: schemathesis draws a fixed, derandomized number of valid and invalid
requests for every operation of a running server's ``/openapi.json``; none may get a 5xx."""

from __future__ import annotations

import pytest

from server.test_server import MODEL

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES_PER_MODE = 10
"""Requests drawn per operation and generation mode (valid, invalid)."""

MAX_TOKENS = 2
"""Generated lengths above this are lowered, to bound the test's time on a CPU."""


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def adjust(case) -> None:
    """Name the served model where the fuzzer named one (a random name is only a 404), and
    lower integer lengths it chose (or left to the default, the whole context for chat), so
    no request generates more than ``MAX_TOKENS`` tokens per completion."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if case.path not in ("/v1/completions", "/v1/chat/completions"):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None or isinstance(value, int) and not isinstance(value, bool) and value > 0:
            body[key] = min(value or MAX_TOKENS, MAX_TOKENS)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_get_no_server_errors(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @hypothesis.settings(
            max_examples=EXAMPLES_PER_MODE,
            derandomize=True,
            deadline=None,
            database=None,
            phases=[hypothesis.Phase.generate],
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
        def run(case) -> None:
            adjust(case)
            response = case.call(base_url=server.url, timeout=60)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: "
                    f"{response.text[:300]}\n  {case.as_curl_command()[:600]}"
                )

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            assert mode == "negative"  # an operation without inputs has no invalid ones
    assert not failures, "\n".join(failures)
    out = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text
