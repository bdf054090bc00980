"""Tiny random checkpoints saved by transformers, and the greedy runs the suites compare."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""Config fields of a random model without special tokens (no EOS: generation runs to length)."""

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    **NO_SPECIAL_TOKENS,
)
"""Generic tiny sizes; transformers' ``attribute_map`` translates them for configs that
spell them differently (GPT-2's ``n_embd``, ``n_layer``, ...)."""


def hf_model_class(arch: str) -> type | None:
    """transformers' class for architecture ``arch``, or None when it has none."""
    import transformers

    cls = getattr(transformers, arch, None)
    return cls if isinstance(cls, type) and hasattr(cls, "config_class") else None


def save_tiny_checkpoint(arch: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random transformers model of ``arch`` (float32, no tokenizer) under
    ``path``. One-dimensional parameters (biases, norm weights) are perturbed so that a
    model that drops them shows it."""
    model_cls = hf_model_class(arch)
    if model_cls is None:
        raise LookupError(f"transformers has no class {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class(**{**TINY_CONFIG, **overrides})).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def random_prompts(vocab_size: int, lengths: tuple[int, ...] = (5, 17, 33, 40), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def engine_greedy(path: Path, prompts: list[list[int]], max_tokens: int, **engine_args) -> tuple[list[list[int]], dict]:
    """Greedy tokens of every prompt through ``LLM`` with ``engine_args``, and the engine's
    stats afterwards."""
    from tokenmill import LLM, SamplingParams

    args = {**dict(block_size=8, max_model_len=256, num_kv_blocks=64), **engine_args}
    llm = LLM(model=str(path), **args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm.get_stats()


def first_divergence(path: Path, prompt: list[int], ours: list[int], tie: float = 1e-4) -> str | None:
    """Where ``ours`` (a greedy continuation of ``prompt``) leaves transformers' greedy
    continuation, described; None when it never does. A position where our token's logit is
    within ``tie`` of HF's best is a tie, and the comparison stops there."""
    model_cls = hf_model_class(_architecture(path))
    model = model_cls.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for k, token in enumerate(ours):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            best = int(logits.argmax())
            if best != token:
                if logits[best] - logits[token] <= tie:
                    return None
                return (
                    f"position {k}: ours {token} (logit {logits[token]:.4f}), transformers "
                    f"{best} (logit {logits[best]:.4f})"
                )
            ids.append(token)
    return None


def _architecture(path: Path) -> str:
    return json.loads((Path(path) / "config.json").read_text())["architectures"][0]
