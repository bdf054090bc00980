"""Tiny random Llama / Mistral / Qwen2 checkpoints written by transformers, loaded through the
model loader and run on the reference attention backend: logits must match HF's."""

from __future__ import annotations

import faulthandler
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file, save_file

from support.paged_forward import run_paged_forward
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers.build_context import BuildContext
from tokenmill.model_loader import load_hf_config, load_model

BLOCK_SIZE = 16
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,
)

CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-gqa-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1),
    ),
    "mistral-head-dim": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(head_dim=32, num_key_value_heads=2, sliding_window=None),
    ),
    "qwen2-tied-gqa": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, num_key_value_heads=2),
    ),
}


def _save_tiny(tmp_path, config_name: str, model_name: str, overrides: dict):
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_name)(config).eval()
    if getattr(hf_model.config, "attention_bias", False) or model_name.startswith("Qwen2"):
        for name, p in hf_model.named_parameters():  # HF zero-inits biases; make them count
            if name.endswith("bias"):
                p.data.normal_(std=0.1)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    return hf_model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case: str) -> None:
    config_name, model_name, overrides = CASES[case]
    hf_model = _save_tiny(tmp_path, config_name, model_name, overrides)
    hf_config = load_hf_config(tmp_path)
    model = load_model(tmp_path, hf_config, BuildContext(attn_backend=TorchRefBackend), "cpu")
    assert type(model).__name__ == model_name
    if hf_config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    token_ids = torch.randint(0, TINY["vocab_size"], (20,))
    with torch.inference_mode():
        expected = hf_model(token_ids[None]).logits[0].float()

    full = run_paged_forward(model, TorchRefBackend, token_ids, [20], BLOCK_SIZE)
    assert full.shape == (20, TINY["vocab_size"]) and full.dtype == torch.float32
    assert (full - expected).abs().max() < 1e-4

    stepped = run_paged_forward(model, TorchRefBackend, token_ids, [17, 1, 2], BLOCK_SIZE)
    assert (stepped - expected).abs().max() < 1e-4


def _tp_worker(rank: int, store: str, done, jobs: list[tuple[str, torch.Tensor, str]]) -> None:
    faulthandler.enable()  # a native abort prints every thread's Python stack
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        for model_dir, token_ids, out in jobs:
            config = load_hf_config(model_dir)
            model = load_model(model_dir, config, BuildContext(TorchRefBackend), "cpu")
            attn = model.model.layers[0].self_attn
            assert attn.num_heads == config.num_attention_heads // 2
            logits = run_paged_forward(model, TorchRefBackend, token_ids, [17, 1, 2], BLOCK_SIZE)
            if rank == 0:
                torch.save(logits, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Neither rank exits (closing its gloo sockets) while the other may still be tearing down.
    done.wait(timeout=60)


def test_tensor_parallel_2_matches_transformers(tmp_path) -> None:
    """Two gloo ranks: sharded heads (the single KV head of ``llama-biases`` replicated),
    row-parallel biases counted once, vocabulary-sharded embedding and (tied) LM head."""
    jobs, expected = [], []
    for case in ("llama-biases", "llama-tied-gqa-llama3"):
        model_dir = tmp_path / case
        hf_model = _save_tiny(model_dir, *CASES[case])
        token_ids = torch.randint(0, TINY["vocab_size"], (20,))
        with torch.inference_mode():
            expected.append(hf_model(token_ids[None]).logits[0].float())
        jobs.append((str(model_dir), token_ids, str(model_dir / "logits.pt")))
    done = mp.get_context("spawn").Barrier(2)
    mp.spawn(_tp_worker, args=(str(tmp_path / "store"), done, jobs), nprocs=2)
    for (_, _, out), ref in zip(jobs, expected):
        assert (torch.load(out) - ref).abs().max() < 1e-4


def test_missing_weights_are_reported(tmp_path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM", {})
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_model(tmp_path, load_hf_config(tmp_path), BuildContext(TorchRefBackend), "cpu")


def test_unknown_checkpoint_weight_is_reported(tmp_path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM", {})
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.extra.weight"):
        load_model(tmp_path, load_hf_config(tmp_path), BuildContext(TorchRefBackend), "cpu")


def test_load_hf_config_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)


def test_importing_models_plugin_is_lazy() -> None:
    code = (
        "import sys, tokenmill.models; "
        "assert 'tokenmill.models.llama' not in sys.modules; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
