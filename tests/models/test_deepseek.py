"""DeepSeek-V2/V3 (MLA + MoE) against transformers on tiny random checkpoints, the latent KV
cache's size, the absorbed decode and the MLA backend selection."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_greedy_close, hf_greedy
from support.deepseek_checkpoints import COMMON, save_deepseek
from support.paged_forward import run_paged_forward
from tokenmill import LLM, SamplingParams
from tokenmill.attention_backends.cpu_mla import CpuMLABackend
from tokenmill.attention_backends.torch_mla import TorchMLABackend, TorchMLAImpl
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.interfaces.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec
from tokenmill.layers.build_context import BuildContext
from tokenmill.model_loader import load_hf_config, load_model
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.selector import choose_attention_backend

BLOCK_SIZE = 8
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=["v2", "v3"])
def checkpoint(request, tmp_path_factory):
    """(version, dir, HF model, prompts, HF greedy tokens and scores per prompt)."""
    path, hf = save_deepseek(tmp_path_factory.mktemp(request.param), request.param)
    rng = random.Random(0)
    prompts = [[rng.randrange(COMMON["vocab_size"]) for _ in range(n)] for n in (3, 9, 16, 17, 24, 31, 40, 57)]
    refs = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    return request.param, path, hf, prompts, refs


def _generate_and_check(llm: LLM, prompts, refs) -> None:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (ref, scores) in zip(outputs, refs):
        assert_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, scores)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("backend", ["cpu_mla", "torch_mla"])
def test_greedy_matches_hf_chunked_prefill_and_prefix_cache_rerun(checkpoint, backend):
    _, path, _, prompts, refs = checkpoint
    llm = LLM(
        model=path, num_kv_blocks=128, block_size=BLOCK_SIZE, max_model_len=256,
        max_num_batched_tokens=16, attention_backend=backend,
    )
    _generate_and_check(llm, prompts, refs)
    assert llm.get_stats()["prefix_cache_hit_tokens"] == 0
    _generate_and_check(llm, prompts, refs)
    assert llm.get_stats()["prefix_cache_hit_tokens"] > 0


def test_greedy_matches_hf_under_preemption(checkpoint):
    _, path, _, prompts, refs = checkpoint
    llm = LLM(
        model=path, num_kv_blocks=16, block_size=BLOCK_SIZE, max_model_len=128,
        max_num_batched_tokens=48, watermark=0.0,
    )
    _generate_and_check(llm, prompts, refs)
    assert llm.get_stats()["num_preemptions"] > 0


def test_prefill_and_decode_logits_match_hf(checkpoint):
    version, path, hf, _, _ = checkpoint
    config = load_hf_config(path)
    model = load_model(path, config, BuildContext(TorchMLABackend), "cpu")
    assert type(model).__name__ == f"Deepseek{version.upper()}ForCausalLM"
    token_ids = torch.randint(0, COMMON["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(token_ids[None]).logits[0].float()
    assert (run_paged_forward(model, TorchMLABackend, token_ids, [24], BLOCK_SIZE) - expected).abs().max() < 1e-4
    # a prefix chunk, single-token (absorbed) decodes, then a chunk over cached latents
    assert (run_paged_forward(model, TorchMLABackend, token_ids, [13, 1, 1, 9], BLOCK_SIZE) - expected).abs().max() < 1e-4


def test_v3_layout(tmp_path):
    path, _ = save_deepseek(tmp_path, "v3")
    model = load_model(path, load_hf_config(path), BuildContext(TorchMLABackend), "cpu")
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "LlamaMLP"
    experts = layers[1].mlp.experts
    assert experts.scoring_func == "sigmoid" and experts.e_score_correction_bias is not None
    assert experts.w13_weight.shape == (8, 2 * 32, 64) and experts.w2_weight.shape == (8, 64, 32)
    assert layers[1].self_attn.q_lora_rank == 24
    assert not layers[1].self_attn.rotary_emb.is_neox_style


def test_mla_kv_bytes_and_block_count():
    """One latent per token per layer; with equal memory, the MHA-equivalent layout (K and V for
    every head) fits ``2·heads·head_dim / (kv_lora_rank + rope_dim)`` times fewer blocks."""
    heads, qk_head_dim = COMMON["num_attention_heads"], COMMON["qk_nope_head_dim"] + COMMON["qk_rope_head_dim"]
    latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    for dtype in (torch.float32, torch.bfloat16):
        item = torch.empty((), dtype=dtype).element_size()
        mla = MLAAttentionSpec(BLOCK_SIZE, dtype, latent)
        mha = FullAttentionSpec(BLOCK_SIZE, dtype, heads, qk_head_dim)
        assert mla.page_size_bytes == BLOCK_SIZE * latent * item
        budget = 1 << 20
        ratio = (budget // mla.page_size_bytes) / (budget // mha.page_size_bytes)
        assert ratio == pytest.approx(2 * heads * qk_head_dim / latent, rel=0.01)


def test_engine_sizes_latent_cache(tmp_path):
    path, _ = save_deepseek(tmp_path, "v3")
    budget = 1 << 20
    llm = LLM(model=path, kv_cache_memory_bytes=budget, block_size=BLOCK_SIZE, max_model_len=128)
    latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    per_block = COMMON["num_hidden_layers"] * BLOCK_SIZE * latent * 4
    assert llm.get_stats()["kv_blocks_total"] == budget // per_block
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    caches = [layer.kv_cache for layer in runner.attention_layers().values()]
    assert len(caches) == COMMON["num_hidden_layers"]
    assert all(c.shape == (budget // per_block, BLOCK_SIZE, latent) for c in caches)


def test_absorbed_decode_equals_decompressed():
    heads, nope, rope, v, rank = 4, 16, 8, 12, 32
    gen = torch.Generator().manual_seed(0)
    kv_b_proj = torch.nn.Linear(rank, heads * (nope + v), bias=False)
    kv_b_proj.weight.data = torch.randn(heads * (nope + v), rank, generator=gen) * 0.3
    impl = TorchMLAImpl(
        heads, rank + rope, 0.2, 1, kv_lora_rank=rank, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, kv_b_proj=kv_b_proj,
    )
    batch, ctx = 3, 21
    q = torch.randn(batch, heads, nope + rope, generator=gen)
    latents = torch.randn(batch, ctx, rank + rope, generator=gen)
    lens = torch.tensor([5, 21, 13])
    mask = torch.arange(ctx)[None, :] < lens[:, None]
    absorbed = impl.attend_absorbed(q, latents, mask)
    for b in range(batch):
        everything = torch.ones(1, int(lens[b]), dtype=torch.bool)
        ref = impl.attend_decompressed(q[b : b + 1], latents[b, : lens[b]], everything)
        assert (absorbed[b] - ref[0]).abs().max() < 1e-4


def test_selector_picks_mla_backend_and_keeps_reasons():
    config = AttentionConfig(head_size=24, dtype=torch.float32, use_mla=True)
    backend, why = choose_attention_backend(CpuPlatform, config)
    assert backend is CpuMLABackend
    assert "cpu_sdpa: MLA models need an MLA backend" in why
    assert "torch: MLA models need an MLA backend" in why
    with pytest.raises(ValueError, match="serves MLA models only"):
        choose_attention_backend(CpuPlatform, AttentionConfig(head_size=64, dtype=torch.float32), "torch_mla")


def test_non_mla_backend_refused_for_deepseek(tmp_path):
    path, _ = save_deepseek(tmp_path, "v2")
    with pytest.raises(ValueError, match="MLA models need an MLA backend"):
        LLM(model=path, attention_backend="torch", num_kv_blocks=16, max_model_len=64)


def test_plugins_command_lists_deepseek_models_and_mla_backends(capsys):
    from tokenmill import cli

    assert cli.main(["plugins"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    for name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepSeekMTPModel"):
        assert "from tokenmill" in lines[name]
    assert "unavailable" not in lines["torch_mla"], "an MLA backend is checked against an MLA model"
    assert "triton_mla" in lines


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    path, hf = save_deepseek(tmp_path_factory.mktemp("v3_quant"), "v3")
    rng = random.Random(1)
    prompts = [[rng.randrange(COMMON["vocab_size"]) for _ in range(n)] for n in (5, 17, 33)]
    return path, prompts, [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_quantized_experts_match_hf(v3_checkpoint, method):
    """int8 / w8a8 quantize every linear layer of DeepSeek-V3 (MLA dequantizes ``kv_b_proj``
    once for its absorbed forms) and its MoE experts (each expert's two projections by the
    method's linear kernels): greedy tokens still match the float HF model by the top-5 rule,
    and the experts hold int8 codes, not the float stacks."""
    from tokenmill.layers.fused_moe import FusedMoE

    path, prompts, refs = v3_checkpoint
    llm = LLM(model=path, num_kv_blocks=128, block_size=BLOCK_SIZE, max_model_len=256, quantization=method)
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes
    for moe in moes:
        assert not hasattr(moe, "w13_weight") and not hasattr(moe, "w2_weight")
        assert all(p.weight.dtype == torch.int8 for pair in moe.quantized_experts for p in pair)
    _generate_and_check(llm, prompts, refs)
