"""Speculative decoding vs none, side by side in one run, on the default model (greedy).

Workloads:
- ``copy``: single stream; chat prompts asking to rewrite a given passage (the n-gram
  proposer's case), ``--output-len`` tokens each.
- ``concurrent``: ``--concurrency`` requests at once of the same prompts.

Each configuration gets its own engine, a warm-up request, then the timed requests; engines
alternate per repeat. Reports output tokens/s, the speed-up over no speculation and the
acceptance rate (accepted / proposed drafts) with the mean tokens per verification step.

    python benchmarks/spec_decode.py [--output-len 128 --repeats 2 --workload copy,concurrent]
"""

from __future__ import annotations

import argparse
import json
import time

from tokenmill import LLM, SamplingParams

PASSAGES = [
    "The Industrial Revolution began in Britain in the late eighteenth century. Steam engines, "
    "first used to pump water out of mines, were soon driving looms and spinning machines in "
    "large factories. Workers moved from the countryside to fast-growing towns such as "
    "Manchester, where they lived in crowded housing and worked long hours for low wages.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Using the energy of "
    "sunlight, the plant turns carbon dioxide from the air and water from the soil into "
    "glucose, and releases oxygen as a by-product. The glucose is used for energy and to build "
    "cellulose, the material of the plant's cell walls.",
    "The Python programming language was created by Guido van Rossum and first released in "
    "1991. It is known for its readable syntax, which uses indentation to mark blocks of code, "
    "and for its large standard library. Python is widely used for web development, data "
    "analysis, machine learning and scripting.",
    "Mount Everest, on the border between Nepal and China, is the highest mountain above sea "
    "level at 8,849 metres. It was first climbed in 1953 by Edmund Hillary and Tenzing Norgay. "
    "Today hundreds of climbers attempt the summit each spring, helped by Sherpa guides and "
    "bottled oxygen.",
]

CONFIGS = {
    "none": None,
    "ngram-k4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4, "disable_by_batch_size": 0},
    "ngram-k4-default-cutoff": {"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def _prompts(llm: LLM, n: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(n):
        passage = PASSAGES[i % len(PASSAGES)]
        messages = [{"role": "user", "content": f"Repeat this text word for word:\n\n{passage}"}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workload", default="copy,concurrent")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {
        name: LLM(speculative_config=CONFIGS[name], kv_cache_memory_bytes=2**29)
        for name in args.configs.split(",")
    }
    for workload in args.workload.split(","):
        n = 1 if workload == "copy" else args.concurrency
        results: dict[str, list[float]] = {name: [] for name in engines}
        accept: dict[str, tuple[int, int, int]] = {}
        for name, llm in engines.items():
            _run(llm, _prompts(llm, 1), SamplingParams(temperature=0, max_tokens=8))
        for _ in range(args.repeats):
            for name, llm in engines.items():
                before = llm.get_stats()
                prompts = _prompts(llm, n)
                tokens, seconds = _run(llm, prompts, params)
                results[name].append(tokens / seconds)
                after = llm.get_stats()
                accept[name] = tuple(
                    after.get(k, 0) - before.get(k, 0)
                    for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
                )
        base = max(results["none"]) if "none" in results else None
        for name, speeds in results.items():
            drafts, proposed, accepted = accept[name]
            row = {
                "workload": workload,
                "requests": n,
                "config": name,
                "output_tok_s": [round(s, 1) for s in speeds],
                "speedup_best": round(max(speeds) / base, 2) if base else None,
                "acceptance": round(accepted / proposed, 3) if proposed else None,
                "tokens_per_verify_step": round(1 + accepted / drafts, 2) if drafts else None,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
