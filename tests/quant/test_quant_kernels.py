"""The quantized-weight C kernels (and the float32 one that shares their tiles) against torch's
dequantize-then-matmul, on random shapes with odd sizes; the layouts' pack/unpack and
quantizers."""

from __future__ import annotations

import pytest
import torch

from tokenmill.ops import cpu as cpu_ops
from tokenmill.ops import cpu_quant
from tokenmill.quant.fp8 import FP8, quantize_fp8
from tokenmill.quant.int4 import pack, quantize_int4, unpack
from tokenmill.quant.int8 import pack_panels, quantize_int8, unpack_panels

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")

SHAPES = [(1, 7, 64), (1, 96, 160), (2, 33, 96), (3, 130, 224), (4, 5, 32), (5, 64, 128), (17, 41, 256), (40, 9, 64)]
"""(rows M, outputs N, inputs K); K a multiple of 32 for int4."""
ODD_K = [(1, 13, 45), (3, 7, 103), (6, 29, 9)]
"""int8 and FP8 take any K."""


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_kernel_equals_dequantized_matmul(m, n, k, with_bias):
    x, w, bias = _inputs(m, n, k, m * n + k)
    bias = bias if with_bias else None
    q, scale = quantize_int8(w)
    deq = q.float() * scale[:, None]
    close(cpu_quant.int8_linear(x, q, scale, bias), torch.nn.functional.linear(x, deq, bias))
    assert torch.equal(cpu_quant.int8_dequantize(q, scale), deq)


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_kernel_equals_linear(m, n, k, with_bias):
    x, w, bias = _inputs(m, n, k, m + n * k)
    bias = bias if with_bias else None
    wide = torch.randn(m, k + 11)
    wide[:, 3 : 3 + k] = x
    ref = torch.nn.functional.linear(x, w, bias)
    close(cpu_quant.f32_linear(x, w, bias), ref)
    close(cpu_quant.f32_linear(wide[:, 3 : 3 + k], w, bias), ref)


def test_int8_kernel_takes_strided_rows():
    x, w, bias = _inputs(3, 24, 64, 1)
    wide = torch.randn(3, 100)
    wide[:, 10:74] = x
    q, scale = quantize_int8(w)
    close(cpu_quant.int8_linear(wide[:, 10:74], q, scale, bias), cpu_quant.int8_linear(x, q, scale, bias))


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
def test_w8a8_kernel_equals_integer_reference(m, n, k):
    x, w, bias = _inputs(m, n, k, 7 * m + n)
    q, scale = quantize_int8(w)
    xq, xscale = cpu_quant.quantize_rows_int8(x, k + 3)
    ref_q, ref_scale = quantize_int8(x)
    assert torch.equal(xq[:, :k], ref_q) and not xq[:, k:].any() and torch.equal(xscale, ref_scale)
    panels = pack_panels(q)
    assert torch.equal(unpack_panels(panels, n, k), q)
    ref = (ref_q.double() @ q.double().T).float() * (xscale[:, None] * scale) + bias
    close(cpu_quant.w8a8_linear(x, panels, scale, bias), ref)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_equals_dequantized_matmul(m, n, k, group):
    if k % group:
        group = 32
    x, w, bias = _inputs(m, n, k, m + n * k)
    p = quantize_int4(w, group)
    q = unpack(p["weight_packed"]).float().view(n, k // group, group)
    deq = (q * p["weight_scale"][..., None] + p["weight_min"][..., None]).view(n, k)
    close(cpu_quant.int4_linear(x, p["weight_packed"], p["weight_scale"], p["weight_min"], bias), x @ deq.T + bias)
    close(cpu_quant.int4_dequantize(p["weight_packed"], p["weight_scale"], p["weight_min"]), deq)


def test_int4_pack_round_trips_and_quantizes_within_half_a_step():
    codes = torch.randint(0, 16, (6, 96), dtype=torch.uint8)
    packed = pack(codes)
    assert packed.shape == (6, 48) and torch.equal(unpack(packed), codes)
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 16] << 4))  # column j and j + 16
    w = torch.randn(8, 64)
    p = quantize_int4(w, 32)
    deq = unpack(p["weight_packed"]).float().view(8, 2, 32) * p["weight_scale"][..., None] + p["weight_min"][..., None]
    assert ((deq.view(8, 64) - w).abs().view(8, 2, 32) <= p["weight_scale"][..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
def test_fp8_kernel_equals_dequantized_matmul(m, n, k):
    x, w, bias = _inputs(m, n, k, 3 * m + k)
    q, scale = quantize_fp8(w)
    deq = q.float() * scale[:, None]
    close(cpu_quant.fp8_linear(x, q, scale, bias), x @ deq.T + bias)
    assert torch.equal(cpu_quant.fp8_dequantize(q, scale), deq)


def test_fp8_decoding_is_exact_for_every_code():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = codes.view(FP8).view(1, -1).repeat(3, 1)
    # 254 codes: 31 vector blocks of 8 and a scalar tail of 6
    assert torch.equal(cpu_quant.fp8_dequantize(w, torch.ones(3)), w.float())
