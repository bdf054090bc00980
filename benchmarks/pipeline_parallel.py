"""What the engine core's batch queue gains under pipeline parallelism: the default model in
two stages (``pipeline_parallel_size=2``, one worker process each) with the queue (a step
per stage in flight) and without it (``TOKENMILL_PP_BATCH_QUEUE=0``: one step at a time),
on the same batch-parallel workload.

    python benchmarks/pipeline_parallel.py [--num-prompts 32 --input-len 64 --output-len 32]

The token budget holds half the prompts, so the requests form two batches that alternate
through the stages. Both engines are built first, then measured in alternating rounds (the
best round of each kept). Besides wall time and output tokens/s it prints, from the workers'
step intervals (``Executor.step_intervals``), the seconds both stages computed at once: zero
without the queue.
"""

from __future__ import annotations

import argparse
import os
import time

from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import random_prompts


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which both ranks were busy."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


QUEUE_ENV = {True: {"TOKENMILL_PP_BATCH_QUEUE": "1"}, False: {"TOKENMILL_PP_BATCH_QUEUE": "0"}}
"""The executor reads the switch when the engine is built."""


def build(queue: bool, budget: int) -> LLM:
    os.environ.update(QUEUE_ENV[queue])
    return LLM(
        pipeline_parallel_size=2,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        num_kv_blocks=256,
        max_model_len=512,
    )


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, float]:
    """Wall seconds of the batch, seconds both stages were busy, seconds stage 1 was busy."""
    executor = llm.llm_engine.engine_core.engine_core.executor
    start = time.monotonic()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    end = time.monotonic()
    first, last = (
        [(s, e) for s, e in intervals if s >= start] for intervals in executor.step_intervals()
    )
    return end - start, overlap_s(first, last), sum(e - s for s, e in last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; best kept")
    args = parser.parse_args()
    prompts = random_prompts(49152, (args.input_len,) * args.num_prompts, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    budget = args.input_len * -(-args.num_prompts // 2)
    engines = {queue: build(queue, budget) for queue in (True, False)}
    best: dict[bool, tuple[float, float, float]] = {}
    for _ in range(args.repeats):
        for queue, llm in engines.items():
            result = measure(llm, prompts, params)
            if queue not in best or result[0] < best[queue][0]:
                best[queue] = result
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    num_tokens = args.num_prompts * args.output_len
    for queue, (wall, both, last_busy) in best.items():
        name = "with the batch queue" if queue else "one step at a time"
        print(
            f"pp=2 {name:>22}: {wall:6.2f} s, {num_tokens / wall:6.1f} output tok/s; "
            f"both stages busy {both:5.2f} s of stage 1's {last_busy:5.2f} s"
        )
    print(f"speedup with the queue: {best[False][0] / best[True][0]:.2f}x")


if __name__ == "__main__":
    main()
