"""Online serving benchmark against a running server (vLLM's ``bench serve``, client side).

Streams ``/v1/completions`` with random token-id prompts, arriving all at once or as a
Poisson (gamma, with ``--burstiness``) process, at most ``--max-concurrency`` in flight. The
default workload (100 prompts of 128 tokens in, 64 out) suits a small CPU server; vLLM's is
1000 prompts of 1024 in, 128 out."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from tokenmill.benchmarks.dataset import RANGE_RATIO_HELP, BenchRequest, random_requests

REQUEST_TIMEOUT_S = 600.0


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="openai", choices=["openai"], help="the server's API")
    parser.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--port", type=int, default=8000, help="server port")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions path")
    parser.add_argument(
        "--model", default=None, help="model name to request; None: the server's first"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir for the random prompts; None: the default model's",
    )
    parser.add_argument(
        "--dataset-name", default="random", choices=["random"], help="prompts of random token ids"
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument(
        "--random-input-len", type=int, default=128, help="prompt tokens per request"
    )
    parser.add_argument(
        "--random-output-len", type=int, default=64, help="output tokens per request"
    )
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help=RANGE_RATIO_HELP)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once"
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight; None: no limit"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly the output lengths"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"comma-separated metrics to report: {', '.join(_HEADINGS)}",
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles to report"
    )
    parser.add_argument("--api-key", default=None, help="send 'Authorization: Bearer KEY'")
    parser.add_argument("--output-json", default=None, help="file to write the results to as JSON")
    parser.add_argument(
        "--disable-tqdm", action="store_true", help="no progress bar of finished requests"
    )


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(benchmark(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] else 1


async def benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark, print vLLM's report and return its figures."""
    import httpx

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests = _dataset(args)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=args.disable_tqdm)

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await _send(client, args, model, request)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        with bar:
            async for request in _arrivals(requests, args.request_rate, args.burstiness, args.seed):
                tasks.append(asyncio.create_task(limited(request)))
            results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    report = _report(args, results, duration)
    _print_report(args, report)
    return report


def _dataset(args: argparse.Namespace) -> list[BenchRequest]:
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from tokenmill.default_model import default_model_path

        args.tokenizer = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        tokenizer.vocab_size,
        args.seed,
        tokenizer.all_special_ids,
    )


async def _arrivals(requests: list[BenchRequest], rate: float, burstiness: float, seed: int):
    """Yield requests at their arrival times: at once for an infinite rate, else with gamma
    intervals of mean ``1/rate`` (exponential when ``burstiness`` is 1)."""
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        yield request


async def _send(
    client, args: argparse.Namespace, model: str, request: BenchRequest
) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                )
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _report(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [t for r in ok for t in r.itl],
        "e2el": [r.latency for r in ok],
    }
    report = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": [r.error for r in results if not r.success],
    }
    for metric in args.percentile_metrics.split(","):
        ms = np.array(values[metric]) * 1000 if values[metric] else np.zeros(1)
        report[f"mean_{metric}_ms"] = float(ms.mean())
        report[f"median_{metric}_ms"] = float(np.median(ms))
        report[f"std_{metric}_ms"] = float(ms.std())
        for p in args.metric_percentiles.split(","):
            report[f"p{p}_{metric}_ms"] = float(np.percentile(ms, float(p)))
    return report


_HEADINGS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _print_report(args: argparse.Namespace, r: dict) -> None:
    line = "{:<40} {:<10}"
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    print(line.format("Successful requests:", r["completed"]))
    print(line.format("Failed requests:", r["failed"]))
    if r["max_concurrency"] is not None:
        print(line.format("Maximum request concurrency:", r["max_concurrency"]))
    print(line.format("Benchmark duration (s):", f"{r['duration']:.2f}"))
    print(line.format("Total input tokens:", r["total_input_tokens"]))
    print(line.format("Total generated tokens:", r["total_output_tokens"]))
    print(line.format("Request throughput (req/s):", f"{r['request_throughput']:.2f}"))
    print(line.format("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"))
    print(line.format("Total Token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"))
    for metric in args.percentile_metrics.split(","):
        heading, name = _HEADINGS[metric]
        print("{s:{c}^50}".format(s=heading, c="-"))
        print(line.format(f"Mean {name} (ms):", f"{r[f'mean_{metric}_ms']:.2f}"))
        print(line.format(f"Median {name} (ms):", f"{r[f'median_{metric}_ms']:.2f}"))
        for p in args.metric_percentiles.split(","):
            print(line.format(f"P{p} {name} (ms):", f"{r[f'p{p}_{metric}_ms']:.2f}"))
    if r["errors"]:
        print("First errors:", *r["errors"][:5], sep="\n  ")
    print("=" * 50)
