"""Compiled kernels that layers and attention backends call where they beat composed torch ops.

``cpu`` holds the CPU ones: C sources in ``csrc/``, built with the system C compiler on first use
(the way vLLM's ``_C`` CPU ops back its layers). Every caller keeps a plain-torch path for when
they cannot run (no compiler, another dtype or device, ``TOKENMILL_DISABLE_CPU_KERNELS=1``).
"""
