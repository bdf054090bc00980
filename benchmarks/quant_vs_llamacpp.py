"""Single-stream side by side on the default model: tokenmill on its GGUF file (the gguf method,
Q4_1 blocks), llama.cpp (llama-cpp-python) on the same file, and tokenmill float32.

One request at a time: a 256-token prompt, then 128 greedy tokens (EOS ignored). Each engine
runs in its own process with the same thread count (``--repeats`` times, the order reversed
every other time), takes a warm-up request, then ``--runs``
timed requests, each with a different prompt (no prefix-cache hits on either side). Reports
the median end-to-end time and output tokens/s, the prefill time (a 1-token request on one more
prompt) and the decode rate (127 tokens over the end-to-end time minus the prefill), and each
engine's speed relative to llama.cpp.

llama-cpp-python is not a tokenmill dependency; point ``--llamacpp-python`` at a Python that
has it (without it that row is left out):

    python benchmarks/quant_vs_llamacpp.py --llamacpp-python /path/to/llama-venv/bin/python --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT_LEN, OUTPUT_LEN = 256, 128
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Before that, books were copied by "
    "hand, usually in monasteries, and a single volume could take months to finish. Within "
    "fifty years printing shops had spread to more than two hundred cities across Europe, and "
    "millions of books were in circulation. The effects reached far beyond the book trade: "
    "scientists could share their results exactly, reformers could spread pamphlets faster "
    "than the authorities could suppress them, and ordinary people gained access to texts in "
    "their own languages. Historians still debate how much of the scientific revolution and "
    "the Reformation depended on the press, but few doubt that it changed how knowledge moved. "
)


def prompts(count: int) -> list[list[int]]:
    """``count`` different 256-token prompts cut from the text at different offsets."""
    from tokenmill.default_model import default_model_path
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_path()).encode(TEXT * 4)
    return [ids[7 * i : 7 * i + PROMPT_LEN] for i in range(count)]


def run_tokenmill(quantization: str | None, requests: list[list[int]]) -> list[float]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(quantization=quantization, max_model_len=1024, enable_prefix_caching=False)
    times = []
    for i, ids in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=1 if i == 1 else OUTPUT_LEN, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        assert len(out.outputs[0].token_ids) == params.max_tokens
    return times


def run_llamacpp(path: str, threads: int, requests: list[list[int]]) -> list[float]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    times = []
    for i, ids in enumerate(requests):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        for _ in range(0 if i == 1 else OUTPUT_LEN - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        times.append(time.perf_counter() - start)
    return times


def child(args: argparse.Namespace) -> None:
    requests = json.loads(sys.stdin.read())
    if args.child == "llamacpp":
        times = run_llamacpp(args.gguf, args.threads, requests)
    else:
        times = run_tokenmill(None if args.child == "float32" else "gguf", requests)
    print(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every engine, in alternating order")
    parser.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python")
    parser.add_argument("--engines", default="gguf,llamacpp,float32")
    parser.add_argument("--llamacpp-gguf", default=None,
                        help="the GGUF file llama.cpp runs (default: the default model's, Q4_1; "
                        "an F32 copy from benchmarks/gguf_to_f32.py compares with float32)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    # warm-up, the prefill-only request, then the timed ones
    requests = prompts(args.runs + 2)
    env = dict(os.environ, TOKENMILL_CPU_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    engines = args.engines.split(",")
    if "llamacpp" in engines and args.llamacpp_python is None:
        print("llamacpp: left out (no --llamacpp-python)")
        engines.remove("llamacpp")
    for repeat in range(args.repeats):
        # Alternate the order, so neither engine always runs first on a busy machine.
        order = engines if repeat % 2 == 0 else engines[::-1]
        results = {engine: run_child(engine, args, requests, env) for engine in order}
        report(results, args, repeat)


def run_child(engine: str, args: argparse.Namespace, requests: list[list[int]], env: dict) -> tuple[float, float]:
    """(median end-to-end time, prefill time) of ``engine`` in its own process."""
    from tokenmill.default_model import gguf_path

    python = args.llamacpp_python if engine == "llamacpp" else sys.executable
    path = args.llamacpp_gguf if engine == "llamacpp" and args.llamacpp_gguf else gguf_path()
    cmd = [python, __file__, "--child", engine, "--gguf", str(path), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, input=json.dumps(requests), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{engine} failed:\n{proc.stderr}")
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    return statistics.median(times[2:]), times[1]


def report(results: dict[str, tuple[float, float]], args: argparse.Namespace, repeat: int) -> None:
    base = results.get("llamacpp", (None,))[0]
    load = os.getloadavg()[0]
    print(f"single stream, {PROMPT_LEN}-token prompt + {OUTPUT_LEN} greedy tokens, {args.threads} threads, "
          f"median of {args.runs}, repeat {repeat + 1} of {args.repeats}, load {load:.2f}")
    print(f"{'engine':10} {'e2e s':>7} {'tok/s':>7} {'prefill s':>10} {'decode tok/s':>13} {'vs llama.cpp':>13}")
    for engine, (e2e, prefill) in results.items():
        ratio = f"{base / e2e:.2f}x" if base else "-"
        decode = (OUTPUT_LEN - 1) / (e2e - prefill)
        print(f"{engine:10} {e2e:7.3f} {OUTPUT_LEN / e2e:7.1f} {prefill:10.3f} {decode:13.1f} {ratio:>13}", flush=True)

if __name__ == "__main__":
    main()
