"""Compiled kernels that platforms hand to layers (their op tables) and attention backends call
where they beat composed torch ops.

``cpu`` holds the CPU ones: C sources in ``csrc/``, built with the system C compiler on first use
(the way vLLM's ``_C`` CPU ops back its layers); the CPU platform's op table calls them. Every
caller keeps a plain-torch path for when they cannot run (no compiler, another dtype or device,
``TOKENMILL_DISABLE_CPU_KERNELS=1``).
"""
