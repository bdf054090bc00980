"""DeepSeek-V3-shaped random model: tokenmill vs HF ``generate`` in one run, and the latent KV
cache's peak memory vs the MHA-equivalent layout.

The model (hidden 1024, 8 layers, 16 heads, q_lora 384, kv_lora 256 + rope 32, 32 routed
experts top-4 in 2 groups, 1 shared expert, one dense first layer) is built by transformers
with random weights and saved to a temporary directory. Both engines generate greedily with
``ignore_eos`` from the same random prompts; HF runs in batches of ``--hf-batch-size`` (all 32
at once by default; equal lengths, so no padding) with ``min_new_tokens`` so that it too
produces every output token. Prints one JSON line.

    python benchmarks/deepseek.py                     # 32 requests x (256 in, 128 out)
    python benchmarks/deepseek.py --num-prompts 4 --input-len 32 --output-len 8   # smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import transformers

from tokenmill.testing.checkpoints import NO_SPECIAL_TOKENS


def save_model(path: str, vocab_size: int) -> transformers.DeepseekV3Config:
    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        **NO_SPECIAL_TOKENS,
    )
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return config


def run_tokenmill(path: str, prompts: list[list[int]], output_len: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=path, enable_prefix_caching=False)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p}, params)
    peak_blocks, tokens = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        stats = engine.get_stats()
        peak_blocks = max(peak_blocks, stats["kv_blocks_total"] - stats["kv_blocks_free"])
    elapsed = time.perf_counter() - start
    runner = engine.engine_core.engine_core.executor.worker.model_runner
    specs = runner.get_kv_cache_specs()
    block_bytes = sum(spec.page_size_bytes for spec in specs.values())
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "peak_kv_blocks": peak_blocks,
        "peak_kv_bytes": peak_blocks * block_bytes,
        "block_size": runner.block_size,
    }


def run_hf(path: str, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i : i + batch_size])
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                        min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    tokens = len(prompts) * output_len
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="run tokenmill only")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, args.vocab_size, (args.num_prompts, args.input_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as path:
        config = save_model(path, args.vocab_size)
        result = {"tokenmill": run_tokenmill(path, prompts, args.output_len)}
        if not args.skip_hf:
            result["hf"] = run_hf(path, prompts, args.output_len, args.hf_batch_size)
            result["speedup"] = result["tokenmill"]["output_tok_per_s"] / result["hf"]["output_tok_per_s"]
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    mha = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    tm = result["tokenmill"]
    result["kv_bytes_per_token_per_layer"] = {"mla": latent * 4, "mha_equivalent": mha * 4}
    result["peak_kv_mib"] = {
        "mla": tm["peak_kv_bytes"] / 2**20,
        "mha_equivalent": tm["peak_kv_bytes"] * mha / latent / 2**20,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
