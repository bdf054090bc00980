"""The C paged decode attention over a float32 cache against the same over a float8 one, side by
side in one run: the default model's layer shape (9 heads, 3 KV heads of 64) and DeepSeek-V3's
absorbed MLA decode (16 heads over one 288-value latent), at several context lengths. Prints one
JSON line per case with the median milliseconds per call of each and their ratio.

    python benchmarks/kv_cache_fp8.py
    python benchmarks/kv_cache_fp8.py --batch 64 --contexts 512 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tokenmill  # noqa: F401  (sets the OpenMP wait policy before torch's threads start)
from tokenmill.ops import cpu as cpu_ops
from tokenmill.layers.kv_cache_quant import quantize

SHAPES = {"smollm2": (9, 3, 64), "mla-v3-shaped": (16, 1, 288)}
BLOCK_SIZE = 16


def time_decode(query, cache, block_table, seq_lens, max_len, repeats) -> float:
    out = torch.empty_like(query)
    rows = torch.arange(query.shape[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_ops.paged_decode_attention(
            query, out, rows, cache[0], cache[1], block_table, seq_lens, max_len, 0.125
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    assert cpu_ops.load() is not None, "the C kernels did not build"
    gen = torch.Generator().manual_seed(0)
    for name, (heads, kv_heads, head_size) in SHAPES.items():
        for context in args.contexts:
            blocks_per_req = -(-context // BLOCK_SIZE)
            num_blocks = args.batch * blocks_per_req
            cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size, generator=gen)
            fp8 = quantize(cache, 1.0, torch.float8_e4m3fn)
            block_table = torch.randperm(num_blocks, generator=gen).view(args.batch, blocks_per_req)
            seq_lens = torch.full((args.batch,), context, dtype=torch.int64)
            query = torch.randn(args.batch, heads, head_size, generator=gen)
            f32_ms = time_decode(query, cache, block_table, seq_lens, context, args.repeats)
            fp8_ms = time_decode(query, fp8, block_table, seq_lens, context, args.repeats)
            print(json.dumps({
                "shape": name, "batch": args.batch, "context": context,
                "float32_ms": round(f32_ms, 3), "fp8_ms": round(fp8_ms, 3),
                "fp8_speedup": round(f32_ms / fp8_ms, 2), "threads": torch.get_num_threads(),
            }))


if __name__ == "__main__":
    main()
