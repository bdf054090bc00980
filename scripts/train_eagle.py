"""Train the EAGLE heads shipped for the default model (SmolLM2-135M-Instruct), on the CPU: the
target's own labels (its argmax at every position) over its greedy continuations of locally
written prompts and, with ``--corpus``, over local text it is teacher-forced on.

1. Prompts, in two rounds. Round one asks for ``--paragraphs`` paragraphs about topics; round
   two (``--prompts``) is half topic x task requests, half questions about one to three
   passages: paragraphs round one wrote, ``docs/*.md`` and ``tests/support/lm_eval_tasks/*.jsonl``. The
   README and the passages of ``benchmarks/spec_decode.py`` are left out: the benchmark's
   prompts come from them.
2. tokenmill generates each prompt's greedy continuation (``--gen-tokens``, ``ignore_eos``).
   With ``--corpus`` (a file of ``scripts/eagle_corpus.py``: manual pages, the standard
   library's documentation, package READMEs), ``--corpus-tokens`` tokens of its documents are
   added as pieces of ``--corpus-seq-len`` tokens (the target is teacher-forced on them: no
   generation).
3. transformers runs the same weights over each sequence once and keeps, float16, the residual
   stream entering layers 2, 15 and 27 (what the engine feeds an EAGLE-3 head), the final
   normalised state (what it feeds an EAGLE-1 head) and the target's argmax at every position.
4. The ``--draft-vocab`` tokens the target predicts most often are the head's draft vocabulary
   (``d2t`` maps them back): an EAGLE-3 head's LM head has those rows; an EAGLE-1 head is
   trained through the target's LM head rows of them, and ships those rows as its own.
   ``--init-head`` starts from a trained head and keeps its vocabulary.
5. ``--method eagle3``: ``fc`` over the three layers' states, one Llama decoder layer over
   ``[embedding || hidden]``, norm, LM head over the draft vocabulary (started from the
   target's tied embedding rows and final norm). ``--method eagle``: ``fc`` over
   ``[embedding || final state]``, one decoder layer whose output is the predicted next final
   state, the target's LM head rows of the draft vocabulary. Trained at every position, prompt
   ones included, with cross-entropy on the target's argmax one position on (what greedy
   verification compares a draft with; EAGLE-1 adds the distance to the target's next state),
   unrolled over ``--ttt-steps`` draft steps as at inference: step j feeds back the head's own
   output of step j - 1 and attends to the earlier positions' step-0 entries plus its own
   chain (EAGLE-3's "training-time test"). The learning rate follows a cosine over
   ``--total-steps``.
6. The head is written as float16 safetensors in its authors' layout (EAGLE-3: ``fc``,
   ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; EAGLE-1: ``fc``, ``layers.0.*``,
   and ``lm_head``, ``d2t``, ``t2d`` as EAGLE-3's) with its ``config.json``, and the held-out
   top-1 per draft step is printed per kind of text: generated positions of held-out chat
   prompts, every position of held-out corpus documents.

Training is resumable (``Workdir``): the data is made once, in shards listed in a manifest, and
the head, optimizer and step count are saved every ``--save-minutes``; a run stops after
``--train-minutes`` and the next run with the same ``--workdir`` goes on where it stopped, until
``--total-steps``::

    python scripts/eagle_corpus.py --out /work/eagle/corpus.jsonl
    python scripts/train_eagle.py --method eagle3 --out spec_decode/heads/SmolLM2-135M-Instruct-eagle3 \
        --workdir /work/eagle --corpus /work/eagle/corpus.jsonl --corpus-tokens 400000

Seeded (``--seed``); what it printed for the shipped heads is in their README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
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
    "the Vikings", "the human brain", "antibiotics", "the steam engine", "the Cold War",
    "nuclear power", "the Sahara desert", "elephants", "the Moon", "the telephone",
    "the Black Death", "the theory of evolution", "DNA", "the Pacific Ocean", "tornadoes",
    "the Aztecs", "ancient Greece", "the Eiffel Tower", "the Amazon rainforest", "whales",
    "the railway", "airplanes", "the camera", "the human skeleton", "the solar system",
    "gravity", "electricity", "magnets", "rainbows", "the seasons", "the Arctic", "deserts",
    "mountains", "rivers", "the Industrial Revolution", "the Middle Ages", "castles",
    "the Internet of Things", "cloud computing", "databases", "operating systems",
    "the Python programming language", "open-source software", "cybersecurity", "robots",
    "artificial intelligence", "video games", "social media", "online shopping",
    "renewable energy", "water pollution", "plastic waste", "deforestation", "biodiversity",
    "the human digestive system", "nutrition", "exercise", "meditation", "stress",
    "the common cold", "blood", "the eye", "the ear", "teeth", "the skin", "muscles",
    "Shakespeare", "the novel", "poetry", "painting", "sculpture", "architecture",
    "classical music", "rock music", "the guitar", "film", "theatre", "photography",
    "football", "tennis", "swimming", "the Tour de France", "mountain climbing", "yoga",
    "cooking pasta", "chocolate", "cheese", "rice", "the potato", "spices", "wine making",
    "farming", "bees and pollination", "forests", "mushrooms", "trees", "flowers", "cats",
    "dogs", "horses", "birds", "frogs", "butterflies", "ants", "wolves", "lions",
    "inflation", "taxes", "banks", "trade", "supply and demand", "startups", "marketing",
    "job interviews", "writing a resume", "teamwork", "leadership", "negotiation",
    "saving money", "budgeting", "studying for exams", "reading books", "libraries",
    "universities", "the scientific method", "telescopes", "microscopes", "atoms",
    "chemical reactions", "the weather", "clouds", "snow", "the sun", "stars", "comets",
    "the International Space Station", "rockets", "satellites", "GPS", "maps",
    "the compass", "sailing ships", "submarines", "trains", "cities", "traffic",
    "public transport", "housing", "the family", "childhood", "old age", "holidays",
    "birthdays", "New Year traditions", "festivals", "languages", "writing systems",
    "the alphabet", "mathematics", "fractions", "geometry", "statistics", "probability",
    "algebra", "calculus", "cryptography", "computer networks", "the web browser",
    "email", "search engines", "programming", "debugging code", "unit tests", "Linux",
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
    "What is {t}?",
    "Tell me about {t}.",
    "How does {t} work?",
    "What should a beginner know about {t}?",
    "Give three tips related to {t}.",
    "Write an essay outline about {t}.",
    "What is the future of {t}?",
    "How has {t} changed over time?",
    "Write a product description inspired by {t}.",
    "Describe a day in the life of someone who studies {t}.",
    "What are the key terms to know about {t}? Define each.",
    "Write a news headline and a short article about {t}.",
]

PARAGRAPH_TASKS = [
    "Write an informative paragraph about {t}.",
    "Write an encyclopedia-style paragraph about {t}.",
    "Write a paragraph about the history of {t}.",
    "Write a short factual text about {t} for a school textbook.",
]
"""Round one: paragraphs the default model writes, the passages of round two's questions."""

PASSAGE_TASKS = [
    "Summarize this text:\n\n{p}",
    "Explain the main idea of this text in simple words:\n\n{p}",
    "Rewrite this text in a more formal tone:\n\n{p}",
    "What is this text about?\n\n{p}",
    "Turn the key points of this text into a bullet list:\n\n{p}",
    "Read the text below and tell me what you learned from it.\n\n{p}",
    "What questions does this text answer? Answer them.\n\n{p}",
    "Who would find this text useful, and why?\n\n{p}",
    "Describe what this text tells us, in your own words.\n\n{p}",
    "Give a short summary of the important ideas in the following text.\n\n{p}",
    "Write three questions about this text and answer each one.\n\n{p}",
    "Why is the information in this text useful? Explain.\n\n{p}",
    "Explain this text to a child.\n\n{p}",
    "What is the most surprising fact in this text? Explain why.\n\n{p}",
    "Write a paragraph that continues this text.\n\n{p}",
    "List the facts in this text, one per line.\n\n{p}",
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
    for path in sorted((ROOT / "tests" / "support" / "lm_eval_tasks").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            texts.append(" ".join(str(v) for v in json.loads(line).values()))
    return texts


def paragraph_prompts(n: int, seed: int) -> list[str]:
    """Round one's requests: a paragraph about a topic."""
    rng = random.Random(seed)
    pairs = [(task, topic) for task in PARAGRAPH_TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    return [task.format(t=topic) for task, topic in pairs[:n]]


def compose_prompts(n: int, seed: int, texts: list[str]) -> list[str]:
    """Half topic x task requests, half questions about one to three of ``texts`` (joined,
    then cut to 40-220 words)."""
    rng = random.Random(seed)
    pairs = [(task, topic) for task in TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    out = []
    for i in range(n):
        if i % 2 and texts:
            words = " ".join(rng.sample(texts, rng.randint(1, 3))).split()
            text = " ".join(words[: rng.randint(40, 220)])
            out.append(rng.choice(PASSAGE_TASKS).format(p=text))
        else:
            task, topic = pairs[i % len(pairs)]
            out.append(task.format(t=topic))
    return out


def generate(llm, prompts: list[str], gen_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation ids) per prompt, from tokenmill's ``llm``."""
    from tokenmill import SamplingParams

    tokenizer = llm.get_tokenizer()
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    params = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    outs = llm.generate(chats, params, use_tqdm=True)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def engine():
    """The default model in tokenmill, batched for throughput."""
    from tokenmill import LLM

    return LLM(max_model_len=1024, kv_cache_memory_bytes=2**30, max_num_seqs=128, max_num_batched_tokens=4096)


def make_data(n_paragraphs: int, n_prompts: int, gen_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Two rounds of the default model's greedy continuations: paragraphs about topics, then
    requests and questions about those paragraphs and local passages."""
    llm = engine()
    tokenizer = llm.get_tokenizer()
    first = generate(llm, paragraph_prompts(n_paragraphs, seed), gen_tokens)
    written = []
    for _, gen in first:
        if tokenizer.eos_token_id in gen:
            gen = gen[: gen.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(gen, skip_special_tokens=True).strip()
        if len(text) >= 200:
            written.append(text)
    print(f"round one: {len(written)} of {len(first)} paragraphs kept as passages", flush=True)
    return first + generate(llm, compose_prompts(n_prompts, seed, passages() + written), gen_tokens)


@torch.inference_mode()
def target_features(model_dir: str, seqs: list[tuple[list[int], list[int]]], batch_tokens: int):
    """Per sequence: the residual stream entering ``AUX_LAYERS`` ([L, 3·hidden], float16, what
    an EAGLE-3 head reads), the final normalised hidden state ([L, hidden], float16, what an
    EAGLE-1 head reads) and the target's argmax at each position ([L]); the embedding and
    final norm weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    lasts: list[torch.Tensor | None] = [None] * len(seqs)
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
            lasts[j] = hs[-1][row, : len(ids[row])].half()
            preds[j] = argmax[row, : len(ids[row])].clone()
        print(f"features {i}/{len(order)}", flush=True)
    embed = model.model.embed_tokens.weight.detach().clone()
    return feats, lasts, preds, embed, model.model.norm.weight.detach().clone()


LAYER_NAMES = {
    "post_attention_layernorm": "post_attention_layernorm",
    **{p: f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{p: f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
}
"""The decoder layer's module names -> HF Llama's within a layer."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class DraftHead(nn.Module):
    """One Llama decoder layer run over whole sequences with the unrolled attention of the
    training-time test; subclasses say what enters the layer, how its output becomes logits
    and how the weights are named in their checkpoint layout (``names``: module -> name)."""

    names: dict[str, str]

    def __init__(self, cfg: dict, embed: torch.Tensor, qkv_in: int) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or h // self.heads
        theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
        self.register_buffer("embed", embed, persistent=False)
        self.q_proj = nn.Linear(qkv_in, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(qkv_in, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(qkv_in, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def start(self, feats: torch.Tensor) -> torch.Tensor:
        """The state step 0 reads from the target's features."""
        raise NotImplementedError

    def layer_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the attention projects, the residual) of a step reading ``emb`` and ``hidden``."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the training vocabulary of output states."""
        raise NotImplementedError

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, next_ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The output states of each unrolled step ([B, L, hidden] each).

        Position ``q`` of step ``j`` reads token ``next_ids[q]`` and, for ``j > 0``, the step
        ``j - 1`` output at ``q - 1``; it attends to step-0 keys at positions ``<= q - j`` and to
        the key of step ``i`` at ``q - j + i`` for ``i = 1..j``."""
        b, length = next_ids.shape
        emb = F.embedding(next_ids, self.embed)
        hidden = self.start(feats)
        scale = self.head_dim**-0.5
        rows = torch.arange(length)[:, None]
        cols = torch.arange(length)[None]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for j in range(steps):
            if j:
                hidden = F.pad(hidden, (0, 0, 1, 0))[:, :length]
            x, residual = self.layer_input(emb, hidden)
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
            residual = residual + self.o_proj(attn.transpose(1, 2).reshape(b, length, -1))
            normed = self.post_attention_layernorm(residual)
            hidden = residual + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
            outputs.append(hidden)
        return outputs

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The trained weights (float16) under the checkpoint layout's names."""
        return {
            f"{self.names[n.split('.')[0]]}.weight": p.detach().half().contiguous()
            for n, p in self.named_parameters()
        }

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load what ``checkpoint`` wrote (other tensors, as ``d2t``, are ignored)."""
        ours = {f"{theirs}.weight": name for name, theirs in self.names.items()}
        self.load_state_dict({f"{ours[n]}.weight": t.float() for n, t in tensors.items() if n in ours})


class Eagle3Head(DraftHead):
    """The head as tokenmill's ``Eagle3LlamaForCausalLM`` runs it: ``fc`` over the three
    layers' states; the layer reads ``[norm(embedding) || norm(state)]`` and adds to the state;
    logits through the final norm and the draft-vocabulary LM head."""

    names = {
        "fc": "fc", "norm": "norm", "lm_head": "lm_head",
        "input_layernorm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
        **{ours: f"midlayer.{theirs}" for ours, theirs in LAYER_NAMES.items()},
    }

    def __init__(self, cfg: dict, embed: torch.Tensor, draft_vocab: int) -> None:
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        super().__init__(cfg, embed, 2 * h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)

    def start(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(feats)

    def layer_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class EagleHead(DraftHead):
    """The head as tokenmill's ``EagleLlamaForCausalLM`` runs it (EAGLE-1): ``fc`` over
    ``[embedding || target's final normalised state]``, the layer without an input norm, its
    output the predicted next state, logits through the target's LM head (here ``lm_rows``,
    its rows of the training vocabulary)."""

    names = {"fc": "fc", **{ours: f"layers.0.{theirs}" for ours, theirs in LAYER_NAMES.items()}}

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_rows: torch.Tensor) -> None:
        h = cfg["hidden_size"]
        super().__init__(cfg, embed, h)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.register_buffer("lm_rows", lm_rows, persistent=False)

    def start(self, feats: torch.Tensor) -> torch.Tensor:
        return feats

    def layer_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((emb, hidden), dim=-1))
        return x, x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_rows.T


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
    """Padded (next ids, labels, features, regression targets or None) of ``group``."""
    width = max(len(examples[i][0]) for i in group)
    ids = torch.zeros(len(group), width, dtype=torch.int64)
    labels = torch.full((len(group), width), -100, dtype=torch.int64)
    feats = torch.zeros(len(group), width, examples[group[0]][2].shape[-1])
    regress = None if examples[group[0]][3] is None else torch.zeros_like(feats[..., : examples[group[0]][3].shape[-1]])
    for row, i in enumerate(group):
        next_ids, lab, f, r = examples[i]
        ids[row, : len(next_ids)] = next_ids
        labels[row, : len(lab)] = lab
        feats[row, : len(f)] = f.float()
        if regress is not None:
            regress[row, : len(r)] = r.float()
    return ids, labels, feats, regress


def step_losses(model, ids, labels, feats, regress, steps):
    """Loss and top-1 accuracy per unrolled step; step j scores positions >= j. The loss is
    cross-entropy on the target's next argmax, plus for EAGLE-1 ten times the smooth-L1
    distance to the target's next state (the EAGLE authors' 1 : 0.1 weighting)."""
    out = []
    for j, hidden in enumerate(model(ids, feats, steps)):
        valid = labels != -100
        valid[:, :j] = False
        logits = model.logits(hidden[valid])
        loss = F.cross_entropy(logits, labels[valid])
        if regress is not None:
            loss = loss + 10 * F.smooth_l1_loss(hidden[valid], regress[valid])
        acc = (logits.argmax(-1) == labels[valid]).float().mean()
        out.append((loss, acc))
    return out


@dataclass
class Sequence:
    """One training or held-out sequence: its token ids, and the first position whose next
    token is scored on held-out data (chat: the generated tokens; corpus text: all)."""

    ids: list[int]
    scored_from: int
    kind: str


def chat_sequences(args: argparse.Namespace) -> list[Sequence]:
    """Steps 1-2: the default model's greedy continuations of the composed prompts."""
    pairs = make_data(args.paragraphs, args.prompts, args.gen_tokens, args.seed)
    return [Sequence(prompt + gen, len(prompt), "chat") for prompt, gen in pairs]


def corpus_sequences(path: Path, tokens: int, seq_len: int, seed: int) -> list[Sequence]:
    """Pieces of ``seq_len`` tokens of the documents of ``eagle_corpus.py``'s file, in a seeded
    order, until ``tokens`` tokens of training documents and a twentieth of that of held-out
    ones are taken; held-out pieces are kinded ``<kind>-held-out``."""
    from transformers import AutoTokenizer

    from tokenmill.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    random.Random(seed).shuffle(docs)
    budget = {False: tokens, True: tokens // 20}
    out = []
    for doc in docs:
        if budget[doc["held_out"]] <= 0:
            continue
        ids = tokenizer(doc["text"])["input_ids"]
        for i in range(0, len(ids) - seq_len // 4, seq_len):
            piece = ids[i : i + seq_len]
            kind = doc["kind"] + ("-held-out" if doc["held_out"] else "")
            out.append(Sequence(piece, 1, kind))
            budget[doc["held_out"]] -= len(piece)
            if budget[doc["held_out"]] <= 0:
                break
    return out


class Workdir:
    """What a training run keeps between runs, in one directory:

    - ``manifest.json``: the arguments that made the data, the corpus file's digest and, per
      shard, its file, kind and token count;
    - ``shards/NNNN.pt``: sequences and the target's features over them (``target_features``),
      written one shard at a time, so an interrupted run resumes at the first shard missing;
    - ``state-<method>.pt``: the head, the optimizer, the steps done and the draft vocabulary,
      saved every ``--save-minutes``; a run with this file goes on from it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "shards").mkdir(parents=True, exist_ok=True)
        manifest = path / "manifest.json"
        self.manifest = json.loads(manifest.read_text()) if manifest.exists() else {"sources": {}, "shards": []}

    def save_manifest(self) -> None:
        (self.path / "manifest.json").write_text(json.dumps(self.manifest, indent=1) + "\n")

    def sequences(self, name: str, meta: dict, make) -> list[Sequence]:
        """The sequences of source ``name`` (``chat`` or ``corpus``), made by ``make()`` once and
        kept; a source made with other ``meta`` is refused rather than mixed."""
        cached = self.path / f"{name}-sequences.pt"
        known = self.manifest["sources"].get(name)
        if known is not None and known != meta:
            raise SystemExit(f"{self.path}: its {name} data was made with {known}, not {meta}; use another --workdir")
        if not cached.exists():
            torch.save([vars(s) for s in make()], cached)
            self.manifest["sources"][name] = meta
            self.save_manifest()
        return [Sequence(**s) for s in torch.load(cached)]

    def featurize(self, model_dir: str, seqs: list[Sequence], shard_sequences: int, batch_tokens: int) -> None:
        """Step 3, one shard at a time, for the sequences no shard holds yet."""
        done = sum(shard["sequences"] for shard in self.manifest["shards"])
        for start in range(done, len(seqs), shard_sequences):
            part = seqs[start : start + shard_sequences]
            feats, lasts, preds, embed, final_norm = target_features(
                model_dir, [(s.ids[:1], s.ids[1:]) for s in part], batch_tokens
            )
            name = f"shards/{len(self.manifest['shards']):04d}.pt"
            torch.save({"seqs": [vars(s) for s in part], "feats": feats, "lasts": lasts, "preds": preds}, self.path / name)
            torch.save((embed, final_norm), self.path / "target.pt")
            kinds = sorted({s.kind for s in part})
            self.manifest["shards"].append(
                {"file": name, "sequences": len(part), "tokens": sum(len(s.ids) for s in part), "kinds": kinds}
            )
            self.save_manifest()
            print(f"features: shard {name} ({start + len(part)}/{len(seqs)} sequences)", flush=True)

    def load(self, method: str):
        """Every shard's (sequence, its states for ``method``, the target's predictions)."""
        rows = []
        for shard in self.manifest["shards"]:
            data = torch.load(self.path / shard["file"])
            states = data["feats"] if method == "eagle3" else data["lasts"]
            rows += [(Sequence(**s), f, p) for s, f, p in zip(data["seqs"], states, data["preds"])]
        embed, final_norm = torch.load(self.path / "target.pt")
        return rows, embed, final_norm


def evaluate(model: DraftHead, evals: dict, batch_tokens: int, steps: int, rng: random.Random) -> dict[str, list[float]]:
    """Held-out top-1 per unrolled step, per kind of held-out text."""
    result = {}
    with torch.no_grad():
        for kind, examples in sorted(evals.items()):
            hits, tokens = [0.0] * steps, 0
            for group in batches(examples, batch_tokens, rng):
                batch = collate(examples, group)
                n = (batch[1] != -100).sum().item()
                tokens += n
                for j, (_, acc) in enumerate(step_losses(model, *batch, steps)):
                    hits[j] += acc.item() * n
            result[kind] = [round(h / tokens, 4) for h in hits]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("eagle3", "eagle"), default="eagle3")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True, help="data shards and training state, kept between runs")
    parser.add_argument("--paragraphs", type=int, default=640, help="round one's prompts")
    parser.add_argument("--prompts", type=int, default=2560, help="round two's prompts")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--corpus", type=Path, help="a JSONL file of scripts/eagle_corpus.py")
    parser.add_argument("--corpus-tokens", type=int, default=0, help="training tokens taken from --corpus")
    parser.add_argument("--corpus-seq-len", type=int, default=512)
    parser.add_argument("--shard-sequences", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=4096,
                        help="the draft vocabulary: the tokens the head's logits are over")
    parser.add_argument("--init-head", type=Path, help="start from this head (and its draft vocabulary)")
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--total-steps", type=int, default=640, help="the learning-rate schedule's length, over runs")
    parser.add_argument("--train-minutes", type=float, default=30, help="this run's training time at most")
    parser.add_argument("--save-minutes", type=float, default=5)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from tokenmill.default_model import default_model_path

    model_dir = str(default_model_path())
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t0 = time.perf_counter()
    work = Workdir(args.workdir)
    chat_meta = {"paragraphs": args.paragraphs, "prompts": args.prompts, "gen_tokens": args.gen_tokens, "seed": args.seed}
    seqs = work.sequences("chat", chat_meta, lambda: chat_sequences(args))
    if args.corpus is not None and args.corpus_tokens:
        corpus_meta = {
            "file": args.corpus.name, "sha256": hashlib.sha256(args.corpus.read_bytes()).hexdigest(),
            "tokens": args.corpus_tokens, "seq_len": args.corpus_seq_len, "seed": args.seed,
        }
        seqs = seqs + work.sequences(
            "corpus", corpus_meta, lambda: corpus_sequences(args.corpus, args.corpus_tokens, args.corpus_seq_len, args.seed)
        )
    work.featurize(model_dir, seqs, args.shard_sequences, 4 * args.batch_tokens)
    rows, embed, final_norm = work.load(args.method)
    print(f"data ready after {time.perf_counter() - t0:.0f} s: {len(rows)} sequences of "
          f"{sum(len(s.ids) for s, _, _ in rows)} tokens in {len(work.manifest['shards'])} shards", flush=True)

    # Held out: a twentieth of the chat prompts, scored on their generated positions as the
    # engine drafts, and the corpus documents eagle_corpus.py held out, scored everywhere.
    chat = [i for i, (s, _, _) in enumerate(rows) if s.kind == "chat"]
    held = set(random.Random(args.seed).sample(chat, max(1, len(chat) // 20)))
    held |= {i for i, (s, _, _) in enumerate(rows) if s.kind.endswith("-held-out")}
    state_path = args.workdir / f"state-{args.method}.pt"
    state = torch.load(state_path) if state_path.exists() else None
    if state is not None:
        draft_ids = state["draft_ids"]
    elif args.init_head is not None:
        head_tensors = load_file(str(args.init_head / "model.safetensors"))
        draft_ids = torch.arange(len(head_tensors["d2t"])) + head_tensors["d2t"]
    else:
        counts = torch.bincount(torch.cat([p for i, (_, _, p) in enumerate(rows) if i not in held]), minlength=cfg["vocab_size"])
        draft_ids = counts.argsort(descending=True, stable=True)[: args.draft_vocab].sort().values
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(len(draft_ids))

    # Example: next ids (x[q+1]), labels (vocabulary id of the target's argmax at q+1), the
    # features at q and, for EAGLE-1, the state at q + 1 it regresses to.
    def example(s: Sequence, f: torch.Tensor, p: torch.Tensor):
        return torch.tensor(s.ids)[1:], to_draft[p[1:]], f[:-1], None if args.method == "eagle3" else f[1:]

    train = [example(*row) for i, row in enumerate(rows) if i not in held]
    evals: dict[str, list] = {}
    for i in sorted(held):
        s, f, p = rows[i]
        ids, lab, feat, reg = example(s, f, p)
        lab = lab.clone().index_fill_(0, torch.arange(max(s.scored_from - 2, 0)), -100)
        evals.setdefault(s.kind.removesuffix("-held-out"), []).append((ids, lab, feat, reg))
    del rows
    coverage = torch.cat([ex[1] for ex in train]).ge(0).float().mean().item()
    print(f"draft vocabulary {len(draft_ids)}: {coverage:.3f} of the target's predictions; held-out sequences: "
          + ", ".join(f"{kind} {len(v)}" for kind, v in sorted(evals.items())), flush=True)

    cfg_head = dict(cfg, intermediate_size=args.intermediate_size)
    model: DraftHead
    if args.method == "eagle3":
        model = Eagle3Head(cfg_head, embed, len(draft_ids))
        with torch.no_grad():
            model.lm_head.weight.copy_(embed[draft_ids])
            model.norm.weight.copy_(final_norm)
    else:
        model = EagleHead(cfg_head, embed, embed[draft_ids])  # the LM head is tied
    with torch.no_grad():
        for lin in (model.q_proj, model.k_proj, model.v_proj, model.o_proj, model.gate_proj, model.up_proj, model.down_proj, model.fc):
            nn.init.normal_(lin.weight, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    done = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = state["done"]
        print(f"resumed at step {done} of {args.total_steps}", flush=True)
    elif args.init_head is not None:
        model.load_checkpoint(head_tensors)
        if args.method == "eagle":
            model.lm_rows = head_tensors["lm_head.weight"].float()
        print(f"held-out top-1 per step of {args.init_head}: {evaluate(model, evals, args.batch_tokens, args.ttt_steps, rng)}",
              flush=True)

    def save() -> None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "done": done, "draft_ids": draft_ids}, state_path)
        save_head(args.out, model, cfg_head, draft_ids)

    weights = [0.8**j for j in range(args.ttt_steps)]
    budget, warmup, saved = 60 * args.train_minutes, 30, 0.0
    t_train = time.perf_counter()
    while done < args.total_steps and time.perf_counter() - t_train < budget:
        for group in batches(train, args.batch_tokens, rng):
            elapsed = time.perf_counter() - t_train
            if elapsed >= budget or done >= args.total_steps:
                break
            if elapsed - saved >= 60 * args.save_minutes:
                save()
                saved = elapsed
            lr = args.lr * min(1.0, (done + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done / args.total_steps)))
            for g in opt.param_groups:
                g["lr"] = lr
            losses = step_losses(model, *collate(train, group), args.ttt_steps)
            loss = sum(w * step_loss for w, (step_loss, _) in zip(weights, losses))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            done += 1
            if done % 20 == 0:
                accs = " ".join(f"{a.item():.3f}" for _, a in losses)
                print(f"step {done} lr {lr:.2e} loss {loss.item():.3f} acc/step {accs} ({elapsed:.0f} s)", flush=True)
    save()
    print(f"trained to step {done} of {args.total_steps} ({time.perf_counter() - t_train:.0f} s this run)", flush=True)
    result = evaluate(model, evals, args.batch_tokens, args.ttt_steps, rng)
    (args.workdir / f"eval-{args.method}.json").write_text(json.dumps({"step": done, "top1": result}, indent=1) + "\n")
    print(f"held-out top-1 per step: {result}", flush=True)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s total", flush=True)


def save_head(out: Path, model: DraftHead, cfg: dict, draft_ids: torch.Tensor) -> None:
    """Write ``model`` (float16) and its ``config.json`` (the target's ``cfg`` as the head's)
    in its authors' layout. ``draft_ids``, the sorted target ids of the draft vocabulary (for
    EAGLE-1 the training vocabulary, whose rows of the target's LM head it then carries as its
    own), become ``d2t``/``t2d`` when they are fewer than the target's."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = model.checkpoint()
    head_cfg = {k: v for k, v in cfg.items() if k != "torch_dtype"}
    head_cfg |= {"num_hidden_layers": 1, "torch_dtype": "float16"}
    eagle3 = isinstance(model, Eagle3Head)
    head_cfg["architectures"] = ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"]
    if len(draft_ids) < cfg["vocab_size"]:
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[draft_ids] = True
        tensors |= {"d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}
        if not eagle3:
            tensors["lm_head.weight"] = model.lm_rows.half().contiguous()
        head_cfg["draft_vocab_size"] = len(draft_ids)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2) + "\n")

if __name__ == "__main__":
    main()
