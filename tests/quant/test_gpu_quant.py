"""FP8 weights on FP8 tensor cores (``torch._scaled_mm``, compute capability 8.9+) against
dequantize-then-matmul; other GPUs take the dequantizing path."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.fp8 import has_fp8_tensor_cores, quantize_fp8, scaled_mm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 5, 48])
def test_fp8_scaled_mm_matches_dequantized_matmul(rows):
    device = torch.device("cuda")
    if not has_fp8_tensor_cores(device):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9 or later)")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 256, generator=gen)
    x = torch.randn(rows, 256, generator=gen).to(device, torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(device, torch.bfloat16)
    q, scale = quantize_fp8(w)
    q, scale = q.to(device), scale.to(device)
    ours = scaled_mm(x, q, scale, bias).float()
    ref = x.float() @ (q.float() * scale[:, None]).T + bias.float()
    assert ours.shape == ref.shape
    assert ((ours - ref).norm() / ref.norm()).item() < 5e-2
