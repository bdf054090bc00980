#!/usr/bin/env bash
# GPU checks: install what the GPU paths need without replacing the preinstalled torch, run the
# gpu-marked tests, run a short `tokenmill bench throughput` with each attention backend that can
# serve here, and print a summary.
#
#   bash scripts/gpu_check.sh            # from the repository root or anywhere
#   WHEELHOUSE=/path/to/wheels bash scripts/gpu_check.sh   # offline: wheels for flash-attn etc.
#   GPU_CHECK_OUT=/some/dir bash scripts/gpu_check.sh       # where logs and bench JSON go
#
# Optional packages (triton, flash-attn, flashinfer-python) are installed from wheels only, so a
# missing wheel costs seconds, not a source build; a backend without its package is reported
# with its reasons and skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-${TMPDIR:-/tmp}/tokenmill_gpu_check}
mkdir -p "$OUT"
declare -a SUMMARY=()

"$PYTHON" - <<'EOF' || { echo "gpu_check: torch sees no GPU; nothing to check" >&2; exit 1; }
import torch
assert torch.cuda.is_available()
name = torch.cuda.get_device_name()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}) on {name}")
EOF

# Keep the preinstalled torch (and its triton) whatever else pip resolves.
CONSTRAINTS="$OUT/constraints.txt"
"$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' > "$CONSTRAINTS"
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP=("$PYTHON" -m pip install -q --retries 1 --timeout 15 -c "$CONSTRAINTS")
[[ -n "${WHEELHOUSE:-}" ]] && PIP+=(--find-links "$WHEELHOUSE")

if "${PIP[@]}" -e ".[test]"; then
    SUMMARY+=("install tokenmill: ok")
elif "${PIP[@]}" --no-build-isolation --no-deps -e .; then
    SUMMARY+=("install tokenmill: ok (offline: --no-deps; test extras as found)")
else
    echo "gpu_check: cannot install tokenmill" >&2
    exit 1
fi
for pkg in triton flash-attn flashinfer-python; do
    if "${PIP[@]}" --only-binary=:all: "$pkg" >"$OUT/pip_$pkg.log" 2>&1; then
        SUMMARY+=("install $pkg: ok")
    else
        SUMMARY+=("install $pkg: no usable wheel (see $OUT/pip_$pkg.log)")
    fi
done
"$PYTHON" -c 'import torch; print("torch after installs:", torch.__version__)'

PYTEST=("$PYTHON" -m pytest -m gpu -q -ra -p no:cacheprovider)
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout=600)
"${PYTEST[@]}" tests 2>&1 | tee "$OUT/pytest_gpu.log"
PYTEST_RC=${PIPESTATUS[0]}
SUMMARY+=("pytest -m gpu (exit $PYTEST_RC): $(tail -1 "$OUT/pytest_gpu.log")")

# Tensor parallelism over NCCL: its gpu test above needs 2 GPUs; the default model's 9 query /
# 3 KV heads split over 3 ranks, so its bench needs 3.
num_gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if (( num_gpus >= 3 )); then
    log="$OUT/bench_tp3.log"
    if "$PYTHON" -m tokenmill bench throughput --tensor-parallel-size 3 --num-prompts 64 \
        --input-len 256 --output-len 64 --output-json "$OUT/bench_tp3.json" >"$log" 2>&1; then
        SUMMARY+=("bench tensor-parallel-size 3 (NCCL): $(grep -m1 '^Throughput' "$log")")
    else
        SUMMARY+=("bench tensor-parallel-size 3 (NCCL): FAILED (see $log)")
    fi
else
    SUMMARY+=("tensor parallelism over NCCL: not possible with $num_gpus GPU(s) (the test needs 2, the default-model bench 3)")
fi

# Why a backend cannot serve the default model here (empty: it can).
backend_reasons() {
    "$PYTHON" - "$1" "$2" <<'EOF'
import sys
import torch
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.selector import backend_reasons, select_platform
platform = select_platform()
dtype = torch.bfloat16 if platform.supports_bf16() else torch.float16
config = AttentionConfig(head_size=64, dtype=dtype, block_size=int(sys.argv[2]), device_type="cuda")
print("; ".join(backend_reasons(sys.argv[1], config)))
EOF
}

for backend in flash_attn flashinfer triton torch; do
    block_size=16
    [[ $backend == flash_attn ]] && block_size=256
    reasons=$(backend_reasons "$backend" "$block_size")
    if [[ -n "$reasons" ]]; then
        SUMMARY+=("bench $backend: skipped ($reasons)")
        continue
    fi
    log="$OUT/bench_$backend.log"
    if "$PYTHON" -m tokenmill bench throughput --attention-backend "$backend" --block-size "$block_size" \
        --num-prompts 64 --input-len 256 --output-len 64 --output-json "$OUT/bench_$backend.json" \
        >"$log" 2>&1; then
        SUMMARY+=("bench $backend: $(grep -m1 '^Throughput' "$log")")
    else
        SUMMARY+=("bench $backend: FAILED (see $log)")
    fi
done

echo
echo "==== gpu_check summary ===="
printf '%s\n' "${SUMMARY[@]}"
exit "$PYTEST_RC"
