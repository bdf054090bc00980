"""Throughput with structured outputs vs without, at a fixed number of concurrent requests.

The same prompts run through one ``AsyncLLM`` (engine core in its own process, as served)
alternately without a constraint and with a JSON schema (nested objects, enums, arrays), each
with at most ``--concurrency`` requests in flight; output tokens per second of each run and the
ratio are printed. Unconstrained runs use ``ignore_eos`` so that both produce long outputs; the
schema is open-ended (an array of records), so constrained outputs run long too.

    python benchmarks/structured_output.py [--num-prompts 48 --concurrency 16 --max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.output_processor import RequestOutputKind
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "role", "tags", "address"],
    },
    "minItems": 8,
}


async def run(engine: AsyncLLM, prompts: list[str], params: SamplingParams, concurrency: int) -> tuple[int, float, int]:
    """(output tokens, seconds, outputs that parse as JSON)."""
    gate = asyncio.Semaphore(concurrency)
    counts: list[int] = []
    parsed = 0

    async def one(i: int, prompt: str) -> None:
        nonlocal parsed
        async with gate:
            async for out in engine.generate(prompt, params, f"r{time.monotonic_ns()}-{i}", RequestOutputKind.FINAL_ONLY):
                if out.finished:
                    counts.append(len(out.outputs[0].token_ids))
                    try:
                        json.loads(out.outputs[0].text)
                        parsed += 1
                    except json.JSONDecodeError:
                        pass

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - start, parsed


async def main_async(args: argparse.Namespace) -> None:
    engine = AsyncLLM.from_engine_args(max_num_seqs=args.concurrency)
    prompts = [f"List people from city number {i} as JSON records:" for i in range(args.num_prompts)]
    plain = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.8, seed=0, max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    await run(engine, prompts[: args.concurrency], constrained, args.concurrency)
    results: dict[str, list[float]] = {"plain": [], "structured": []}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("structured", constrained)):
            tokens, seconds, _ = await run(engine, prompts, params, args.concurrency)
            results[name].append(tokens / seconds)
            print(f"{name:>10}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} output tok/s", flush=True)
    engine.shutdown()
    plain_best, structured_best = max(results["plain"]), max(results["structured"])
    print(f"best: plain {plain_best:.1f}, structured {structured_best:.1f} output tok/s; "
          f"structured / plain = {structured_best / plain_best:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
