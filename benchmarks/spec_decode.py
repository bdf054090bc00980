"""Speculative decoding vs none, side by side in one run, on the default model (greedy unless
``--temperature`` is given).

Workloads:
- ``copy``: single stream; chat prompts asking to repeat three given passages word for word
  (the n-gram proposer's case; about 210 tokens of text, so that the whole of 128 output
  tokens is the copy), ``--output-len`` tokens each.
- ``chat``: single stream; 256-token chat prompts asking one of four questions about passages
  (not a copy task; the EAGLE heads' case; the passages are not in their training data).
- ``ask`` (or ``short``): single stream; short chat requests with no text to quote (a task
  about a topic, the kind the EAGLE heads were trained on, about topics not in their training
  prompts).
- ``concurrent``: ``--concurrency`` requests at once of the copy prompts.
- ``chat-concurrent``: ``--concurrency`` requests at once of the chat prompts.

Single-stream runs generate for ``--single-stream-prompts`` prompts one after another.

With ``--concurrencies 1,2,4,8,16`` every workload named is a prompt kind (``copy``, ``chat``,
``short``) run at each of those concurrencies (1: single stream), each configuration against
none: the grid of speculation on vs off per method, concurrency and prompt kind::

    python benchmarks/spec_decode.py --workload chat,copy,short --concurrencies 1,2,4,8,16 \
        --configs none,eagle-k3-adaptive,eagle3-k3-adaptive,draft-self-k3-adaptive,ngram-k4-adaptive

Rows of configurations with adaptive draft lengths report the mean length chosen
(``draft_length_mean``, 0 for the steps that drafted nothing) and the cut-off the engine found
(``disable_by_batch_size``, 0: none).

Each configuration gets its own engine, a warm-up request, then the timed requests; engines
alternate per repeat. Two engines of one configuration can differ in speed by several per cent
for as long as they live (where their memory landed): ``--engine-sets N`` builds every
configuration's engine ``N`` times, one set after another, each set running every workload
``--repeats`` times, so the medians average over engines too; ``none-again`` (a second engine
without speculation) shows what is left of that noise. Reports output tokens/s, the speed-up over no speculation (best run over
best run, and the median over repeats of each run over the same repeat's run without
speculation, which the machine's drift affects less) and the acceptance rate (accepted /
proposed drafts) with the mean tokens per verification step.

    python benchmarks/spec_decode.py [--output-len 128 --repeats 2 --workload copy,chat,concurrent]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from tokenmill import LLM, SamplingParams
from tokenmill.default_model import default_model_path

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

FIXED = {"adaptive_draft_length": False}
LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}

CONFIGS = {
    "none": None,
    "none-again": None,
    **{
        f"ngram-k{k}": {"method": "ngram", "num_speculative_tokens": k, **LOOKUP, "disable_by_batch_size": 0}
        for k in (3, 4)
    },
    "ngram-k4-default-cutoff": {"method": "ngram", "num_speculative_tokens": 4, **LOOKUP},
    **{
        f"{method}-k{k}": {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 0, **FIXED}
        for method in ("eagle", "eagle3") for k in (1, 2, 3, 4)
    },
    **{
        f"{method}-k{k}-lookup": {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 0,
                                  **LOOKUP, **FIXED}
        for method in ("eagle", "eagle3") for k in (2, 3, 4)
    },
    "draft-self-k3": {"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 0, **FIXED},
    "eagle-k3-default-cutoff": {"method": "eagle", "num_speculative_tokens": 3, **FIXED},
    "eagle3-k3-default-cutoff": {"method": "eagle3", "num_speculative_tokens": 3, **FIXED},
    **{
        f"{method}-k3-adaptive": {"method": method, "num_speculative_tokens": 3}
        for method in ("eagle", "eagle3")
    },
    "draft-self-k3-adaptive": {"method": "draft_model", "num_speculative_tokens": 3},
    "ngram-k4-adaptive": {"method": "ngram", "num_speculative_tokens": 4, **LOOKUP, "adaptive_draft_length": True},
}
"""Configurations by name; ``eagle`` and ``eagle3`` ones use the heads shipped for the default
model, ``-lookup`` ones draft from a prompt lookup first (the head where it finds no match);
``draft-self-k3`` is the default model drafting for itself (the acceptance of a draft model
whose distribution equals the target's: 1.0 at any temperature when ``q`` is used). All but
``-adaptive`` ones draft a fixed k (below the cut-off: ``disable_by_batch_size`` 0, or the
method's default with ``-default-cutoff``); ``-adaptive`` ones choose each request's length
(``tokenmill.core.draft_length_policy``, the default of the model methods). ``none-again``
is a second engine without speculation: its speed-up over ``none`` is the run's noise floor
(two identical engines, alternated)."""

QUESTIONS = [
    "Explain what this passage says in your own words.",
    "What are the main points of this passage? Answer in a short paragraph.",
    "Write a few questions a student might ask about this passage, and answer them.",
    "Why might this passage matter to someone today?",
]


def _user_turns(llm: LLM, contents: list[str]) -> list[str]:
    """Each of ``contents`` as a user's chat message, in the model's chat template."""
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        for content in contents
    ]


def _prompts(llm: LLM, n: int) -> list[str]:
    texts = (" ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(3)) for i in range(n))
    return _user_turns(llm, [f"Repeat this text word for word:\n\n{text}" for text in texts])


ASKS = [
    "Explain how lighthouses work to a child.",
    "Write a short poem about kites.",
    "List three facts about glass making.",
    "Why do people learn to play the violin?",
]


def _ask_prompts(llm: LLM, n: int) -> list[str]:
    return _user_turns(llm, [ASKS[i % len(ASKS)] for i in range(n)])


def _chat_prompts(llm: LLM, n: int, length: int = 256) -> list[dict]:
    """``n`` chat prompts of exactly ``length`` tokens: a question, then passages cut to fit."""
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        text = " ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(len(PASSAGES)))
        words = text.split()
        while True:
            messages = [{"role": "user", "content": f"{question}\n\n{' '.join(words)}"}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= length:
                break
            words = words[: -max(1, (len(ids) - length) // 2)]
        out.append({"prompt_token_ids": list(ids)})
    return out


def _run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def _with_draft_model(config: dict | None) -> dict | None:
    """A ``draft_model`` configuration drafts with the default model unless it names one."""
    if config is None or config["method"] != "draft_model" or "model" in config:
        return config
    return {**config, "model": default_model_path()}


SPEC_COUNTERS = (
    "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
    *(f"spec_num_accepted_tokens_pos_{i}" for i in range(8)),
    *(f"spec_draft_length_{k}" for k in range(9)),
)


@dataclass
class _Cell:
    """One workload at one concurrency: each configuration's speeds (one per repeat and
    engine set) and its speculation counters summed over them."""

    workload: str
    requests: int
    speeds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    counters: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    cutoff: dict[str, int] = field(default_factory=dict)

    def run(self, engines: dict[str, LLM], repeats: int, params: SamplingParams, single_stream_prompts: int) -> None:
        make_prompts = {"chat": _chat_prompts, "ask": _ask_prompts, "short": _ask_prompts}.get(
            self.workload.split("-")[0], _prompts
        )
        for llm in engines.values():
            _run(llm, _prompts(llm, 1), SamplingParams(temperature=0, max_tokens=8))
        for _ in range(repeats):
            for name, llm in engines.items():
                before = llm.get_stats()
                if self.requests == 1:  # single stream: the prompts one after another
                    runs = [_run(llm, [p], params) for p in make_prompts(llm, single_stream_prompts)]
                    tokens, seconds = sum(r[0] for r in runs), sum(r[1] for r in runs)
                else:
                    tokens, seconds = _run(llm, make_prompts(llm, self.requests), params)
                self.speeds[name].append(tokens / seconds)
                after = llm.get_stats()
                self.counters[name].update({k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS})
        for name, llm in engines.items():
            spec = llm.llm_engine.config.speculative
            if spec is not None and spec.adaptive_draft_length:
                self.cutoff[name] = llm.get_stats()["spec_disable_by_batch_size"]

    def rows(self) -> list[dict]:
        base = self.speeds.get("none")
        out = []
        for name, speeds in self.speeds.items():
            c = self.counters[name]
            drafts, proposed = c["spec_num_drafts"], c["spec_num_draft_tokens"]
            row = {
                "workload": self.workload,
                "requests": self.requests,
                "config": name,
                "output_tok_s": [round(s, 1) for s in speeds],
                "speedup_best": round(max(speeds) / max(base), 2) if base else None,
                "speedup_median": round(statistics.median(s / b for s, b in zip(speeds, base)), 2) if base else None,
                "acceptance": round(c["spec_num_accepted_tokens"] / proposed, 3) if proposed else None,
                "tokens_per_verify_step": round(1 + c["spec_num_accepted_tokens"] / drafts, 2) if drafts else None,
                "acceptance_per_position": [
                    round(c[f"spec_num_accepted_tokens_pos_{i}"] / drafts, 3)
                    for i in range(8) if c[f"spec_num_accepted_tokens_pos_{i}"]
                ] if drafts else None,
            }
            counts = [c[f"spec_draft_length_{k}"] for k in range(9)]
            if name in self.cutoff and sum(counts):
                row["draft_length_mean"] = round(sum(k * n for k, n in enumerate(counts)) / sum(counts), 2)
                row["disable_by_batch_size"] = self.cutoff[name]
            out.append(row)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--concurrencies", default=None,
                        help="comma-separated: run every workload (a prompt kind) at each")
    parser.add_argument("--single-stream-prompts", type=int, default=4,
                        help="prompts a single-stream run generates for, one at a time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-sets", type=int, default=1,
                        help="build every configuration's engine this many times, one set after another, "
                        "each running every workload --repeats times")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the timed requests (0: greedy)")
    parser.add_argument("--workload", default="copy,chat,concurrent")
    parser.add_argument("--configs", default="none,ngram-k4,ngram-k4-default-cutoff,eagle3-k3,eagle3-k3-default-cutoff")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    cells = [
        _Cell(workload, args.concurrency if workload.endswith("concurrent") else 1)
        for workload in args.workload.split(",")
    ]
    if args.concurrencies:
        cells = [_Cell(kind, int(c)) for kind in args.workload.split(",") for c in args.concurrencies.split(",")]
    for engine_set in range(args.engine_sets):
        engines = {
            name: LLM(speculative_config=_with_draft_model(CONFIGS[name]), kv_cache_memory_bytes=2**29)
            for name in args.configs.split(",")
        }
        for cell in cells:
            cell.run(engines, args.repeats, params, args.single_stream_prompts)
            if engine_set == args.engine_sets - 1:
                for row in cell.rows():
                    print(json.dumps(row), flush=True)
        engines.clear()
        gc.collect()


if __name__ == "__main__":
    main()
