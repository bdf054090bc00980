"""The C kernels of a decode step as the engine meets them, reading from memory: the weight
products at one input row over the default model's 30 layers (fused q/k/v, o, fused gate/up,
down; each layer its own weights, so no call finds them in cache) in float32, int8 and FP8, and
paged decode attention over 30 layers' float32 caches. Best of the repeats, wall time, with the
bytes each pass reads per second. ``--rows`` adds the float32 products at more input rows (a
decode batch, a speculative verification) by the C kernel against oneDNN on packed weights:
where the CPU platform hands float32 products from one to the other (``STREAM_MAX_ROWS``).

    python benchmarks/decode_kernels.py --threads 2
    python benchmarks/decode_kernels.py --threads 2 --requests 16 --context 300
    python benchmarks/decode_kernels.py --threads 2 --rows 16,32,48,64,96
"""

from __future__ import annotations

import argparse

import torch

from gemm import best_time
from tokenmill.ops import cpu, cpu_quant
from tokenmill.platforms.cpu_linear import onednn_linear, onednn_pack
from tokenmill.quant.fp8 import quantize_fp8
from tokenmill.quant.int8 import quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


def products(repeats: int) -> None:
    floats = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    inputs = {k: torch.randn(1, k) for _, k in SHAPES}
    int8 = [[quantize_int8(w) for w in layer] for layer in floats]
    fp8 = [[quantize_fp8(w) for w in layer] for layer in floats]
    cases = {
        "float32 f32_linear": (lambda: [cpu_quant.f32_linear(inputs[w.shape[1]], w, None) for layer in floats for w in layer], 4),
        "int8 int8_linear": (lambda: [cpu_quant.int8_linear(inputs[q.shape[1]], q, s, None) for layer in int8 for q, s in layer], 1),
        "fp8 fp8_linear": (lambda: [cpu_quant.fp8_linear(inputs[q.shape[1]], q, s, None) for layer in fp8 for q, s in layer], 1),
    }
    weights = LAYERS * sum(n * k for n, k in SHAPES)
    for name, (run, element_size) in cases.items():
        t = best_time(run, repeats)
        print(f"  {name:<20} one row, {LAYERS} layers: {t * 1e3:7.2f} ms  {weights * element_size / t / 1e9:5.1f} GB/s")


def rows_against_onednn(rows: list[int], repeats: int) -> None:
    floats = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[onednn_pack(w) for w in layer] for layer in floats]
    for m in rows:
        inputs = {k: torch.randn(m, k) for _, k in SHAPES}
        c = best_time(lambda x=inputs: [cpu_quant.f32_linear(x[w.shape[1]], w, None) for layer in floats for w in layer], repeats)
        dnn = best_time(lambda x=inputs: [onednn_linear(x[p.shape[1]], p) for layer in packed for p in layer], repeats)
        print(f"  float32 {m:3d} rows, {LAYERS} layers: f32_linear {c * 1e3:6.1f} ms  oneDNN packed {dnn * 1e3:6.1f} ms")


def attention(requests: int, context: int, repeats: int) -> None:
    per_request = -(-context // BLOCK_SIZE)
    num_blocks = requests * per_request
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE) for _ in range(LAYERS)]
    block_table = torch.randperm(num_blocks).view(requests, per_request).contiguous()
    query, out = torch.randn(requests, HEADS, HEAD_SIZE), torch.empty(requests, HEADS, HEAD_SIZE)
    rows, seq_lens = torch.arange(requests), torch.full((requests,), context)

    def run() -> None:
        for kv in caches:
            cpu.paged_decode_attention(query, out, rows, kv[0], kv[1], block_table, seq_lens, context, 0.125)

    t = best_time(run, repeats)
    kv_bytes = LAYERS * requests * context * KV_HEADS * HEAD_SIZE * 4 * 2
    print(
        f"  paged decode attention {requests} x {context} tokens, {LAYERS} layers: "
        f"{t / LAYERS * 1e6:6.0f} us per layer  {kv_bytes / t / 1e9:5.1f} GB/s of K and V"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--requests", type=int, default=16, help="decode attention batch")
    parser.add_argument("--context", type=int, default=300, help="decode attention tokens per request")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", default=None, help="comma-separated input rows for float32, C kernel against oneDNN")
    args = parser.parse_args()
    if cpu.load() is None:
        raise SystemExit("the CPU kernels did not build")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads")
    products(args.repeats)
    if args.rows:
        rows_against_onednn([int(r) for r in args.rows.split(",")], args.repeats)
    attention(args.requests, args.context, args.repeats)


if __name__ == "__main__":
    main()
