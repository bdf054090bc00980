"""Does the engine feed an EAGLE head as training did? On held-out text the default model
generates itself, compare the head's teacher-forced top-1 per draft step (the training
objective, computed by ``train_eagle.py``'s whole-sequence head) with the engine's acceptance
per draft position on the same prompts. A large gap means the engine feeds the head other
inputs than training did.

    python scripts/eagle_acceptance.py [--method eagle3] [--head DIR] [--prompts 8] [--gen-tokens 96]

The prompts are composed as the training script's are, with another seed and past the ones it
used. Acceptance at position 0 should come close to step 0's top-1 (drafts start at a subset of
the positions); at position j it cannot exceed the smallest top-1 of steps 0..j (a draft is
only verified after the ones before it were accepted, so it sees true predecessors, as the
teacher-forced steps do). The top-2 to top-``--top-k`` hit rates bound what a tree of drafts
(several candidates per position, as the EAGLE authors verify) could accept over the chain.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import train_eagle as train
from tokenmill import LLM, SamplingParams
from tokenmill.default_model import default_model_path
from tokenmill.spec_decode.eagle import DEFAULT_MODEL_HEADS


def teacher_forced_top_k(method: str, head_dir: Path, seqs, steps: int, top_k: int) -> torch.Tensor:
    """``[steps, top_k]``: how often the target's token (at a generated position) is among the
    head's first 1..top_k drafts, per draft step."""
    feats, lasts, preds, embed, _ = train.target_features(str(default_model_path()), seqs, 8192)
    cfg = json.loads((head_dir / "config.json").read_text())
    tensors = load_file(str(head_dir / "model.safetensors"))
    if method == "eagle3":
        draft_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
        head: train.DraftHead = train.Eagle3Head(cfg, embed, len(draft_ids))
    elif "d2t" in tensors:  # its own LM head rows over a draft vocabulary, as the shipped head
        draft_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
        head, feats = train.EagleHead(cfg, embed, tensors["lm_head.weight"].float()), lasts
    else:  # the LM head is the target's (tied) embedding, over the whole vocabulary
        draft_ids = torch.arange(len(embed))
        head, feats = train.EagleHead(cfg, embed, embed), lasts
    head.load_checkpoint(tensors)
    hits, totals = torch.zeros(steps, top_k), [0] * steps
    with torch.no_grad():
        for (prompt, gen), f, p in zip(seqs, feats, preds):
            ids = torch.tensor(prompt + gen)
            for j, hidden in enumerate(head(ids[1:][None], f[:-1].float()[None], steps)):
                at = slice(max(j, len(prompt) - 2), len(ids) - 1)
                drafts = draft_ids[head.logits(hidden[0, at]).topk(top_k, dim=-1).indices]
                hits[j] += (drafts == p[1:][at][:, None]).cumsum(-1).clamp(max=1).sum(0)
                totals[j] += at.stop - at.start
    return hits / torch.tensor(totals, dtype=torch.float32)[:, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(DEFAULT_MODEL_HEADS), default="eagle3")
    parser.add_argument("--head", type=Path, help="default: the one shipped for the method")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--top-k", type=int, default=4, help="report the top-1..top-k hit rates")
    args = parser.parse_args()
    head = args.head or DEFAULT_MODEL_HEADS[args.method]
    prompts = train.compose_prompts(1000 + args.prompts, 12345, train.passages())[-args.prompts :]
    seqs = train.generate(train.engine(), prompts, args.gen_tokens)
    rates = teacher_forced_top_k(args.method, head, seqs, args.k, args.top_k)
    print("teacher-forced top-1 per draft step: " + " ".join(f"{a:.3f}" for a in rates[:, 0]))
    for j, row in enumerate(rates):
        print(f"  step {j}, top-1..{args.top_k}: " + " ".join(f"{a:.3f}" for a in row))

    spec = {"method": args.method, "model": str(head), "num_speculative_tokens": args.k, "disable_by_batch_size": 0}
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes=2**28, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    for prompt, gen in seqs:  # one at a time, as the single-stream benchmark runs
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == gen
    stats = llm.get_stats()
    per_position = [stats[f"spec_num_accepted_tokens_pos_{i}"] / stats["spec_num_drafts"] for i in range(args.k)]
    print("engine acceptance per draft position: " + " ".join(f"{a:.3f}" for a in per_position))
    print(f"engine tokens per verification step: {1 + stats['spec_num_accepted_tokens'] / stats['spec_num_drafts']:.2f}")


if __name__ == "__main__":
    main()
