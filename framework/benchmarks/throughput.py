"""Offline throughput: all requests submitted at once (vLLM's ``bench throughput``)."""

from __future__ import annotations

import argparse
import json
import time

from tokenmill.benchmarks.dataset import add_dataset_arguments, random_requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.cli import add_engine_args

    add_dataset_arguments(parser)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy"
    )
    parser.add_argument("--output-json", default=None, help="file to write the results to as JSON")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.cli import engine_kwargs
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    requests = random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.random_range_ratio,
        llm.llm_engine.vocab_size,
        args.seed,
        tokenizer.all_special_ids if tokenizer is not None else (),
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
