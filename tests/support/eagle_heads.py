"""Tiny random EAGLE-1 and EAGLE-3 heads in the layouts the EAGLE authors publish (shared by
the speculative-decoding tests and the conformance-kit run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _llama_layer(gen: torch.Generator, config: dict, input_size: int) -> dict[str, torch.Tensor]:
    """Random HF-named tensors of one Llama decoder layer whose QKV take ``input_size``."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    return {
        "self_attn.q_proj.weight": rand(q, input_size),
        "self_attn.k_proj.weight": rand(kv, input_size),
        "self_attn.v_proj.weight": rand(kv, input_size),
        "self_attn.o_proj.weight": rand(h, q),
        "mlp.gate_proj.weight": rand(inter, h),
        "mlp.up_proj.weight": rand(inter, h),
        "mlp.down_proj.weight": rand(h, inter),
        "post_attention_layernorm.weight": 1 + rand(h) / 2,
    }


def write_eagle_head(path: Path, target: str, draft_vocab_size: int | None = None, own_embedding: bool = False, seed: int = 0) -> str:
    """A random EAGLE-1 head (``draft_vocab_size`` None) or EAGLE-3 head for ``target``, in
    the published layouts: EAGLE-1 ``fc`` + ``layers.0`` (no input norm), EAGLE-3 ``fc`` over
    three layers + ``midlayer`` + ``norm`` + a reduced ``lm_head`` with ``d2t``/``t2d``."""
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = 1
    gen = torch.Generator().manual_seed(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    if draft_vocab_size is None:
        config["architectures"] = ["LlamaForCausalLM"]
        tensors = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.2}
        tensors |= {f"layers.0.{n}": t for n, t in _llama_layer(gen, config, h).items()}
    else:
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = draft_vocab_size
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        layer = _llama_layer(gen, config, 2 * h)
        layer |= {"input_layernorm.weight": 1 + torch.randn(h, generator=gen) / 10,
                  "hidden_norm.weight": 1 + torch.randn(h, generator=gen) / 10}
        tensors = {
            "fc.weight": torch.randn(h, 3 * h, generator=gen) * 0.2,
            "norm.weight": 1 + torch.randn(h, generator=gen) / 10,
            "lm_head.weight": torch.randn(draft_vocab_size, h, generator=gen),
            "d2t": ids - torch.arange(draft_vocab_size),
            "t2d": t2d,
            **{f"midlayer.{n}": t for n, t in layer.items()},
        }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)
