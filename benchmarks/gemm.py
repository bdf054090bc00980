"""GFLOP/s of the default model's float32 GEMMs (SmolLM2-135M: hidden 576, intermediate 1536,
9 query and 3 KV heads of 64, vocabulary 49152) by ``F.linear`` (MKL) and by oneDNN on a
weight packed once (the CPU platform's linear method), and of the same products by ``w8a8``'s
int8 kernel (activations quantized per row, codes in panels; GOP/s), min of N timings each, so
other load on the machine shows less. Rows: 64 (a decode batch) and 2048 (a prefill chunk), or
``--rows``.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/gemm.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from tokenmill.ops import cpu_quant
from tokenmill.quant.int8 import pack_panels, quantize_int8

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,2048")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            w, x = torch.randn(n, k), torch.randn(rows, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            gflop = 2 * rows * n * k / 1e9
            mkl = gflop / best_time(partial(F.linear, x, w), args.repeats)
            dnn = gflop / best_time(
                partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""), args.repeats
            )
            q, scale = quantize_int8(w)
            panels = pack_panels(q)
            w8a8 = gflop / best_time(partial(cpu_quant.w8a8_linear, x, panels, scale, None), args.repeats)
            print(
                f"rows {rows:5d} {name:8s} F.linear {mkl:6.1f}  oneDNN packed {dnn:6.1f} GFLOP/s"
                f"  w8a8 {w8a8:6.1f} GOP/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
