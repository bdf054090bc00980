"""A model that mixes MLA and full-attention layers: the selector gives each layer a backend of
its kind (keeping every rejection's reason), the runner groups the layers by backend and KV
spec, and greedy decoding through ``LLM`` equals the model's layer-by-layer reference."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import save_file

from conftest import assert_greedy_close
from tokenmill import LLM, SamplingParams, plugins
from tokenmill.attention_backends.torch_mla import TorchMLABackend
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.attention import CommonAttentionMetadata
from tokenmill.layers.build_context import BuildContext
from tokenmill.model_loader import load_hf_config, load_model
from tokenmill.models.deepseek_v2 import DeepseekV2DecoderLayer
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.layers.attention_groups import model_attention_layers

NUM_LAYERS = 4
BLOCK_SIZE = 8
NUM_TOKENS = 16
SIZES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def mixed_layer(config, prefix: str = "", *, layer_idx: int):
    """Even layers: Llama's grouped-query attention; odd layers: DeepSeek-V2's MLA."""
    if layer_idx % 2:
        return DeepseekV2DecoderLayer(config, prefix, layer_idx=layer_idx, v3=False)
    return LlamaDecoderLayer(config, prefix, layer_idx=layer_idx)


class MixedAttentionForCausalLM(LlamaForCausalLM):
    layer_type = staticmethod(mixed_layer)


@pytest.fixture(scope="module")
def mixed_checkpoint(tmp_path_factory) -> str:
    """Llama's embedding, norm, head and even layers with DeepSeek-V2's odd layers (dense
    MLPs), both random from transformers, under a DeepSeek-V2 config naming the mixed class."""
    path = tmp_path_factory.mktemp("mixed")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    # DeepseekV2Config sets head_dim to qk_rope_head_dim, which the Llama layers then use
    config = transformers.DeepseekV2Config(**SIZES, **MLA, first_k_dense_replace=NUM_LAYERS)
    deepseek = transformers.DeepseekV2ForCausalLM(config)
    weights = {}
    for name, tensor in llama.state_dict().items():
        if not name.startswith("model.layers.") or int(name.split(".")[2]) % 2 == 0:
            weights[name] = tensor
    for name, tensor in deepseek.state_dict().items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) % 2:
            weights[name] = tensor
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["MixedAttentionForCausalLM"]
    config.save_pretrained(str(path))
    assert json.loads((path / "config.json").read_text())["head_dim"] == SIZES["head_dim"] == MLA["qk_rope_head_dim"]
    return str(path)


@pytest.fixture
def mixed_model_registered(monkeypatch):
    monkeypatch.setattr(plugins, "_runtime", [])
    plugins.register_model("MixedAttentionForCausalLM", "test_mixed_attention:MixedAttentionForCausalLM")
    yield
    monkeypatch.undo()
    plugins.reload_plugins()


def _reference_backend(layer_name, head_size, *, use_mla=False, sliding_window=None):
    return TorchMLABackend if use_mla else TorchRefBackend


def _dense_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The last position's logits of ``token_ids`` computed from scratch: every layer over the
    whole sequence, on a fresh cache, on the reference backends."""
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    for layer in model_attention_layers(model):
        layer.kv_cache = torch.zeros(
            layer.backend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
        )
    spec = model_attention_layers(model)[0].get_kv_cache_spec(BLOCK_SIZE, torch.float32)
    builder = TorchRefBackend.get_metadata_builder_cls()(spec, torch.device("cpu"))
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    qsl = torch.tensor([0, n], dtype=torch.int32)
    seq_lens = torch.tensor([n], dtype=torch.int32)
    common = CommonAttentionMetadata(
        qsl, qsl, seq_lens, seq_lens, torch.tensor([0], dtype=torch.int32), block_table,
        torch.arange(n), 1, n, n, n,
    )
    with torch.inference_mode(), set_forward_context(builder.build(common)):
        hidden = model(torch.tensor(token_ids), torch.arange(n))
        return model.compute_logits(hidden[-1:])[0]


def test_mixed_model_gets_a_backend_per_layer_kind_and_decodes_like_its_reference(mixed_checkpoint, mixed_model_registered):
    reference = load_model(mixed_checkpoint, load_hf_config(mixed_checkpoint), BuildContext(_reference_backend), "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 11, 20, 37)]
    refs = []
    for prompt in prompts:
        ids, scores = list(prompt), []
        for _ in range(NUM_TOKENS):
            scores.append(_dense_logits(reference, ids))
            ids.append(int(scores[-1].argmax()))
        refs.append((ids[len(prompt):], scores))

    budget = 1 << 20
    llm = LLM(
        model=mixed_checkpoint, block_size=BLOCK_SIZE, kv_cache_memory_bytes=budget,
        max_model_len=128, max_num_batched_tokens=16,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    backends = {name: layer.backend.get_name() for name, layer in runner.attention_layers().items()}
    assert backends == {
        f"model.layers.{i}.self_attn.attn": "cpu_mla" if i % 2 else "cpu_sdpa" for i in range(NUM_LAYERS)
    }
    groups = {g.backend.get_name(): g.layer_names for g in runner.metadata_builder.groups}
    assert groups == {
        "cpu_sdpa": ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
        "cpu_mla": ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
    }
    described = runner.attn_selector.describe()
    assert described.startswith("attention backends cpu_sdpa for 2 layers (automatic: ")
    assert "cpu_mla for 2 layers (automatic: " in described
    assert "passed over cpu_sdpa: MLA models need an MLA backend | torch: MLA models need an MLA backend" in described
    mha_bytes = 2 * 2 * 8 * 4  # K and V, 2 KV heads of 8, float32
    mla_bytes = (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 4
    assert llm.get_stats()["kv_blocks_total"] == budget // (BLOCK_SIZE * 2 * (mha_bytes + mla_bytes))

    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    for _ in range(2):  # the second run hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, (ref, scores) in zip(outputs, refs):
            assert_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, scores)
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_explicit_backend_must_serve_every_layer(mixed_checkpoint, mixed_model_registered):
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.self_attn\.attn: attention backend 'cpu_sdpa' cannot be used: MLA models need an MLA backend",
    ):
        LLM(model=mixed_checkpoint, attention_backend="cpu_sdpa", num_kv_blocks=16, max_model_len=64)
