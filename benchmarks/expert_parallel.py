"""Time per MoE layer under expert parallelism at 2 ranks (two gloo processes on this
machine), for each all-to-all backend, against the layer on one process.

    python benchmarks/expert_parallel.py [--tokens 16 256 --experts 32 --hidden 1024]

The layer is DeepSeek-V3-shaped (sigmoid grouped top-k routing, ``--experts`` experts of
``--inter`` intermediate, top 4), random float32 weights; each rank holds half the experts
and dispatches its half of the tokens. Milliseconds are the median of ``--iters`` forwards
after a warm-up, measured on rank 0 (the ranks run in lockstep); every process runs one
torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from tokenmill.distributed.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
)
from tokenmill.interfaces.build_context import BuildContext
from tokenmill.distributed.device_communicator import ALL2ALL_BACKENDS, DeviceCommunicator
from tokenmill.layers.build_context import model_build_context
from tokenmill.layers.fused_moe import FusedMoE


def build_layer(args: argparse.Namespace, expert_parallel: bool) -> FusedMoE:
    ctx = BuildContext(None, enable_expert_parallel=expert_parallel)
    with model_build_context(ctx):
        layer = FusedMoE(
            args.experts, 4, args.hidden, args.inter, scoring_func="sigmoid", renormalize=True,
            num_expert_group=4, topk_group=2, prefix="moe",
        )
    generator = torch.Generator().manual_seed(0)
    for e in range(args.experts):
        w13 = torch.randn(2 * args.inter, args.hidden, generator=generator) * 0.02
        w2 = torch.randn(args.hidden, args.inter, generator=generator) * 0.02
        layer.weight_loader(layer.w13_weight, w13[: args.inter], e, "w1")
        layer.weight_loader(layer.w13_weight, w13[args.inter :], e, "w3")
        layer.weight_loader(layer.w2_weight, w2, e, "w2")
    return layer


def time_layer(layer: FusedMoE, tokens: int, iters: int, hidden: int, experts: int) -> float:
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    with torch.inference_mode():
        layer(x, logits)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            layer(x, logits)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rank_main(rank: int, args: argparse.Namespace, port: int, results: dict) -> None:
    torch.set_num_threads(1)
    for backend in ALL2ALL_BACKENDS:
        init_distributed_environment(
            "gloo", f"tcp://127.0.0.1:{port}", rank, 2, 1, DeviceCommunicator, torch.device("cpu"), backend
        )
        layer = build_layer(args, expert_parallel=True)
        for tokens in args.tokens:
            ms = time_layer(layer, tokens, args.iters, args.hidden, args.experts)
            if rank == 0:
                results[backend, tokens] = ms
        destroy_distributed_environment()
        port += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    single = build_layer(args, expert_parallel=False)
    baseline = {t: time_layer(single, t, args.iters, args.hidden, args.experts) for t in args.tokens}
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(args, 29600 + int(time.time()) % 1000, results), nprocs=2)
        results = dict(results)
    for tokens in args.tokens:
        line = f"{tokens:5d} tokens: one process {baseline[tokens]:7.2f} ms"
        for backend in ALL2ALL_BACKENDS:
            line += f"; ep=2 {backend} {results[backend, tokens]:7.2f} ms"
        print(line)


if __name__ == "__main__":
    main()
