#!/usr/bin/env bash
# `tokenmill serve` with the engine core in its own process (the default) and in-process
# (--no-engine-process), driven by the same client and workload, alternated twice.
# Usage: bash benchmarks/serve_engine_process.sh [num_prompts]
set -u
NUM_PROMPTS=${1:-200}
run() {  # label, port, extra serve flags
  tokenmill serve --port "$2" --kv-cache-memory-bytes 1073741824 $3 >/dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 180); do curl -sf "http://127.0.0.1:$2/health" >/dev/null && break; sleep 1; done
  echo "== $1"
  tokenmill bench serve --port "$2" --num-prompts "$NUM_PROMPTS" --random-input-len 256 \
    --random-output-len 64 --max-concurrency 16 --ignore-eos --disable-tqdm \
    --percentile-metrics ttft,tpot --metric-percentiles 50,99
  kill "$pid"
  wait "$pid" 2>/dev/null
}
run "engine process" 8011 ""
run "in-process" 8012 "--no-engine-process"
run "engine process" 8013 ""
run "in-process" 8014 "--no-engine-process"
