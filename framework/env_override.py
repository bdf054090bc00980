"""Environment defaults tokenmill sets when it is imported, before torch loads its OpenMP
runtime (as vLLM's ``env_override``); a variable already set is left as it is.

GNU OpenMP, torch's runtime, lets a thread that has finished its share of a parallel region
spin for ``GOMP_SPINCOUNT`` iterations (300,000 by default, most of a millisecond) before it
sleeps, and a forward pass is thousands of short regions (every GEMM and C kernel). On a CPU that
other processes share, a waiting thread's spin takes the core its partner needs, and each region
ends only when the descheduled partner runs again: on 2 shared cores of an AMD EPYC, 30 decode
layers of GEMMs ran 5x slower with 2 threads than with 1. ``GOMP_SPINCOUNT=1000`` (tens of
microseconds) bridges the gaps between ops of one forward pass and then yields the core; with 2
threads the same layers ran 4x faster than with the default. ``OMP_WAIT_POLICY=ACTIVE`` (or any
``GOMP_SPINCOUNT``) set before tokenmill is imported keeps the runtime's own behaviour.

Importing tokenmill after torch is too late for the runtime to see these.
"""

from __future__ import annotations

import os

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "1000"}


def apply() -> None:
    """Set each default whose variable (or OpenMP's own ``OMP_WAIT_POLICY``) is unset."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return
    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
