"""``tokenmill serve --speculative-config``: outputs and streams unchanged, metrics exposed."""

from __future__ import annotations

import json

import pytest

from server.test_server import MODEL, RemoteServer

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},  # the head shipped for the default model
}
PROMPT = "Copy this list: red, green, blue, red, green, blue, red, green, blue, red, green,"


# The server runs every method through the same code: `make test` serves ngram; the shipped
# EAGLE-3 head's outputs are checked in process (test_spec_decode.py), its server under slow.
@pytest.fixture(
    scope="module", params=["ngram", pytest.param("eagle3", marks=pytest.mark.slow)]
)
def server(request):
    srv = RemoteServer("--speculative-config", json.dumps(SPECS[request.param]))
    srv.method = request.param
    yield srv
    srv.stop()


def test_streaming_equals_non_streaming_and_drafts_are_counted(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 24
    m = server.wait_idle()
    assert m["tokenmill:spec_decode_num_drafts_total"] > 0
    assert m["tokenmill:spec_decode_num_accepted_tokens_total"] <= m["tokenmill:spec_decode_num_draft_tokens_total"]
    if server.method == "ngram":  # the shipped head accepts little on a list (README)
        assert m["tokenmill:spec_decode_num_accepted_tokens_total"] > 0
    assert m["tokenmill:spec_decode_num_accepted_tokens_per_pos_total"] == m["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert m["tokenmill:spec_decode_num_drafts_per_length_total"] >= m["tokenmill:spec_decode_num_drafts_total"]
    if server.method == "ngram":  # fixed lengths below the default cut-off (eagle3's is measured)
        assert m["tokenmill:spec_decode_disable_by_batch_size"] == 8


def test_same_text_as_without_speculation(server, default_llm):
    from tokenmill import SamplingParams

    text = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    assert default_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text == text
