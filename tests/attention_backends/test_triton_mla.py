"""The Triton MLA decode kernel and backend against the torch MLA reference, on the GPU when
there is one and otherwise on the CPU under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from support.deepseek_checkpoints import save_deepseek
from tokenmill import LLM, SamplingParams
from tokenmill.attention_backends.torch_mla import TorchMLAImpl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

triton = pytest.importorskip("triton")
if DEVICE == "cpu" and type(triton.language.sum).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "triton was imported without TRITON_INTERPRET=1 on a machine without a GPU "
        "(tests/conftest.py sets it before any test module loads)"
    )


@pytest.mark.parametrize("heads, rank, rope", [(4, 16, 8), (20, 64, 16), (16, 512, 64)])
def test_decode_kernel_matches_reference(heads, rank, rope):
    from tokenmill.attention_backends.triton_mla_kernels import mla_decode

    nope, v = 16, 8
    gen = torch.Generator().manual_seed(0)
    kv_b_proj = torch.nn.Linear(rank, heads * (nope + v), bias=False)
    kv_b_proj.weight.data = torch.randn(heads * (nope + v), rank, generator=gen) * 0.2
    impl = TorchMLAImpl(
        heads, rank + rope, 0.15, 1, kv_lora_rank=rank, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, kv_b_proj=kv_b_proj.to(DEVICE),
    )
    num_slots, lens = 200, torch.tensor([1, 37, 70])
    cache = torch.randn(num_slots, rank + rope, generator=gen)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:70] for _ in lens])
    q = torch.randn(len(lens), heads, nope + rope, generator=gen)
    mask = torch.arange(70)[None, :] < lens[:, None]
    expected = impl.attend_absorbed(q.to(DEVICE), cache.to(DEVICE)[slots.to(DEVICE)], mask.to(DEVICE))
    o_lat = mla_decode(
        impl.absorb_query(q.to(DEVICE)).contiguous(), cache.to(DEVICE), slots.to(DEVICE),
        lens.to(DEVICE, torch.int32), rank, 0.15,
    )
    assert (impl.absorb_output(o_lat) - expected).abs().max() < 1e-4


def test_engine_greedy_tokens_match_torch_mla(tmp_path):
    path, _ = save_deepseek(tmp_path, "v3")
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 12 + 13 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch_mla", "triton_mla"):
        llm = LLM(
            model=path, attention_backend=backend, num_kv_blocks=32, block_size=8,
            max_model_len=128, max_num_batched_tokens=16,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton_mla"] == tokens["torch_mla"]


def test_triton_mla_on_cpu_needs_the_interpreter(monkeypatch):
    from tokenmill.attention_backends.triton_mla import TritonMLABackend
    from tokenmill.interfaces.attention import AttentionConfig

    config = AttentionConfig(head_size=576, dtype=torch.float32, use_mla=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert any("TRITON_INTERPRET=1" in r for r in TritonMLABackend.validate_configuration(config))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonMLABackend.validate_configuration(config) == []
