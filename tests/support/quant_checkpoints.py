"""Quantized variants of a tiny float checkpoint, written as GPTQ, AWQ and FP8 checkpoints store
them (``tests/quant/`` and the docs' quantization example load them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(values: np.ndarray) -> np.ndarray:
    """GPTQ's qweight packing: eight 4-bit rows per int32 row, row ``8i + j`` at bits ``4j``."""
    out = np.zeros((values.shape[0] // 8, values.shape[1]), dtype=np.uint32)
    for j in range(8):
        out |= values[j::8].astype(np.uint32) << (4 * j)
    return out.view(np.int32)


def pack_columns(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """Eight 4-bit columns per int32: nibble ``i`` holds column ``8c + order[i]``."""
    out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        out |= values[:, order[i]::8].astype(np.uint32) << (4 * i)
    return out.view(np.int32)


def quantized_variant(src: Path, dst: Path, fmt: str, ref: Path) -> None:
    """Write ``dst``: ``src`` with its linear weights replaced by random int4 codes (``fmt``
    gptq or awq) or FP8 values, and ``ref``: a float checkpoint of the dequantized weights."""
    shutil.copytree(src, dst)
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    quant, floats = {}, {}
    gen = torch.Generator().manual_seed(1)
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in LINEARS):
            quant[name] = floats[name] = w
            continue
        base = name.removesuffix(".weight")
        n, k = w.shape
        if fmt == "fp8":
            scale = w.abs().amax() / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            quant[name], quant[f"{base}.weight_scale"] = q, scale.reshape(1)
            floats[name] = q.float() * scale
            continue
        codes = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(1, 16, (k // GROUP, n), generator=gen)
        scales = (torch.rand(k // GROUP, n, generator=gen) * 0.02 + 0.01).half()
        groups = torch.arange(k) // GROUP
        floats[name] = ((codes - zeros[groups]) * scales.float()[groups]).T.contiguous()
        if fmt == "gptq":
            quant[f"{base}.qweight"] = torch.from_numpy(pack_rows(codes.numpy()))
            quant[f"{base}.qzeros"] = torch.from_numpy(pack_columns((zeros - 1).numpy()))
            quant[f"{base}.g_idx"] = groups.to(torch.int32)
        else:
            quant[f"{base}.qweight"] = torch.from_numpy(pack_columns(codes.numpy(), AWQ_ORDER))
            quant[f"{base}.qzeros"] = torch.from_numpy(pack_columns(zeros.numpy(), AWQ_ORDER))
        quant[f"{base}.scales"] = scales
    save_file(quant, str(dst / "model.safetensors"))
    save_file(floats, str(ref / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    }[fmt]
    (dst / "config.json").write_text(json.dumps(config))
