"""Pre-quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors) load as stored: a tiny Llama
whose linear weights are known int4 / FP8 values, packed the way those tools pack them, computes
what a float checkpoint of the same dequantized weights computes. Variants the kernels cannot
run are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_checkpoint
from support.quant_checkpoints import quantized_variant
from tokenmill import LLM
from tokenmill.layers.linear import LinearBase
from tokenmill.testing.checkpoints import engine_greedy, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "llama"))


def _model(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model


ENGINE = dict(block_size=8, max_model_len=256, num_kv_blocks=64)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8"])
def test_checkpoint_loads_as_stored(tiny, tmp_path, fmt):
    quant, ref = tmp_path / fmt, tmp_path / "reference"
    quantized_variant(tiny, quant, fmt, ref)
    llm = LLM(model=str(quant), **ENGINE)
    floats = load_file(str(ref / "model.safetensors"))
    layers = {m.prefix: m for m in _model(llm).modules() if isinstance(m, LinearBase)}
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    expected = torch.cat([floats[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(qkv.linear_method.dequantize(qkv), expected, rtol=0, atol=1e-6)
    down = layers["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(down.linear_method.dequantize(down), floats["model.layers.1.mlp.down_proj.weight"], rtol=0, atol=1e-6)
    prompts = random_prompts(256)
    tokens = engine_greedy(quant, prompts, 12, **ENGINE)[0]
    assert tokens == engine_greedy(ref, prompts, 12, **ENGINE)[0]


def test_compressed_tensors_fp8_checkpoint_keeps_ignored_layers_float(tiny, tmp_path):
    quant, ref = tmp_path / "ct", tmp_path / "reference"
    quantized_variant(tiny, quant, "fp8", ref)
    tensors = load_file(str(quant / "model.safetensors"))
    floats = load_file(str(ref / "model.safetensors"))
    for name in [n for n in tensors if ".mlp.down_proj." in n]:  # the ignored layers: float
        tensors.pop(name)
    for name in [n for n in floats if ".mlp.down_proj." in n]:
        tensors[name] = floats[name]
    for name in [n for n in tensors if n.endswith("weight_scale")]:  # per channel, [N, 1]
        tensors[name] = tensors[name].expand(tensors[name.replace("_scale", "")].shape[0]).reshape(-1, 1).contiguous()
    save_file(tensors, str(quant / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head", "re:.*down_proj"],
    }
    (quant / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(quant), **ENGINE)
    down = next(m for m in _model(llm).modules() if getattr(m, "prefix", "").endswith("down_proj"))
    assert down.weight.dtype == torch.float32
    prompts = random_prompts(256)
    del llm
    assert engine_greedy(quant, prompts, 12, **ENGINE)[0] == engine_greedy(ref, prompts, 12, **ENGINE)[0]


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, r"gptq checkpoints with 8-bit weights are not supported; 4-bit ones are"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, r"GPTQ checkpoints with desc_act \(act-order\) are not supported"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"AWQ checkpoints without zero points are not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"fp8 checkpoints with static activation scales are not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise weight scales \(weight_block_size=\[128, 128\]\) are not supported"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            r"compressed-tensors: weights of type 'int', 4 bits, strategy 'group' are not supported; 8-bit float",
        ),
    ],
)
def test_unsupported_checkpoint_variants_are_refused(tiny, tmp_path, quantization_config, message):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), **ENGINE)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoint_formats_are_not_online_methods(tiny, method):
    with pytest.raises(ValueError, match=rf"{method} loads {method.upper()} checkpoints; for online int4 quantization use quantization='int4'"):
        LLM(model=str(tiny), quantization=method, **ENGINE)


def test_unknown_method_and_platform_refusal_name_what_would_run(tiny, monkeypatch):
    from tokenmill.platforms.cpu import CpuPlatform

    with pytest.raises(ValueError, match=r"quantization method 'int3' is not registered; registered: awq, .*int4, int8, w8a8"):
        LLM(model=str(tiny), quantization="int3", **ENGINE)
    monkeypatch.setattr(CpuPlatform, "supported_quantization", ("fp8",))
    with pytest.raises(ValueError, match=r"platform 'cpu' does not run quantization 'int8'; it runs: fp8"):
        LLM(model=str(tiny), quantization="int8", **ENGINE)


def test_act_order_g_idx_is_refused(tiny, tmp_path):
    quant, ref = tmp_path / "gptq", tmp_path / "reference"
    quantized_variant(tiny, quant, "gptq", ref)
    tensors = load_file(str(quant / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: GPTQ act-order .* is not supported"):
        LLM(model=str(quant), **ENGINE)


@pytest.mark.parametrize("tied", [True, False])
def test_int8_quantizes_the_lm_head_and_keeps_the_embedding_float(tmp_path, tied):
    """``int8`` also quantizes the LM head (its bytes dominate a one-token step); a tied head
    quantizes a copy of the embedding, whose rows stay float for the lookup."""
    from tokenmill.quant.int8 import quantize_int8

    path = make_tiny_checkpoint(tmp_path / "tiny", "llama", tie_word_embeddings=tied)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    llm = LLM(model=path, quantization="int8", **ENGINE)
    model = _model(llm)
    head, embed = model.lm_head, model.model.embed_tokens
    source = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
    codes, scale = quantize_int8(source.float())
    assert head.weight.dtype == torch.int8 and torch.equal(head.weight, codes)
    torch.testing.assert_close(head.weight_scale, scale)
    assert embed.weight.dtype == torch.float32
    torch.testing.assert_close(embed.weight, tensors["model.embed_tokens.weight"].float())
    hidden = torch.randn(3, embed.weight.shape[1])
    torch.testing.assert_close(
        head.compute_logits(hidden), hidden @ (codes.float() * scale[:, None]).T, rtol=1e-4, atol=1e-4
    )


def test_gptq_placeholder_biases_are_skipped_when_zero(tiny, tmp_path):
    """GPTQ tools store zero ``.bias`` tensors for bias-free layers; they are skipped (as vLLM
    skips them), and one with non-zero values is refused by name."""
    quant, ref = tmp_path / "gptq", tmp_path / "reference"
    quantized_variant(tiny, quant, "gptq", ref)
    tensors = load_file(str(quant / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".scales")]:
        tensors[name.replace(".scales", ".bias")] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)
    save_file(tensors, str(quant / "model.safetensors"))
    prompts = random_prompts(256)
    assert engine_greedy(quant, prompts, 12, **ENGINE)[0] == engine_greedy(ref, prompts, 12, **ENGINE)[0]
    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.5
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint weight 'model.layers.1.self_attn.o_proj.bias' \(a bias with non-zero values\) has no matching parameter in LlamaForCausalLM"):
        LLM(model=str(quant), **ENGINE)


def test_a_weight_of_the_wrong_shape_is_refused_by_name(tiny, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint tensor has shape \(32,\), parameter has \(64,\)"):
        LLM(model=str(path), **ENGINE)
