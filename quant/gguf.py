"""The ``gguf`` method: linear layers and the LM head keep a GGUF file's quantized blocks as
stored and multiply with them directly (``LLM(model="file.gguf")``, or the default model with
``quantization="gguf"``).

Q4_0, Q4_1 and Q8_0 weights stay blocks in memory. Up to :data:`GEMV_MAX_ROWS` activation rows
(decode) go through a C kernel: by default llama.cpp's product, each activation row quantized to
int8 blocks of 32 (a float scale each) and every block pair's dot product summed in int32; with
``TOKENMILL_GGUF_FLOAT_ACTIVATIONS=1`` one that widens each weight block to float32 in registers
and multiplies the float32 activations (the float product with the dequantized weights). More
rows (prefill) dequantize the matrix into a reused float32 buffer and run one float GEMM.
Weights stored as F32/F16, of another GGUF type, or of mixed types within one fused layer are
dequantized to float32 once at load (logged). The token embedding is dequantized to float32 once
at load; the LM head multiplies with its blocks.

The GGUF weight iterator (``tokenmill.model_loader.gguf_file``) hands each linear weight over as
two checkpoint entries, ``<layer>.qweight_type`` (the GGML type) and ``<layer>.qweight``
([rows, bytes per row] uint8), the names vLLM's GGUF loader uses.
"""

from __future__ import annotations

import logging
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs
from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod
from tokenmill.ops import cpu as cpu_ops
from tokenmill.quant.base import workspace

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
GEMV_MAX_ROWS = 8
"""Activation rows up to which the blocks are multiplied directly; more are dequantized for a
float GEMM."""

class GGUFConfig(QuantizationMethod):
    """Quantized blocks of a GGUF file in every linear layer and the LM head."""

    tensor_parallel = False

    @classmethod
    def supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32]

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()


class GGUFLinearMethod(LinearMethod):
    """One layer's blocks: ``qweight`` [out, bytes per row] uint8 of type ``qweight_type``, the
    fused shards' rows one after another; ``dense`` instead when they are not kernel types."""

    def __init__(self) -> None:
        self.shards: dict[Any, dict[str, torch.Tensor]] = {}
        self.qtype: Q | None = None
        self.dense: torch.Tensor | None = None

    def create_weights(
        self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        self.input_size = input_size
        self.output_size = sum(output_partition_sizes)
        for name, dtype in (("qweight", torch.uint8), ("qweight_type", torch.int64)):
            param = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            param.weight_loader = self._loader(name)
            layer.register_parameter(name, param)

    def _loader(self, name: str):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            self.shards.setdefault(shard_id, {})[name] = loaded

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qweight.device.type != "cpu":
            raise ValueError(f"{layer.prefix}: the gguf method runs on the CPU platform only")
        order = sorted(self.shards, key=lambda s: "qkv".index(s) if isinstance(s, str) else s or 0)
        parts = [self.shards[s] for s in order]
        if any(set(p) != {"qweight", "qweight_type"} for p in parts):
            raise ValueError(f"{layer.prefix}: a GGUF weight came without its qweight_type or data")
        types = {Q(int(p["qweight_type"])) for p in parts}
        rows = sum(p["qweight"].shape[0] for p in parts)
        if rows != self.output_size:
            raise ValueError(f"{layer.prefix}: GGUF weights have {rows} rows, the layer {self.output_size}")
        qtype = types.pop() if len(types) == 1 else None
        if qtype in KERNEL_TYPES and cpu_ops.load() is not None:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if any(p["qweight"].shape[1] * block != self.input_size * size for p in parts):
                raise ValueError(f"{layer.prefix}: GGUF {qtype.name} rows do not hold {self.input_size} weights")
            qweight = parts[0]["qweight"] if len(parts) == 1 else torch.cat([p["qweight"] for p in parts])
            layer.qweight.data = qweight.contiguous()
            layer.qweight_type.data = torch.tensor(int(qtype))
            self.qtype, self.qtype_id, self.row_bytes = qtype, int(qtype), layer.qweight.shape[1]
            self.kernel_name = kernel_name()
        else:
            logger.info(
                "%s: GGUF %s weights dequantized to float32 at load",
                layer.prefix,
                "/".join(Q(int(p["qweight_type"])).name for p in parts),
            )
            self.dense = torch.cat([_dequantize_numpy(p) for p in parts])
            if self.dense.shape[1] != self.input_size:
                raise ValueError(f"{layer.prefix}: GGUF rows hold {self.dense.shape[1]} weights, expected {self.input_size}")
        self.shards.clear()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dense is not None:
            return F.linear(x, self.dense, bias)
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            # The decode path, once per layer per step: the kernel called with as little
            # Python around it as possible.
            t = x.shape[0]
            x = x.contiguous()
            y = x.new_empty(t, self.output_size)
            getattr(cpu_ops.load(), self.kernel_name)(
                self.qtype_id, layer.qweight.data_ptr(), self.row_bytes, x.data_ptr(), t,
                self.input_size, y.data_ptr(), self.output_size,
            )
            return y if bias is None else y.add_(bias)
        x2 = x.reshape(-1, self.input_size)
        if x2.shape[0] <= GEMV_MAX_ROWS:
            y = self.apply(layer, x2, bias)
        else:
            y = F.linear(x2, dequantize(self.qtype, layer.qweight, self.output_size, self.input_size), bias)
        return y.reshape(*x.shape[:-1], self.output_size)


def _dequantize_numpy(part: dict[str, torch.Tensor]) -> torch.Tensor:
    w = gguf.quants.dequantize(part["qweight"].numpy(), Q(int(part["qweight_type"])))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def kernel_name() -> str:
    """The C product of GGUF blocks and float32 input rows: ``gguf_matmul`` (float32
    activations) when ``TOKENMILL_GGUF_FLOAT_ACTIVATIONS`` is set, else ``gguf_matmul_q8``
    (activations rounded to int8 blocks)."""
    return "gguf_matmul" if envs.TOKENMILL_GGUF_FLOAT_ACTIVATIONS else "gguf_matmul_q8"


def matmul(qtype: Q, qweight: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [T, K] (contiguous float32) times the transposed [n, K] weights of ``qweight``, by
    the C :func:`kernel`."""
    t, k = x.shape
    y = x.new_empty(t, n)
    getattr(cpu_ops.load(), kernel_name())(
        int(qtype), qweight.data_ptr(), qweight.shape[1], x.data_ptr(), t, k, y.data_ptr(), n
    )
    return y


def dequantize(qtype: Q, qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] float32 weights of ``qweight``, in the thread's :func:`workspace`, reused by
    the next call."""
    out = workspace(n, k)
    cpu_ops.load().gguf_dequantize(
        int(qtype), qweight.data_ptr(), qweight.shape[1], n, k, out.data_ptr()
    )
    return out
