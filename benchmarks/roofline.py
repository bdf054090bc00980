"""The machine's rooflines: memory read bandwidth and float32 GEMM throughput, measured here.

Single-stream decode reads every weight once per token, so ``bandwidth / bytes per token`` is
the most tokens per second any engine can decode on this machine (``benchmarks/single_stream.py``
prints it beside each of its figures). The probes take the best of ``--repeats`` timings, so
other load on the machine shows less (it still shows: say what ran beside them).

- read bandwidth: ``Tensor.sum`` over a float32 buffer of ``--mib`` MiB (far larger than the
  caches), bytes read per second;
- GEMM: ``torch.mm`` of two float32 ``--gemm-size`` square matrices, FLOP/s.

    python benchmarks/roofline.py --threads 1,2
"""

from __future__ import annotations

import argparse
import json

import torch
from gemm import best_time
from torch import nn

from tokenmill.model_loader.loader import decode_weight_bytes


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second ``Tensor.sum`` reads from a ``mib`` MiB float32 buffer, on torch's
    current threads."""
    buffer = torch.ones(mib * 2**18, dtype=torch.float32)
    return buffer.nbytes / best_time(buffer.sum, repeats)


def gemm_flops(size: int = 1024, repeats: int = 5) -> float:
    """Float32 FLOP/s of ``torch.mm`` on ``size`` square matrices, on torch's current threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / best_time(lambda: torch.mm(a, b), repeats)


def decode_bytes_per_token(model: nn.Module, hf_config, context_len: int, kv_bytes: int) -> int:
    """Bytes one decode token reads: its weights (``decode_weight_bytes``), plus the KV cache
    of ``context_len`` tokens at ``kv_bytes`` per element."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kv = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * kv_bytes * context_len
    return decode_weight_bytes(model) + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--gemm-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        row = {
            "threads": threads,
            "read_gb_s": round(read_bandwidth(args.mib, args.repeats) / 1e9, 2),
            "gemm_gflop_s": round(gemm_flops(args.gemm_size, args.repeats) / 1e9, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
