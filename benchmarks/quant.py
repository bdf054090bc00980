"""Weight quantization side by side: tokenmill on the default model in float32 and with each
quantization method, every run in its own process (``run_engine.py``), ratios to float32.

    python benchmarks/quant.py                       # single: float32 int8 w8a8 int4 fp8; fixed: float32 int8 w8a8
    python benchmarks/quant.py --isa avx2 --workloads single --methods int8,int4

Workloads as ``compare.py``'s: ``single`` 1 x (256 in, 128 out), ``fixed`` 64 x (256 in, 128
out), greedy, prefix caching off. The load average before and after is printed: on a shared
machine compare ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date

from compare import ISA_ENV, run

DEFAULT_METHODS = {"single": "int8,w8a8,int4,fp8", "fixed": "int8,w8a8"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="single,fixed")
    parser.add_argument("--methods", default=None, help="comma-separated; default per workload: %s" % DEFAULT_METHODS)
    parser.add_argument("--isa", choices=list(ISA_ENV), default="native")
    args = parser.parse_args()

    from tokenmill.default_model import default_model_path

    model = default_model_path()
    print(f"load average before: {os.getloadavg()}", flush=True)
    ratios = []
    for workload in args.workloads.split(","):
        print(f"{workload}:", flush=True)
        base = run(sys.executable, "tokenmill", workload, model, [], args.isa)
        for method in (args.methods or DEFAULT_METHODS[workload]).split(","):
            print(f"  [{method}]", flush=True)
            result = run(sys.executable, "tokenmill", workload, model, ["--quantization", method], args.isa)
            ratios.append((workload, method, result["output_tok_per_s"] / base["output_tok_per_s"]))
    print(f"load average after: {os.getloadavg()}")
    print(f"\nratios to float32 ({date.today()}, isa {args.isa}, {os.cpu_count()} CPUs):")
    for workload, method, ratio in ratios:
        print(f"  {workload:<7} {method:<5} / float32 output tok/s = {ratio:.2f}x")


if __name__ == "__main__":
    main()
