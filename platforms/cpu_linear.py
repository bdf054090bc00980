"""Unquantized linear layers on the CPU through oneDNN, with weights packed once at load time
(as vLLM's CPU ``dispatch_cpu_unquantized_gemm``).

oneDNN reorders a float32 weight into its blocked layout for this CPU's instruction set
(``ONEDNN_MAX_CPU_ISA`` caps it) once, so each step's GEMM skips the packing a plain
``F.linear`` does on every call; the product is float32 throughout, as ``F.linear``'s, up to
the order of the sums. On 2 cores of an AMD EPYC held to AVX2 it ran the model's GEMMs 5-10%
faster than ``F.linear`` (MKL), and the 49152-row LM head at 64 rows 1.6x faster
(``benchmarks/gemm.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.ops import cpu as cpu_ops
from tokenmill.ops import cpu_quant


def onednn_usable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can take this weight: float32, on the CPU, torch built with oneDNN."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout for this CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + b`` with ``packed`` from :func:`onednn_pack`; ``x`` float32."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _stream_max_rows() -> int:
    """Input rows up to which the C kernel (``cpu_quant.f32_linear``) multiplies instead of
    oneDNN: 64 (a decode step of up to 64 requests, or a speculative verification of 16
    requests' 3 drafts and their tokens), but 4 where torch runs AVX-512 kernels, whose oneDNN
    GEMM takes over from 6 rows. Up to there a step stays C calls only, so it can be a CPU decode
    graph (``platforms/cpu_graph.py``). The default model's 30 layers of float32 products (424
    MB), 2 threads of an AMD EPYC (Zen 4), best of 5, C kernel vs oneDNN (``python
    benchmarks/decode_kernels.py --threads 2 --rows 1,16,24,32,48,64,96 --repeats 5``): held to
    AVX2, 1, 16, 24, 32, 48, 64, 96 rows 12.0 / 13.7, 21.9 / 24.5, 28.8 / 30.3, 36.2 / 37.4,
    49.7 / 53.4, 64.2 / 63.7, 101.6 / 98.4 ms; with AVX-512, 1, 4, 5, 8, 16 rows 11.8 / 10.8,
    11.1 / 11.1, 11.9 / 9.9, 14.9 / 13.3, 24.0 / 14.7 ms."""
    return 4 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 64


STREAM_MAX_ROWS = _stream_max_rows()


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """``x @ W.T + b`` by oneDNN on a packed copy of ``layer.weight`` made after loading;
    ``F.linear`` before that, for weights oneDNN does not take and for inputs not float32.
    Up to ``STREAM_MAX_ROWS`` rows (decode) the C kernel streams ``layer.weight`` instead: a
    product that reads each weight once is bound by memory bandwidth, which oneDNN's GEMV
    reaches less of, and a decode forward of C calls only can be a CPU decode graph."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        self.packed = onednn_pack(weight) if onednn_usable(weight) else None
        bias = getattr(layer, "bias", None)
        self.streamable = weight.is_contiguous() and cpu_ops.supports(weight, bias)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None or x.dtype != torch.float32 or x.shape[-1] != self.packed.shape[1]:
            return F.linear(x, layer.weight, bias)
        if x.dim() == 2 and x.shape[0] <= STREAM_MAX_ROWS and self.streamable and x.stride(1) == 1:
            return cpu_quant.f32_linear(x, layer.weight, bias)
        return onednn_linear(x, self.packed, bias)
