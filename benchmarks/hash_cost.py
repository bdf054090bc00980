"""Cost of prefix-cache block hashing per algorithm on the fixed benchmark's shape.

Each request is created with its prompt (hashing its full blocks) and then gets its output
tokens one per step, as in decoding, so the block hasher runs as it does in the engine.

    python benchmarks/hash_cost.py [--num-prompts 64 --input-len 256 --output-len 128]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.engine_args import HASH_ALGOS
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def one_pass(hasher, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    params = SamplingParams()
    start = time.perf_counter()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        request = Request(str(i), prompt, params, None, len(output), block_hasher=hasher)
        for token in output:
            request.append_output_token_ids([token])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts, outputs = (
        [[rng.randrange(49152) for _ in range(length)] for _ in range(args.num_prompts)]
        for length in (args.input_len, args.output_len)
    )
    num_blocks = args.num_prompts * ((args.input_len + args.output_len) // args.block_size)
    baseline = min(one_pass(None, prompts, outputs) for _ in range(args.repeats))
    print(f"{num_blocks} blocks; requests without hashing: {baseline * 1e3:.2f} ms")
    for algo in HASH_ALGOS:
        hasher = make_block_hasher(args.block_size, algo)
        best = min(one_pass(hasher, prompts, outputs) for _ in range(args.repeats))
        cost = best - baseline
        print(
            f"{algo:>8}: {cost * 1e3:.2f} ms hashing per workload, "
            f"{cost / num_blocks * 1e6:.2f} us per block"
        )


if __name__ == "__main__":
    main()
