"""Checkpoints in the compressed-tensors format (llm-compressor's, ``quant_method:
compressed-tensors``) whose linear layers hold FP8 weights with per-tensor or per-channel
scales (``weight``, ``weight_scale``) and dynamic or no activation quantization; layers named in
``ignore`` stay unquantized. Other schemes are refused, naming what they ask for."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod
from tokenmill.quant.fp8 import SerializedFp8LinearMethod, check_fp8_checkpoint


def _ignored(prefix: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], prefix):
                return True
        elif prefix == entry or prefix.endswith("." + entry):
            return True
    return False


class CompressedTensorsConfig(QuantizationMethod):
    """A compressed-tensors checkpoint of FP8 weights (``quant_method: compressed-tensors``)."""

    tensor_parallel = False

    def __init__(self, ignore: list[str]) -> None:
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(
                f"compressed-tensors: {len(groups)} config groups; one group of FP8 weights is supported"
            )
        weights = groups[0].get("weights") or {}
        scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if scheme[:2] != ("float", 8) or scheme[2] not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors: weights of type {scheme[0]!r}, {scheme[1]} bits, strategy "
                f"{scheme[2]!r} are not supported; 8-bit float weights per tensor or channel are"
            )
        activations = groups[0].get("input_activations")
        check_fp8_checkpoint(
            "compressed-tensors",
            static_activations=bool(activations) and not activations.get("dynamic", False),
            blocks=weights.get("block_structure"),
        )
        return cls(list(config.get("ignore") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None if _ignored(prefix, self.ignore) else SerializedFp8LinearMethod()
