"""Where a single-stream decode step of the default model goes, on the CPU: the step's CPU
decode graph (one row, after a 256-token prompt and 64 decoded tokens, so attention reads about
320 positions) split into its kernels, each call timed alone; the whole graph replayed as one
plan (``cpu_ops.run_plan``: one C call, one OpenMP region) and as its kernel calls one ctypes
call each (the replay before plans), alternated round by round; the LM head
(``compute_logits``, outside the graph); and the engine's decode time per token (128 greedy
tokens minus a 1-token run of the same prompt). Best and median of the rounds, wall time.

Each kernel alone runs on weights its previous repeat left in cache, so its time is the
kernel's compute, not the memory traffic a replay meets; the replays read from memory as a
step does.

    python benchmarks/decode_step.py --quantization gguf --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

PROMPT_LEN, CONTEXT_TOKENS, OUTPUT_LEN = 256, 64, 128


def timings(fn, rounds: int, inner: int) -> list[float]:
    fn()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - start) / inner)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf", help="'none' for float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tokenmill import LLM, SamplingParams
    from tokenmill.ops import cpu as cpu_ops

    # The plans keep no kernel calls; keep each plan's, to replay them one by one.
    calls_of: dict[int, list[tuple[str, tuple]]] = {}
    pack_plan = cpu_ops.pack_plan

    def keeping_calls(calls):
        plan = pack_plan(calls)
        calls_of[id(plan)] = calls
        return plan

    cpu_ops.pack_plan = keeping_calls
    llm = LLM(enable_prefix_caching=False, quantization=None if args.quantization == "none" else args.quantization)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    graphs = runner.graphs
    if graphs is None or 1 not in graphs.graphs:
        raise SystemExit(f"no CPU decode graph of one row for quantization={args.quantization}")
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 40000, PROMPT_LEN).tolist()}

    def generate(max_tokens: int) -> float:
        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    engine = [(generate(OUTPUT_LEN) - generate(1)) / (OUTPUT_LEN - 1) for _ in range(3)]

    # The graph's static buffers as the last step of a CONTEXT_TOKENS run left them, minus its
    # KV write.
    generate(CONTEXT_TOKENS)
    graph = graphs.graphs[1]
    graphs.slot_mapping.fill_(-1)
    lib = cpu_ops.load()
    calls = [(getattr(lib, name), call_args) for name, call_args in calls_of[id(graph.plan)]]

    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for kernel, call_args in calls:
        per_kernel[kernel.__name__][0] += min(timings(lambda k=kernel, a=call_args: k(*a), 10, 3))
        per_kernel[kernel.__name__][1] += 1

    def one_by_one() -> None:
        for kernel, call_args in calls:
            kernel(*call_args)

    replays: dict[str, list[float]] = {"plan": [], "calls": []}
    for r in range(args.rounds):
        order = [("plan", lambda: cpu_ops.run_plan(graph.plan)), ("calls", one_by_one)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            replays[name] += timings(fn, 1, 5)
    hidden = torch.randn(1, llm.llm_engine.config.hf_config.hidden_size)
    head = timings(lambda: runner.model.compute_logits(hidden), args.rounds, 3)

    def ms(values: list[float]) -> str:
        return f"best {min(values) * 1e3:7.3f} ms  median {statistics.median(values) * 1e3:7.3f} ms"

    print(f"quantization={args.quantization} threads={args.threads} context~{int(graphs.seq_lens[0])}")
    print(f"engine decode per token          {ms(engine)}")
    print(f"graph replay, one plan           {ms(replays['plan'])}")
    print(f"graph replay, {len(calls)} ctypes calls  {ms(replays['calls'])}")
    print(f"LM head (compute_logits)         {ms(head)}")
    total = sum(t for t, _ in per_kernel.values())
    print(f"kernels, each call alone (cache-warm): {total * 1e3:.3f} ms")
    for name, (t, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:<24} {n:4d} calls {t * 1e3:7.3f} ms  {t / n * 1e6:7.1f} us/call")


if __name__ == "__main__":
    main()
