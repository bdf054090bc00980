"""Train the EAGLE-3 head shipped for the default model (SmolLM2-135M-Instruct), on the CPU, by
self-distillation: the target's own greedy continuations of locally written prompts are the data.

1. Prompts: chat requests composed from topic x task templates, and questions about passages
   of local text (``docs/*.md``, ``tests/lm_eval_tasks/*.jsonl``, one or two paragraphs each). The
   README and the passages of ``benchmarks/spec_decode.py`` are left out: the benchmark's
   prompts come from them.
2. tokenmill generates each prompt's greedy continuation (``--gen-tokens``, ``ignore_eos``).
3. transformers runs the same weights over prompt + continuation once and keeps the residual
   stream entering layers 2, 15 and 27 (what the engine feeds the head; float16 in memory) and
   the target's argmax at every position.
4. The draft vocabulary is the ``--draft-vocab`` tokens the target predicts most often;
   ``d2t`` maps them back.
5. The head (``fc`` over the three layers' states, one Llama decoder layer over
   ``[embedding || hidden]``, norm, LM head over the draft vocabulary) is trained at every
   position, prompt ones included, with cross-entropy on the target's argmax one position on
   (what greedy verification compares a draft with), unrolled over ``--ttt-steps`` draft steps
   as at inference: step j feeds back the head's own output of step j - 1 and attends to the
   earlier positions' step-0 entries plus its own chain (EAGLE-3's "training-time test"). The
   LM head starts from the target's (tied) embedding rows of the draft vocabulary and the final
   norm from the target's. The learning rate follows a cosine over ``--train-minutes``, and the
   head is saved every ``--save-minutes`` (the data of steps 1-3 once, with ``--data``).
6. The head is written as float16 safetensors in the EAGLE-3 authors' layout (``fc``,
   ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) with its ``config.json``; the
   held-out top-1 (generated positions of held-out prompts) is printed per draft step.

    python scripts/train_eagle3.py --out spec_decode/heads/SmolLM2-135M-Instruct-eagle3

Seeded (``--seed``); what it printed for the shipped head is in the head's README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

TOPICS = [
    "volcanoes", "the moon landing", "honeybees", "climate change", "the French Revolution",
    "black holes", "machine learning", "the human heart", "coffee", "the Roman Empire",
    "rainforests", "electric cars", "the Internet", "dinosaurs", "photosynthesis",
    "the stock market", "chess", "the Great Wall of China", "vaccines", "recycling",
    "the water cycle", "ancient Egypt", "solar energy", "octopuses", "the piano",
    "earthquakes", "the printing press", "sleep", "bread baking", "the Olympic Games",
    "glaciers", "democracy", "spiders", "the speed of light", "jazz music", "gardening",
    "the immune system", "bicycles", "Mars", "coral reefs", "the Renaissance", "sharks",
    "time management", "public speaking", "the periodic table", "hurricanes", "origami",
    "friendship", "the Amazon river", "smartphones", "penguins", "learning a new language",
    "a rainy day", "the ocean", "a lost cat", "a robot who learns to paint", "a small village",
    "prime numbers", "sorting algorithms", "a healthy breakfast", "running a marathon",
    "the history of money", "owls", "tea", "wind turbines", "the Silk Road", "bridges",
]

TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write a short story about {t}.",
    "List five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a poem about {t}.",
    "Give me a step-by-step guide to learning about {t}.",
    "Write a friendly email to a colleague about {t}.",
    "Summarize the history of {t} in one paragraph.",
    "Describe {t} in three sentences.",
    "Why is {t} important? Answer briefly.",
    "Write a short blog post introduction about {t}.",
    "What are common misconceptions about {t}?",
    "Create a quiz with three questions about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Write a Python function that prints a fact about {t}, with a docstring.",
    "Tell me a joke about {t}.",
    "How would you explain {t} to someone from the year 1800?",
    "Write a dialogue between a teacher and a student about {t}.",
]

PASSAGE_TASKS = [
    "Summarize this text:\n\n{p}",
    "Explain the main idea of this text in simple words:\n\n{p}",
    "Rewrite this text in a more formal tone:\n\n{p}",
    "What is this text about?\n\n{p}",
    "Turn the key points of this text into a bullet list:\n\n{p}",
    "Read the text below and tell me what you learned from it.\n\n{p}",
    "What questions does this text answer? Answer them.\n\n{p}",
    "Who would find this text useful, and why?\n\n{p}",
]

AUX_LAYERS = (2, 15, 27)


def passages() -> list[str]:
    """Paragraphs of local text (not the README, which the benchmark uses)."""
    texts = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in path.read_text().split("\n\n"):
            block = block.strip()
            if 200 <= len(block) <= 1200 and not block.startswith(("```", "|")):
                texts.append(block)
    for path in sorted((ROOT / "tests" / "lm_eval_tasks").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            texts.append(" ".join(str(v) for v in json.loads(line).values()))
    return texts


def compose_prompts(n: int, seed: int) -> list[str]:
    """Half topic x task requests, half questions about one or two local passages."""
    rng = random.Random(seed)
    pairs = [(task, topic) for task in TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    texts = passages()
    out = []
    for i in range(n):
        if i % 2 and texts:
            text = "\n\n".join(rng.sample(texts, rng.randint(1, 2)))
            out.append(rng.choice(PASSAGE_TASKS).format(p=text))
        else:
            task, topic = pairs[i % len(pairs)]
            out.append(task.format(t=topic))
    return out


def generate(prompts: list[str], gen_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation ids) per prompt, from tokenmill."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(max_model_len=1024, kv_cache_memory_bytes=2**30)
    tokenizer = llm.get_tokenizer()
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    params = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    outs = llm.generate(chats, params, use_tqdm=True)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


@torch.inference_mode()
def target_features(model_dir: str, seqs: list[tuple[list[int], list[int]]], batch_tokens: int):
    """Per sequence: the residual stream entering ``AUX_LAYERS`` ([L, 3·hidden], float16) and
    the target's argmax at each position ([L]); the embedding and final norm weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    preds: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        length = len(seqs[order[i]][0]) + len(seqs[order[i]][1])
        group = order[i : i + max(1, batch_tokens // length)]
        i += len(group)
        ids = [seqs[j][0] + seqs[j][1] for j in group]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        hs = model.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[layer] for layer in AUX_LAYERS], dim=-1).half()
        argmax = model.lm_head(hs[-1]).argmax(dim=-1)
        for row, j in enumerate(group):
            feats[j] = aux[row, : len(ids[row])].clone()
            preds[j] = argmax[row, : len(ids[row])].clone()
        print(f"features {i}/{len(order)}", flush=True)
    embed = model.model.embed_tokens.weight.detach().clone()
    return feats, preds, embed, model.model.norm.weight.detach().clone()


EAGLE3_NAMES = {
    "fc": "fc", "norm": "norm", "lm_head": "lm_head",
    "input_layernorm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
    "post_attention_layernorm": "midlayer.post_attention_layernorm",
    **{p: f"midlayer.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{p: f"midlayer.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
}
"""``Eagle3Head`` module names -> the EAGLE-3 checkpoint's (``.weight`` appended)."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Eagle3Head(nn.Module):
    """The head as tokenmill's ``Eagle3LlamaForCausalLM`` runs it, over whole sequences, with
    the unrolled attention of the training-time test."""

    def __init__(self, cfg: dict, embed: torch.Tensor, draft_vocab: int) -> None:
        super().__init__()
        h, inter, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg["rms_norm_eps"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or h // self.heads
        theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
        self.register_buffer("embed", embed, persistent=False)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of output states."""
        return self.lm_head(self.norm(hidden))

    def forward(self, next_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The output (pre-norm) states of each unrolled step ([B, L, hidden] each).

        Position ``q`` of step ``j`` reads token ``next_ids[q]`` and, for ``j > 0``, the step
        ``j - 1`` output at ``q - 1``; it attends to step-0 keys at positions ``<= q - j`` and to
        the key of step ``i`` at ``q - j + i`` for ``i = 1..j``."""
        b, length, _ = aux.shape
        emb = self.input_layernorm(F.embedding(next_ids, self.embed))
        hidden = self.fc(aux)
        scale = self.head_dim**-0.5
        rows = torch.arange(length)[:, None]
        cols = torch.arange(length)[None]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for j in range(steps):
            if j:
                hidden = F.pad(hidden, (0, 0, 1, 0))[:, :length]
            x = torch.cat((emb, self.hidden_norm(hidden)), dim=-1)
            q = self.rope(self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2))
            k = self.rope(self.k_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2))
            v = self.v_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
            rep = self.heads // self.kv_heads
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
            scores = (q @ keys[0].transpose(-1, -2)) * scale
            scores = scores.masked_fill(cols > rows - j, float("-inf"))
            extra_scores, extra_values = [], []
            for i in range(1, j + 1):
                shift = j - i
                k_i = F.pad(keys[i], (0, 0, shift, 0))[:, :, :length]
                extra_values.append(F.pad(values[i], (0, 0, shift, 0))[:, :, :length])
                extra_scores.append((q * k_i).sum(-1, keepdim=True) * scale)
            probs = torch.cat([scores, *extra_scores], dim=-1).softmax(dim=-1)
            attn = probs[..., :length] @ values[0]
            for i, v_i in enumerate(extra_values):
                attn = attn + probs[..., length + i : length + i + 1] * v_i
            attn = self.o_proj(attn.transpose(1, 2).reshape(b, length, -1))
            residual = hidden + attn
            hidden = residual + self.down_proj(
                F.silu(self.gate_proj(self.post_attention_layernorm(residual))) * self.up_proj(self.post_attention_layernorm(residual))
            )
            outputs.append(hidden)
        return outputs

    def state_dict_eagle3(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {f"{EAGLE3_NAMES[n.split('.')[0]]}.weight": p.detach().half().contiguous() for n, p in self.named_parameters()}
        return out | {"d2t": d2t, "t2d": t2d}

    def load_eagle3(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load what ``state_dict_eagle3`` wrote (less ``d2t``/``t2d``)."""
        ours = {f"{theirs}.weight": name for name, theirs in EAGLE3_NAMES.items()}
        self.load_state_dict({f"{ours[n]}.weight": t.float() for n, t in tensors.items()})


def batches(examples, batch_tokens: int, rng: random.Random):
    """Groups of examples of similar length, about ``batch_tokens`` padded tokens each."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    groups, i = [], 0
    while i < len(order):
        n = max(1, batch_tokens // len(examples[order[i]][0]))
        groups.append(order[i : i + n])
        i += n
    rng.shuffle(groups)
    return groups


def collate(examples, group):
    width = max(len(examples[i][0]) for i in group)
    ids = torch.zeros(len(group), width, dtype=torch.int64)
    labels = torch.full((len(group), width), -100, dtype=torch.int64)
    aux = torch.zeros(len(group), width, examples[group[0]][2].shape[-1])
    for row, i in enumerate(group):
        next_ids, lab, feats = examples[i]
        ids[row, : len(next_ids)] = next_ids
        labels[row, : len(lab)] = lab
        aux[row, : len(feats)] = feats.float()
    return ids, labels, aux


def step_losses(model, ids, labels, aux, steps):
    """Cross-entropy and top-1 accuracy per unrolled step; step j scores positions >= j."""
    out = []
    for j, hidden in enumerate(model(ids, aux, steps)):
        valid = labels != -100
        valid[:, :j] = False
        logits = model.logits(hidden[valid])
        loss = F.cross_entropy(logits, labels[valid])
        acc = (logits.argmax(-1) == labels[valid]).float().mean()
        out.append((loss, acc))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--train-minutes", type=float, default=30)
    parser.add_argument("--save-minutes", type=float, default=5)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, help="cache of steps 1-3 (written if missing)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from tokenmill.default_model import default_model_path

    model_dir = str(default_model_path())
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t0 = time.perf_counter()
    if args.data is not None and args.data.exists():
        seqs, feats, preds, embed, final_norm = torch.load(args.data)
    else:
        seqs = generate(compose_prompts(args.prompts, args.seed), args.gen_tokens)
        print(f"generated {sum(len(g) for _, g in seqs)} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        feats, preds, embed, final_norm = target_features(model_dir, seqs, 4 * args.batch_tokens)
        if args.data is not None:
            torch.save((seqs, feats, preds, embed, final_norm), args.data)
    print(f"data ready after {time.perf_counter() - t0:.0f} s: {len(seqs)} sequences, "
          f"{sum(len(p) for p, _ in seqs)} prompt and {sum(len(g) for _, g in seqs)} generated tokens", flush=True)

    counts = torch.bincount(torch.cat(preds), minlength=cfg["vocab_size"])
    draft_ids = counts.argsort(descending=True, stable=True)[: args.draft_vocab].sort().values
    coverage = counts[draft_ids].sum().item() / counts.sum().item()
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(args.draft_vocab)
    print(f"draft vocabulary {args.draft_vocab}: {coverage:.3f} of the target's predictions", flush=True)

    # Example: next ids (x[q+1]), labels (draft id of the target's argmax at q+1), features f[q].
    examples = [
        (torch.tensor(prompt + gen)[1:], to_draft[p[1:]], f[:-1], len(prompt))
        for (prompt, gen), f, p in zip(seqs, feats, preds)
    ]
    rng.shuffle(examples)
    n_eval = max(1, len(examples) // 20)
    # held out: scored on the generated positions only, as the engine drafts
    evals = [(ids, lab.clone().index_fill_(0, torch.arange(n - 2), -100), f) for ids, lab, f, n in examples[:n_eval]]
    train = [(ids, lab, f) for ids, lab, f, _ in examples[n_eval:]]

    cfg_head = dict(cfg, intermediate_size=args.intermediate_size)
    model = Eagle3Head(cfg_head, embed, args.draft_vocab)
    with torch.no_grad():
        model.lm_head.weight.copy_(embed[draft_ids])
        model.norm.weight.copy_(final_norm)
        for lin in (model.q_proj, model.k_proj, model.v_proj, model.o_proj, model.gate_proj, model.up_proj, model.down_proj, model.fc):
            nn.init.normal_(lin.weight, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    weights = [0.8**j for j in range(args.ttt_steps)]
    budget, warmup = 60 * args.train_minutes, 30
    done, epoch, saved = 0, 0, 0.0
    t_train = time.perf_counter()
    while (elapsed := time.perf_counter() - t_train) < budget:
        epoch += 1
        for group in batches(train, args.batch_tokens, rng):
            elapsed = time.perf_counter() - t_train
            if elapsed >= budget:
                break
            if elapsed - saved >= 60 * args.save_minutes:
                save_head(args.out, model, cfg_head, draft_ids)
                saved = elapsed
            lr = args.lr * min(1.0, (done + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
            for g in opt.param_groups:
                g["lr"] = lr
            ids, labels, aux = collate(train, group)
            losses = step_losses(model, ids, labels, aux, args.ttt_steps)
            loss = sum(w * l for w, (l, _) in zip(weights, losses))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            done += 1
            if done % 20 == 0:
                accs = " ".join(f"{a.item():.3f}" for _, a in losses)
                print(f"step {done} epoch {epoch} lr {lr:.2e} loss {loss.item():.3f} acc/step {accs} "
                      f"({elapsed:.0f} s)", flush=True)
    print(f"trained {done} steps of {args.batch_tokens} tokens ({epoch} epochs begun) in "
          f"{time.perf_counter() - t_train:.0f} s", flush=True)

    with torch.no_grad():
        sums = [[0.0, 0.0] for _ in range(args.ttt_steps)]
        tokens = 0
        for group in batches(evals, args.batch_tokens, rng):
            ids, labels, aux = collate(evals, group)
            n = (labels != -100).sum().item()
            tokens += n
            for j, (loss, acc) in enumerate(step_losses(model, ids, labels, aux, args.ttt_steps)):
                sums[j][0] += loss.item() * n
                sums[j][1] += acc.item() * n
    print("held-out loss / top-1 per step: " + ", ".join(
        f"{s[0] / tokens:.3f} / {s[1] / tokens:.3f}" for s in sums), flush=True)

    save_head(args.out, model, cfg_head, draft_ids)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s total", flush=True)


def save_head(out: Path, model: Eagle3Head, cfg: dict, draft_ids: torch.Tensor) -> None:
    """Write ``model`` (float16) and its ``config.json`` (the target's ``cfg`` as the head's)
    in the EAGLE-3 layout; ``draft_ids`` are the sorted target ids of the draft vocabulary."""
    out.mkdir(parents=True, exist_ok=True)
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(len(draft_ids))
    save_file(model.state_dict_eagle3(d2t, t2d), str(out / "model.safetensors"))
    head_cfg = {k: v for k, v in cfg.items() if k != "torch_dtype"}
    head_cfg |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": len(draft_ids),
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2) + "\n")


if __name__ == "__main__":
    main()
