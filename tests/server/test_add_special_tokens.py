"""vLLM's ``add_special_tokens`` request field: the tokenizer's BOS is added to a completion's
prompt text by default and not to a chat prompt's, and the field turns it on or off (it used to
be ignored with a warning)."""

from __future__ import annotations

import pytest
from conftest import make_tiny_checkpoint
from fastapi.testclient import TestClient

from tokenmill import cli
from tokenmill.entrypoints import serve

BOS = 1
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{byte_chars[BOS]} $A", special_tokens=[(byte_chars[BOS], BOS)]
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=byte_chars[BOS]).save_pretrained(path)
    args = cli.build_parser().parse_args(
        ["serve", "--model", path, "--no-engine-process", "--num-kv-blocks", "16",
         "--chat-template", TEMPLATE]
    )
    with TestClient(serve.make_app(args)) as c:
        yield c


def prompt_ids(client: TestClient, endpoint: str, body: dict) -> list[int]:
    response = client.post(endpoint, json={"max_tokens": 1, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    # Completions carry them per choice, chat once per response.
    return data["prompt_token_ids"] if "messages" in body else data["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("add", [None, True, False])
def test_completion_prompt_gets_the_bos_unless_told_not_to(client, add):
    body = {"prompt": "hi there"} | ({} if add is None else {"add_special_tokens": add})
    ids = prompt_ids(client, "/v1/completions", body)
    text_ids = ids[1:] if add is not False else ids
    assert len(text_ids) == len("hi there")
    assert (ids[0] == BOS) == (add is not False)


@pytest.mark.parametrize("add", [None, True, False])
def test_chat_prompt_gets_the_bos_only_when_asked(client, add):
    body = {"messages": [{"role": "user", "content": "hi there"}]}
    body |= {} if add is None else {"add_special_tokens": add}
    ids = prompt_ids(client, "/v1/chat/completions", body)
    assert len(ids) == len("hi there") + (add is True)
    assert (ids[0] == BOS) == (add is True)
