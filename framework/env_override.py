"""Environment defaults tokenmill sets when it is imported, before torch loads its OpenMP
runtime (as vLLM's ``env_override``); a variable already set is left as it is.

GNU OpenMP, torch's runtime, lets a thread that has finished its share of a parallel region
spin for ``GOMP_SPINCOUNT`` iterations (300,000 by default, most of a millisecond) before it
sleeps; a forward pass is thousands of short regions (every GEMM and C kernel) with Python in
between. tokenmill sets 30,000 (a few hundred microseconds), a trade measured on 2 cores of an
AMD EPYC:

- Spinning too little costs a wake-up for every region a thread slept before: at 1,000
  iterations (tens of microseconds) a batched decode step's threads sleep between the eager
  ops, and 16-request offline runs were 8-15 % slower and `tokenmill serve` at 16 concurrent
  requests (vLLM's client on the same cores) 5-15 % slower than at 30,000.
- Spinning too long takes the core from anything else that needs it: with a busy-loop process
  beside it, single-stream decode ran 17-18 tok/s at 1,000, 10 at 10,000 and 4-6 at 30,000 (the
  waiting thread holds the core its descheduled partner needs). On cores shared with
  CPU-bound work, set ``GOMP_SPINCOUNT=1000``.

``OMP_WAIT_POLICY`` (or any ``GOMP_SPINCOUNT``) set before tokenmill is imported keeps the
runtime's own behaviour.

Importing tokenmill after torch is too late for the runtime to see these.
"""

from __future__ import annotations

import os

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}


def apply() -> None:
    """Set each default whose variable (or OpenMP's own ``OMP_WAIT_POLICY``) is unset."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return
    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
