"""Single-stream decode cost of one or more tokenmill checkouts, alternated in one run.

Each measurement is a fresh process of one checkout's Python (``--python``, repeatable; each an
interpreter with that checkout installed) running the default model on one 256-token prompt:
128 greedy tokens, minus a 1-token run of the same prompt, so prefill drops out. It reports the
best of ``--runs`` per process as milliseconds per decode token, in wall time and in the
process's CPU time (steadier than wall time on shared cores). The checkouts take turns in every
round, so load that drifts during the run falls on each alike.

Beside each figure, its roofline (``benchmarks/roofline.py``): the bytes a decode token reads
(the weights as loaded, and the KV cache at the mean context) over the read bandwidth the same
process measures right after, on the same threads; ``tok_s`` and ``roofline_tok_s`` are decode
tokens per second, ``of_roofline`` their ratio::

    python benchmarks/single_stream.py --python /venv-before/bin/python \\
        --python /venv-after/bin/python --quantization none,gguf --threads 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, OUTPUT_LEN = 256, 128


def measure(quantization: str | None, runs: int) -> dict[str, float]:
    """Best-of-``runs`` decode milliseconds per token in this process (wall and CPU time), and
    the roofline: bytes per decode token and the read bandwidth measured after."""
    import numpy as np

    from tokenmill import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from roofline import decode_bytes_per_token, read_bandwidth

    llm = LLM(enable_prefix_caching=False, quantization=quantization)
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 40000, PROMPT_LEN).tolist()}

    def generate(max_tokens: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - wall, time.process_time() - cpu

    generate(2)
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = generate(OUTPUT_LEN)
        prefill_wall, prefill_cpu = generate(1)
        walls.append((wall - prefill_wall) / (OUTPUT_LEN - 1) * 1e3)
        cpus.append((cpu - prefill_cpu) / (OUTPUT_LEN - 1) * 1e3)
    config = llm.llm_engine.config
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    kv_bytes = config.kv_cache_torch_dtype.itemsize
    token_bytes = decode_bytes_per_token(model, config.hf_config, PROMPT_LEN + OUTPUT_LEN // 2, kv_bytes)
    bandwidth = read_bandwidth()
    return {
        "wall_ms": min(walls),
        "cpu_ms": min(cpus),
        "bytes_per_token": token_bytes,
        "read_gb_s": bandwidth / 1e9,
        "roofline_tok_s": bandwidth / token_bytes,
    }


def child(python: str, quantization: str, threads: int, runs: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [python, __file__, "--child", "--quantization", quantization, "--runs", str(runs)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", help="an interpreter with a tokenmill checkout installed")
    parser.add_argument("--quantization", default="none", help="comma-separated; 'none' for float32")
    parser.add_argument("--threads", default="1,2", help="comma-separated OMP thread counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="generate calls per process (best kept)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        quantization = None if args.quantization == "none" else args.quantization
        print(json.dumps(measure(quantization, args.runs)))
        return
    pythons = args.python or [sys.executable]
    print("quantization threads round python wall_ms cpu_ms tok_s MB_per_token read_GB_s roofline_tok_s of_roofline")
    for quantization in args.quantization.split(","):
        for threads in map(int, args.threads.split(",")):
            for r in range(args.rounds):
                order = pythons if r % 2 == 0 else pythons[::-1]
                for python in order:
                    res = child(python, quantization, threads, args.runs)
                    tok_s = 1e3 / res["wall_ms"]
                    print(
                        quantization, threads, r, python, f"{res['wall_ms']:.2f}", f"{res['cpu_ms']:.2f}",
                        f"{tok_s:.1f}", f"{res['bytes_per_token'] / 1e6:.1f}", f"{res['read_gb_s']:.2f}",
                        f"{res['roofline_tok_s']:.1f}", f"{tok_s / res['roofline_tok_s']:.2f}", flush=True,
                    )


if __name__ == "__main__":
    main()
