"""The quantized-weight CPU kernels (``csrc/quant_int.c``, ``csrc/quant_fp8.c``): linear layers
on int8, group-wise int4 and FP8 (e4m3fn) weights, the matching dequantizers, and W8A8's
dynamic per-row activation quantizer; and, by the same register tiles, the float32 product of a
few input rows (decode) that reads each weight once.

Inputs ``x`` are 2-D float32 CPU tensors with contiguous rows (any row stride); weights and
their scales are contiguous, as the quantization methods in ``tokenmill.quant`` store them.
Callers check :func:`tokenmill.ops.cpu.supports` first.
"""

from __future__ import annotations

import torch

from tokenmill.ops.cpu import load


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(kernel: str, x: torch.Tensor, n: int, *args: int | None, extra: tuple[int, ...] = ()) -> torch.Tensor:
    """The [M, n] output of the C ``kernel``, called as ``kernel(out, *args, M, n, K, *extra)`` for
    ``x`` [M, K]."""
    m, k = x.shape
    out = x.new_empty(m, n)
    getattr(load(), kernel)(out.data_ptr(), *args, m, n, k, *extra)
    return out


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for int8 ``weight`` [N, K], float ``scale`` [N]."""
    return _linear(
        "int8_linear", x, weight.shape[0], x.data_ptr(), x.stride(0), weight.data_ptr(), scale.data_ptr(), _ptr(bias)
    )


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a contiguous float32 ``weight`` [N, K], each weight read once
    (a few rows: decode)."""
    return _linear("f32_linear", x, weight.shape[0], x.data_ptr(), x.stride(0), weight.data_ptr(), _ptr(bias))


def _out(out: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    if out is None:
        return torch.empty(n, k)
    assert out.shape == (n, k) and out.dtype == torch.float32 and out.is_contiguous()
    return out


def int8_dequantize(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * scale[:, None]`` as float32 [N, K] (into ``out`` when given)."""
    n, k = weight.shape
    out = _out(out, n, k)
    load().int8_dequantize(out.data_ptr(), weight.data_ptr(), scale.data_ptr(), n, k)
    return out


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a group-wise int4 weight: ``packed`` uint8 [N, K/2] (see
    ``tokenmill.quant.int4.pack``), ``scale`` and ``minimum`` float [N, K/group]."""
    return _linear(
        "int4_linear", x, packed.shape[0], x.data_ptr(), x.stride(0), packed.data_ptr(), scale.data_ptr(),
        minimum.data_ptr(), _ptr(bias), extra=(x.shape[1] // scale.shape[1],),
    )


def int4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight [N, K] of a group-wise int4 one (into ``out`` when given)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = _out(out, n, k)
    load().int4_dequantize(
        out.data_ptr(), packed.data_ptr(), scale.data_ptr(), minimum.data_ptr(), n, k,
        k // scale.shape[1],
    )
    return out


def quantize_rows_int8(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes of ``x`` [M, K] in [-127, 127] and their scales [M]
    (``max|row| / 127``; 1 for a zero row); rows of ``width`` >= K codes, zero past K."""
    m, k = x.shape
    width = k if width is None else width
    q = torch.empty(m, width, dtype=torch.int8)
    scale = torch.empty(m)
    load().quantize_rows_int8(
        q.data_ptr(), width, scale.data_ptr(), x.data_ptr(), x.stride(0), m, k
    )
    return q, scale


def w8a8_linear(
    x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` quantized per row to int8, times the int8 weight [N, K] in int32, rescaled by both
    scales, plus ``bias``; the weight in ``tokenmill.quant.int8.pack_panels``'s layout, N =
    ``scale``'s length."""
    n, k = scale.shape[0], x.shape[1]
    k4 = -(-k // 4)
    if panels.numel() != -(-n // 16) * 16 * k4 * 4:
        raise ValueError(f"int8 panels of {panels.numel()} bytes do not hold a [{n}, {k}] weight")
    xq, xscale = quantize_rows_int8(x, 4 * k4)
    return _linear(
        "w8a8_linear", x, n, xq.data_ptr(), xscale.data_ptr(), panels.data_ptr(), scale.data_ptr(), _ptr(bias)
    )


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (weight.float() * scale[:, None]).T + bias`` for float8_e4m3fn ``weight`` [N, K]."""
    return _linear(
        "fp8_linear", x, weight.shape[0], x.data_ptr(), x.stride(0), weight.data_ptr(), scale.data_ptr(), _ptr(bias)
    )


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight.float() * scale[:, None]`` as float32 [N, K] (into ``out`` when given)."""
    n, k = weight.shape
    out = _out(out, n, k)
    load().fp8_dequantize(out.data_ptr(), weight.data_ptr(), scale.data_ptr(), n, k)
    return out
