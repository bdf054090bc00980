"""Latency of one batch end to end (vLLM's ``bench latency``)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from tokenmill.benchmarks.dataset import random_requests

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.cli import add_engine_args

    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured runs first")
    parser.add_argument("--num-iters", type=int, default=3, help="measured runs")
    parser.add_argument("--output-json", default=None, help="file to write the results to as JSON")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.cli import engine_kwargs
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["enable_prefix_caching"] = False
    llm = LLM(**kwargs)
    requests = random_requests(
        args.batch_size, args.input_len, args.output_len, 0.0, llm.llm_engine.vocab_size, args.seed
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        once()
    latencies = np.array(
        [once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    )
    print(f"Avg latency: {latencies.mean():.4f} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {np.percentile(latencies, p):.4f} seconds")
    tpot_ms = latencies.mean() / args.output_len * 1000
    print(f"Time per output token (batch of {args.batch_size}): {tpot_ms:.2f} ms")
    if args.output_json:
        result = {
            "avg_latency": float(latencies.mean()),
            "latencies": latencies.tolist(),
            "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
            "time_per_output_token_ms": tpot_ms,
        }
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
