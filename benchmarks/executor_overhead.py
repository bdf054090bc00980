"""What running the model in worker processes costs per engine step: the default model's
decode steps through the ``uni`` executor (in the engine's process) and through ``mp`` at one
rank (the same forward, plus pickling each scheduler output to the worker over ZMQ and its
result back), and optionally ``mp`` at more ranks (plus the all-reduces).

    python benchmarks/executor_overhead.py [--batch 1 --output-len 64 --tp 1 3]

All engines are built first, then measured in alternating rounds (the best round of each
kept), so load on a shared machine hits them alike. Step time is wall time over the decode
steps of a batch that decodes together, after a warm-up request.
"""

from __future__ import annotations

import argparse
import time

from tokenmill import LLM, SamplingParams


def step_ms(llm: LLM, batch: int, output_len: int) -> float:
    prompts = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) / output_len * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tp", type=int, nargs="*", default=[1], help="mp ranks to measure")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; best kept")
    args = parser.parse_args()
    runs = [("uni", 1)] + [("mp", tp) for tp in args.tp]
    engines = {
        run: LLM(distributed_executor_backend=run[0], tensor_parallel_size=run[1], num_kv_blocks=256)
        for run in runs
    }
    results = {run: float("inf") for run in runs}
    for _ in range(args.repeats):
        for run, llm in engines.items():
            results[run] = min(results[run], step_ms(llm, args.batch, args.output_len))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    base = results["uni", 1]
    for (backend, tp), ms in results.items():
        print(f"{backend:>3} tp={tp}: {ms:7.2f} ms/step ({ms / base:.2f}x uni)")


if __name__ == "__main__":
    main()
