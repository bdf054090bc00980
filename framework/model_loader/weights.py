"""Iterating the tensors of a HF safetensors checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_CONVERTIBLE = (torch.float16, torch.bfloat16, torch.float32)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those the sharded index names, else ``model.safetensors``, else
    every ``*.safetensors`` in the directory."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return files


def iter_weights(
    model_dir: str | Path, dtype: torch.dtype | None = None, use_tqdm: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one at a time, on the CPU.

    With ``dtype``, 16/32-bit float tensors are converted as they are read; other dtypes
    (integer or fp8 quantized weights) are left as stored. ``use_tqdm`` shows a progress bar
    over the tensors on stderr.
    """
    with ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for path in safetensors_files(model_dir)
        ]
        total = sum(len(f.keys()) for f in files)
        with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not use_tqdm) as bar:
            for f in files:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    if dtype is not None and tensor.dtype in _CONVERTIBLE:
                        tensor = tensor.to(dtype)
                    yield name, tensor
                    bar.update(1)


def find_param(
    model: torch.nn.Module, params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor
) -> torch.nn.Parameter | None:
    """``params[name]`` (``model``'s named parameters) for the checkpoint weight ``name``
    (``tensor``). None, for the caller to skip it, when it is an all-zero ``.bias`` the model
    does not have: GPTQ checkpoints store such placeholders for bias-free layers (vLLM skips
    them too). Any other weight without a parameter raises ``ValueError`` naming it."""
    param = params.get(name)
    if param is not None:
        return param
    if name.endswith(".bias") and not torch.count_nonzero(tensor):
        return None
    nonzero = " (a bias with non-zero values)" if name.endswith(".bias") else ""
    raise ValueError(
        f"checkpoint weight {name!r}{nonzero} has no matching parameter in {type(model).__name__}"
    )


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, name: str = "the parameter"
) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape; a mismatch raises
    ``ValueError`` naming the parameter (``name``)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"parameter has {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)
