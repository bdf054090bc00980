"""LoRA adapters through ``tokenmill serve`` and the ``openai`` client: listed in /v1/models
under the base model, chosen by ``model``, loaded and unloaded at run time behind
``TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING``; unknown adapters are 404s and bad directories 400s
in OpenAI's shape, and the engine keeps serving."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from server.test_server import MODEL, PROMPT, RemoteServer, assert_openai_error

openai = pytest.importorskip("openai")

HIDDEN, KV_OUT, LAYERS = 576, 192, 30
"""SmolLM2-135M: hidden size, k/v projection width, layers."""


def write_adapter(path, seed: int, rank: int = 8) -> str:
    """A PEFT-format adapter on q_proj and v_proj of every layer, its B large enough to move
    the greedy tokens."""
    generator = torch.Generator().manual_seed(seed)
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "v_proj"]}
    ))
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=generator) / HIDDEN**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    return write_adapter(root / "first", 1), write_adapter(root / "second", 2)


@pytest.fixture(scope="module")
def server(adapter_dirs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", "1")
        srv = RemoteServer(
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"first={adapter_dirs[0]}",
        )
    yield srv
    srv.stop()


def complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_adapters_are_models_chosen_by_name(server):
    client = server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "first"}
    assert cards["first"].model_extra["parent"] == MODEL and cards[MODEL].model_extra["parent"] is None
    base, first = complete(client, MODEL), complete(client, "first")
    assert first != base
    chat = client.chat.completions.create(
        model="first", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "first"
    assert "tokenmill:lora_adapters_running" in server.metrics()


def test_load_use_unload_reload(server, adapter_dirs):
    client = server.client()
    base = complete(client, MODEL)
    assert server.post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": adapter_dirs[1]}).status_code == 200
    assert "second" in {m.id for m in client.models.list().data}
    second = complete(client, "second")
    assert second not in (base, complete(client, "first"))
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "second")
    assert_openai_error(server.post("/v1/unload_lora_adapter", {"lora_name": "second"}), 404, "lora_name")
    assert server.post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": adapter_dirs[1]}).status_code == 200
    assert complete(client, "second") == second
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200


def test_unknown_adapter_is_404_and_bad_directory_400(server, tmp_path):
    response = server.post("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert "`nope` does not exist" in assert_openai_error(response, 404, "model")
    response = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert "no adapter_config.json" in assert_openai_error(response, 400, "lora_path")
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8}')
    response = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert "r=64 is above max_lora_rank=8" in assert_openai_error(response, 400, "lora_path")
    response = server.post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(tmp_path)})
    assert "already in use" in assert_openai_error(response, 400, "lora_name")
    assert "bad" not in {m.id for m in server.client().models.list().data}
    assert complete(server.client(), "first")
    server.wait_idle()


def test_runtime_updating_is_closed_by_default(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from conftest import make_tiny_checkpoint, save_byte_tokenizer
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.api_server import build_app

    monkeypatch.delenv("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    path = make_tiny_checkpoint(tmp_path / "tiny")
    save_byte_tokenizer(path)
    engine = AsyncLLM.from_engine_args(model=path, engine_process=False, num_kv_blocks=16, enable_lora=True)
    try:
        client = TestClient(build_app(engine, ["tiny"]))
        body = {"lora_name": "a", "lora_path": str(tmp_path)}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    finally:
        engine.shutdown()
