"""Reading llama.cpp GGUF files: the HF config and tokenizer from the metadata, the tensors under
their HF names.

A GGUF file of the ``llama`` architecture holds everything a model directory does: the
hyper-parameters and the BPE vocabulary in its metadata, the weights as tensors (quantized
blocks or floats). ``GGUFFile.write_hf_metadata`` writes the ``config.json`` and tokenizer
files transformers reads (:func:`metadata_dir` caches them per file); ``GGUFFile.tensors``
gives the tensors under the HF names the Llama model loads, with llama.cpp's rotary row
permutation of ``attn_q`` / ``attn_k`` undone (a permutation of whole rows, so it applies to
quantized rows of blocks as it does to floats); :func:`iter_gguf_weights` turns them into the
checkpoint entries of the ``gguf`` quantization method.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

GGUF_MAGIC = b"GGUF"
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
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class GGUFTensor:
    """One tensor under its HF name: ``data`` is [rows, bytes per row] uint8 blocks for a
    quantized type, else the float array as stored; ``shape`` is (rows, columns)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]

    def dequantize(self) -> np.ndarray:
        """The tensor as contiguous float32."""
        w = np.ascontiguousarray(gguf.quants.dequantize(self.data, self.tensor_type), dtype=np.float32)
        return w if w.flags.writeable else w.copy()  # F32 tensors are views of the read-only file


class GGUFFile:
    """A GGUF file of the ``llama`` architecture, memory-mapped."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        arch = self.meta("general.architecture")
        if arch != "llama":
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; tokenmill reads "
                f"'llama' GGUF files (Llama, SmolLM, Mistral without sliding window)"
            )

    def meta(self, key: str) -> Any:
        return self.reader.fields[key].contents()

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.reader.tensors)

    def hf_config(self) -> dict[str, Any]:
        """The model's ``config.json`` as transformers' Llama config."""
        meta = self.meta
        hidden, n_head = meta("llama.embedding_length"), meta("llama.attention.head_count")
        bos, eos, pad = (self._token_id(k) for k in ("bos", "eos", "padding"))
        rope_theta = float(meta("llama.rope.freq_base"))
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": len(meta("tokenizer.ggml.tokens")),
            "hidden_size": hidden,
            "intermediate_size": meta("llama.feed_forward_length"),
            "num_hidden_layers": meta("llama.block_count"),
            "num_attention_heads": n_head,
            "num_key_value_heads": meta("llama.attention.head_count_kv"),
            "head_dim": hidden // n_head,
            "hidden_act": "silu",
            "max_position_embeddings": meta("llama.context_length"),
            "rms_norm_eps": round(float(meta("llama.attention.layer_norm_rms_epsilon")), 10),
            "rope_theta": rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": "float32",
            "use_cache": True,
        }

    def _token_id(self, kind: str) -> int | None:
        key = f"tokenizer.ggml.{kind}_token_id"
        return self.meta(key) if key in self.reader.fields else None

    def write_hf_metadata(self, out: Path) -> None:
        """Write ``config.json``, ``generation_config.json`` and the tokenizer files into ``out``."""
        config = self.hf_config()
        _write_json(out / "config.json", config)
        ids = {k: config[f"{k}_token_id"] for k in ("bos", "eos", "pad")}
        _write_json(out / "generation_config.json", {f"{k}_token_id": v for k, v in ids.items()})
        _write_tokenizer(self.meta, self._token_id, out)

    def tensors(self, use_tqdm: bool = False, desc: str = "Loading GGUF tensors") -> Iterator[GGUFTensor]:
        """Every tensor under its HF name (``model.layers.0.self_attn.q_proj.weight``, ...),
        ``attn_q`` / ``attn_k`` rows back in HF order."""
        n_head, n_kv = self.meta("llama.attention.head_count"), self.meta("llama.attention.head_count_kv")
        for t in tqdm(self.reader.tensors, desc=desc, unit="tensor", disable=not use_tqdm):
            data = t.data
            if t.name.startswith("blk."):
                _, layer, kind, _ = t.name.split(".")
                if kind in ("attn_q", "attn_k"):
                    data = _unpermute(data, n_head if kind == "attn_q" else n_kv)
                name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}"
            else:
                name = _GLOBAL_TENSORS[t.name.removesuffix(".weight")]
            shape = tuple(int(d) for d in reversed(t.shape))
            yield GGUFTensor(f"{name}.weight", gguf.GGMLQuantizationType(t.tensor_type), data, shape)


def iter_gguf_weights(path: str | os.PathLike, use_tqdm: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint entries of a GGUF file for the ``gguf`` quantization method: each matrix of
    a linear layer or the LM head as ``<layer>.qweight_type`` (its GGML type, a 0-d int64 tensor)
    and ``<layer>.qweight`` (its rows as stored, [rows, bytes per row] uint8); the embedding
    and norms as float32. A file without ``output.weight`` ties the LM head to the embedding:
    ``lm_head`` then gets the embedding's blocks."""
    file = GGUFFile(path)
    tied = not file.has_tensor("output.weight")
    for t in file.tensors(use_tqdm):
        is_embedding = t.name == "model.embed_tokens.weight"
        if len(t.shape) == 2 and not is_embedding:
            yield from _quantized_entries(t.name.removesuffix(".weight"), t)
            continue
        yield t.name, torch.from_numpy(t.dequantize())
        if is_embedding and tied:
            yield from _quantized_entries("lm_head", t)


def _quantized_entries(layer: str, t: GGUFTensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{layer}.qweight_type", torch.tensor(int(t.tensor_type))
    yield f"{layer}.qweight", torch.from_numpy(np.array(t.data.view(np.uint8).reshape(t.shape[0], -1)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k (back to HF layout)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def metadata_dir(path: str | os.PathLike, cache_root: Path) -> str:
    """A directory holding the HF config and tokenizer of the GGUF file ``path`` (no weights),
    written once under ``cache_root/gguf`` and keyed by the file's path, size and mtime.

    It is written into a temporary sibling that is renamed into place when complete."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root / "gguf" / f"{path.stem}-{key}"
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=target.parent))
    try:
        GGUFFile(path).write_hf_metadata(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _write_tokenizer(meta: Callable[[str], Any], token_id: Callable[[str], int | None], out: Path) -> None:
    pre = meta("tokenizer.ggml.pre")
    if meta("tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise ValueError(
            f"GGUF tokenizer {meta('tokenizer.ggml.model')!r}/{pre!r} is not supported; tokenmill "
            f"builds the 'gpt2' BPE tokenizer with the 'smollm' pre-tokenizer"
        )
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

    names = {k: tokens[i] for k in ("bos", "eos", "unknown", "padding") if (i := token_id(k)) is not None}
    special_map = {
        f"{short}_token": names[k]
        for short, k in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if k in names
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
