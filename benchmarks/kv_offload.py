"""Time to first token of a request whose long shared prefix the device cache evicted: computed
again (no connector), loaded from the offload connector's host tier, from its disk tier, and
from the disk tier after a restart (a new engine on the same directory).

Each engine runs on the default model with a device cache of ``--num-kv-blocks`` blocks: the
prefix (``--prefix-len`` tokens) is computed once, ``--num-fillers`` prompts of the same length
evict it, then a request with the prefix and a new question is timed (``max_tokens=1``,
offline: the whole ``generate`` call). Repeated ``--repeats`` times with new fillers and
questions; the median is reported with each run's counters.

    python benchmarks/kv_offload.py [--prefix-len 1000 --num-kv-blocks 80 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from tokenmill import LLM, SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def timed(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def run(llm: LLM, args: argparse.Namespace, prefix: list[int], round_: int) -> tuple[float, list[int]]:
    """Compute the prefix, evict it with fillers, time a new question on it."""
    timed(llm, prefix + tokens(1000 + round_, 8))
    for f in range(args.num_fillers):
        timed(llm, tokens(2000 + 10 * round_ + f, args.prefix_len))
    return timed(llm, prefix + tokens(3000 + round_, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--num-kv-blocks", type=int, default=80)
    parser.add_argument("--num-fillers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prefix = tokens(1, args.prefix_len)
    disk = tempfile.mkdtemp(prefix="kv-offload-")
    setups = {
        "recompute": None,
        "host tier": {"host_gib": 1},
        "disk tier": {"host_gib": 0, "disk_gib": 1, "disk_path": disk},
    }
    results: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}
    for name, extra in setups.items():
        config = {"kv_connector": "offload", "kv_connector_extra_config": extra} if extra else None
        llm = LLM(num_kv_blocks=args.num_kv_blocks, kv_transfer_config=config)
        runs = [run(llm, args, prefix, r) for r in range(args.repeats)]
        results[name] = [t for t, _ in runs]
        answers[name] = [a for _, a in runs]
        print(json.dumps({"setup": name, "ttft_s": results[name], "stats": llm.get_stats()}), flush=True)
        del llm
    restarted = LLM(
        num_kv_blocks=args.num_kv_blocks,
        kv_transfer_config={"kv_connector": "offload", "kv_connector_extra_config": setups["disk tier"]},
    )
    after = [timed(restarted, prefix + tokens(3000 + r, 8)) for r in range(args.repeats)]
    results["disk tier after restart"] = [t for t, _ in after]
    answers["disk tier after restart"] = [a for _, a in after]
    print(json.dumps({"setup": "disk tier after restart", "ttft_s": results["disk tier after restart"], "stats": restarted.get_stats()}), flush=True)
    same = all(a == answers["recompute"] for a in answers.values())
    print(f"load average {os.getloadavg()[0]:.1f}; first tokens equal across setups: {same}")
    for name, times in results.items():
        print(f"{name:>24}: median TTFT {statistics.median(times) * 1000:7.0f} ms")


if __name__ == "__main__":
    main()
