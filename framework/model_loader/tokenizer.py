"""Loading a checkpoint's tokenizer."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    """The HF fast tokenizer in ``path``, or None when the directory has none."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    return AutoTokenizer.from_pretrained(path)
