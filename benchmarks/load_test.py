"""Load test of ``tokenmill serve``: many streaming requests at high concurrency through
``tokenmill bench serve``; passes only with zero failed requests and, afterwards, every KV
block free again and nothing running or waiting (read from ``/metrics``).

    python benchmarks/load_test.py                      # starts its own server on 127.0.0.1
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000   # an already running one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tokenmill.benchmarks import serve as bench_serve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="use this server instead of starting one")
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=32)
    parser.add_argument("--random-output-len", type=int, default=16)
    parser.add_argument(
        "--server-args",
        default="--kv-cache-memory-bytes 268435456",
        help="extra 'tokenmill serve' arguments when starting a server",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    server = (
        None
        if args.base_url
        else _start_server(shlex.split(args.server_args), args.startup_timeout)
    )
    base_url = args.base_url or server[1]
    try:
        bench_argv = [
            "--base-url",
            base_url,
            "--num-prompts",
            str(args.num_prompts),
            "--max-concurrency",
            str(args.max_concurrency),
            "--random-input-len",
            str(args.random_input_len),
            "--random-output-len",
            str(args.random_output_len),
            "--ignore-eos",
        ]
        print("tokenmill bench serve " + " ".join(bench_argv), flush=True)
        bench_parser = argparse.ArgumentParser()
        bench_serve.add_arguments(bench_parser)
        report = asyncio.run(bench_serve.benchmark(bench_parser.parse_args(bench_argv)))
        final = _final_stats(base_url)
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait(30)
    print("after the load:", json.dumps(final))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"report": report, "final_stats": final}, f, indent=2)
    problems = []
    if report["failed"] or report["completed"] != args.num_prompts:
        problems.append(f"{report['failed']} failed requests: {report['errors'][:3]}")
    if final["kv_blocks_free"] != final["kv_blocks_total"]:
        problems.append(f"leaked KV blocks: {final['kv_blocks_total'] - final['kv_blocks_free']}")
    if final["num_requests_running"] or final["num_requests_waiting"]:
        problems.append("requests still running or waiting")
    print("LOAD TEST " + ("FAILED: " + "; ".join(problems) if problems else "PASSED"))
    return 1 if problems else 0


def _start_server(extra: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-serve-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    print("server:", " ".join(cmd[1:]), f"(log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up; see {log.name}")


def _final_stats(base_url: str, settle_s: float = 30.0) -> dict[str, float]:
    """The engine gauges from /metrics once it is idle (or after ``settle_s``)."""
    names = ("kv_blocks_total", "kv_blocks_free", "num_requests_running", "num_requests_waiting")
    deadline = time.monotonic() + settle_s
    while True:
        stats: dict[str, float] = {}
        for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].removeprefix("tokenmill:")
            if name in names:
                stats[name] = float(line.rsplit(" ", 1)[1])
        idle = (
            stats["kv_blocks_free"] == stats["kv_blocks_total"]
            and not stats["num_requests_running"]
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
