"""The Triton backend against the reference backend, on the GPU when there is one and otherwise
on the CPU under the Triton interpreter; and explicit backend selection: honoured, or refused
with the reasons, never replaced."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill.testing.paged import MIXED_SHAPES, random_batch, run_backend, run_reference
from tokenmill import LLM, SamplingParams
from tokenmill.attention_backends.triton_attn import TritonAttentionBackend
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.selector import select_attention_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

triton = pytest.importorskip("triton")
if DEVICE == "cpu" and type(triton.language.sum).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "triton was imported without TRITON_INTERPRET=1 on a machine without a GPU "
        "(tests/conftest.py sets it before any test module loads)"
    )


# (num_heads, num_kv_heads, head_size, block_size): MHA, GQA 4:1, GQA 3:1, MQA
LAYOUTS = [(4, 4, 64, 16), (8, 2, 64, 16), (6, 2, 128, 8), (4, 1, 128, 32)]


@pytest.mark.parametrize("shape", MIXED_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_on_mixed_batches(layout, shape):
    num_heads, num_kv_heads, head_size, block_size = layout
    batch = random_batch(*shape, num_heads, num_kv_heads, head_size, block_size, device=DEVICE)
    out, cache = run_backend(TritonAttentionBackend, batch)
    ref_out, ref_cache = run_reference(batch)
    assert (out - ref_out).abs().max() <= 1e-3
    assert torch.equal(cache, ref_cache)


def test_matches_reference_in_float16():
    batch = random_batch(*MIXED_SHAPES[0], 8, 2, 128, 16, dtype=torch.float16, device=DEVICE)
    out, cache = run_backend(TritonAttentionBackend, batch)
    ref_out, ref_cache = run_reference(batch)
    assert out.dtype == torch.float16
    assert (out.float() - ref_out).abs().max() <= 2e-3
    assert torch.equal(cache.float(), ref_cache)


def test_padding_requests_write_nothing_and_get_zeros():
    """CUDA-graph padding: slot -1 skips the write, a zero-length request attends to nothing."""
    from tokenmill.attention_backends.triton_kernels import reshape_and_cache

    batch = random_batch([1, 1, 1], [5, 0, 0], 4, 2, 64, 16, device=DEVICE)
    common = batch.common
    common.seq_lens[1:] = 0
    common.seq_lens_cpu[1:] = 0
    common.slot_mapping[1:] = -1
    out, cache = run_backend(TritonAttentionBackend, batch)
    assert torch.all(out[1:] == 0)
    assert torch.isfinite(out).all()
    expected = batch.kv_cache.clone()
    reshape_and_cache(
        batch.key[:1], batch.value[:1], expected[0], expected[1], common.slot_mapping[:1]
    )
    assert torch.equal(cache, expected)


def test_engine_greedy_tokens_match_reference(tmp_path):
    """A tiny model through the whole engine: chunked prefills mixed with decodes."""
    model = make_tiny_checkpoint(tmp_path)
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 12 + 13 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=model,
            attention_backend=backend,
            num_kv_blocks=32,
            block_size=8,
            max_model_len=128,
            max_num_batched_tokens=16,
        )
        tokens[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert tokens["triton"] == tokens["torch"]


CPU_FP32 = AttentionConfig(head_size=64, dtype=torch.float32, device_type="cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = TritonAttentionBackend.validate_configuration(CPU_FP32)
    assert any("TRITON_INTERPRET=1" in r for r in reasons)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.validate_configuration(CPU_FP32) == []


def test_explicit_backend_is_honoured_when_it_can_serve(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention_backend(CpuPlatform, CPU_FP32, "triton") is TritonAttentionBackend
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "triton")
    assert select_attention_backend(CpuPlatform, CPU_FP32) is TritonAttentionBackend


@pytest.mark.parametrize(
    "name, reason",
    [
        ("triton", "TRITON_INTERPRET=1"),
        ("flash_attn", "needs an NVIDIA CUDA device"),
        ("flashinfer", "needs an NVIDIA CUDA device"),
    ],
)
def test_explicit_backend_that_cannot_serve_is_refused(monkeypatch, name, reason):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"attention backend '{name}' cannot be used:.*{reason}"):
        select_attention_backend(CpuPlatform, CPU_FP32, name)
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", name)
    with pytest.raises(ValueError, match=reason):
        select_attention_backend(CpuPlatform, CPU_FP32)


def test_engine_refuses_an_explicit_backend_instead_of_replacing_it(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="'flashinfer' cannot be used:.*not installed|CUDA"):
        LLM(model=model, attention_backend="flashinfer", num_kv_blocks=8)
