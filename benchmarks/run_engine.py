"""One engine, one workload, one process: prints a JSON result line.

Run by ``compare.py`` with whichever Python has the engine installed (tokenmill, HF
``transformers``, or vLLM's CPU build), so each engine's memory is measured on its own. Only
numpy and the engine itself are imported; the workload is drawn here, identically for all.
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time

import numpy as np

WORKLOADS = {
    # name: (num_prompts, input_len range, output_len range)
    "fixed": (64, (256, 256), (128, 128)),
    "mixed": (64, (32, 512), (16, 256)),
    "single": (1, (256, 256), (128, 128)),
}


def make_workload(name: str, vocab_size: int, seed: int = 0, num_prompts: int | None = None):
    n, (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[name]
    n = num_prompts or n
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=n)
    out_lens = rng.integers(out_lo, out_hi + 1, size=n)
    prompts = [rng.integers(100, vocab_size, size=int(k)).tolist() for k in in_lens]
    return prompts, [int(k) for k in out_lens]


def lora_requests(lora_request_cls, num_prompts: int, lora_dirs: list[str]) -> list | None:
    """Request ``i`` gets adapter ``i % len(lora_dirs)`` (ids from 1), or None without adapters."""
    if not lora_dirs:
        return None
    loras = [lora_request_cls(f"lora{i}", i, d) for i, d in enumerate(lora_dirs, start=1)]
    return [loras[i % len(loras)] for i in range(num_prompts)]


def lora_engine_args(args) -> dict:
    if not args.lora_dirs:
        return {}
    return dict(enable_lora=True, max_loras=len(args.lora_dirs), max_lora_rank=args.max_lora_rank)


def run_tokenmill(model, prompts, out_lens, args):
    from tokenmill import LLM, LoRARequest, SamplingParams

    llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              **lora_engine_args(args))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    loras = lora_requests(LoRARequest, len(prompts), args.lora_dirs)
    warm = loras[: len(args.lora_dirs)] if loras else None
    llm.generate([{"prompt_token_ids": prompts[0][:8]}] * len(warm or [0]), SamplingParams(max_tokens=2),
                 use_tqdm=False, lora_request=warm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_vllm(model, prompts, out_lens, args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False,
              gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_num_seqs=args.max_num_seqs, seed=0, **lora_engine_args(args))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    loras = lora_requests(LoRARequest, len(prompts), args.lora_dirs)
    warm = loras[: len(args.lora_dirs)] if loras else None
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:8])] * len(warm or [0]), SamplingParams(max_tokens=2),
                 use_tqdm=False, lora_request=warm)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(model, prompts, out_lens, args):
    """HF ``generate`` in batches, left-padded to each batch's longest prompt and run to its
    longest output; only the tokens each request asked for count as useful."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, outs = prompts[i : i + args.hf_batch_size], out_lens[i : i + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                        min_new_tokens=max(outs), do_sample=False, pad_token_id=0)
        useful += sum(outs)
    return time.perf_counter() - start, useful


class PeakRss:
    """Samples the resident memory of this process and all its children (vLLM runs its engine
    core in a child process) and keeps the peak, in MiB."""

    def __init__(self, interval: float = 0.2) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        try:
            import psutil
        except ImportError:
            return
        me = psutil.Process()
        while not self._stop.wait(interval):
            try:
                procs = [me, *me.children(recursive=True)]
                total = sum(p.memory_info().rss for p in procs if p.is_running())
            except psutil.Error:
                continue
            self.peak = max(self.peak, total / 2**20)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return max(self.peak, own)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["tokenmill", "vllm", "hf"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", choices=list(WORKLOADS), required=True)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--quantization", default=None, help="tokenmill's quantization method")
    parser.add_argument("--lora-dirs", type=lambda v: v.split(",") if v else [], default=[],
                        help="comma-separated PEFT adapter directories, spread over the requests")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5,
                        help="vLLM's share of the host memory for weights and KV cache (CPU backend)")
    args = parser.parse_args()
    prompts, out_lens = make_workload(args.workload, args.vocab_size, num_prompts=args.num_prompts)
    runner = {"tokenmill": run_tokenmill, "vllm": run_vllm, "hf": run_hf}[args.engine]
    rss = PeakRss()
    elapsed, output_tokens = runner(args.model, prompts, out_lens, args)
    peak_rss = rss.stop()
    print(json.dumps({
        "engine": args.engine,
        "workload": args.workload,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "time_per_output_token_ms": elapsed / max(output_tokens, 1) * 1000,
        "peak_rss_mib": round(peak_rss),
    }))


if __name__ == "__main__":
    main()
