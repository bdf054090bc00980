"""The GGUF decode products on the default model's shapes, one activation row: int8 activation
blocks (``gguf_matmul_q8``, the default) against float32 activations (``gguf_matmul``), the two
alternated and repeated, best thread CPU time per call (steadier than wall time on shared cores).

    python benchmarks/gguf_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from tokenmill.ops import cpu

Q = gguf.GGMLQuantizationType
# (rows, columns, type): fused q/k/v, o, fused gate/up, down, the tied LM head
SHAPES = [(960, 576, Q.Q4_1), (576, 576, Q.Q4_1), (3072, 576, Q.Q4_1), (576, 1536, Q.Q4_1), (49152, 576, Q.Q8_0)]
KERNELS = ("gguf_matmul", "gguf_matmul_q8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lib = cpu.load()
    print(f"{'shape':>18} {'type':>5} " + " ".join(f"{k + ' us':>17}" for k in KERNELS) + "  float / int8")
    for n, k, qtype in SHAPES:
        q = torch.from_numpy(quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), qtype))
        x, y = torch.randn(1, k), torch.empty(1, n)
        calls = max(10, 2_000_000 // (n * k // 32))
        best = dict.fromkeys(KERNELS, float("inf"))
        for _ in range(args.repeats):
            for name in KERNELS:
                fn = getattr(lib, name)
                start = clock()
                for _ in range(calls):
                    fn(int(qtype), q.data_ptr(), q.shape[1], x.data_ptr(), 1, k, y.data_ptr(), n, args.threads)
                best[name] = min(best[name], (clock() - start) / calls * 1e6)
        ratio = best["gguf_matmul"] / best["gguf_matmul_q8"]
        print(f"{f'{n} x {k}':>18} {qtype.name:>5} " + " ".join(f"{best[k_]:17.1f}" for k_ in KERNELS) + f"  {ratio:.2f}x")


if __name__ == "__main__":
    main()
