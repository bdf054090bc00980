"""The GGUF block kernels and the gguf linear method against a dequantize-then-matmul reference
(the ``gguf`` package's dequantizer and a float64 torch matmul)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tokenmill.ops import cpu as cpu_ops
from tokenmill.quant import gguf as gguf_method

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.fixture(autouse=True)
def kernels():
    assert cpu_ops.load() is not None, "the C kernels should build on this machine"


def blocks(n: int, k: int, qtype: Q, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized to ``qtype`` ([n, bytes per row] uint8) and their dequantized
    float32 values; some rows are all positive so Q4_1's offsets are large."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[::3] = np.abs(w[::3]) + 0.5
    q = quantize(w, qtype)
    return torch.from_numpy(q), torch.from_numpy(dequantize(q, qtype).astype(np.float32))


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 576), (130, 1536)])
def test_dequantize_equals_gguf(qtype, n, k):
    q, w = blocks(n, k, qtype, seed=n + k)
    out = gguf_method.dequantize(qtype, q, n, k)
    torch.testing.assert_close(out, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (67, 576), (193, 1536)])
def test_matmul_equals_dequantized_reference(qtype, t, n, k):
    q, w = blocks(n, k, qtype, seed=3 * n + k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    y = gguf_method.matmul(qtype, q, x, n)
    torch.testing.assert_close(y, reference(x, w), atol=2e-4 * k**0.5, rtol=1e-4)


def build(layer_cls, *args, **kwargs):
    with model_build_context(BuildContext(TorchRefBackend, quant_method=gguf_method.GGUFConfig())):
        return layer_cls(*args, **kwargs)


def load(layer, shards: dict) -> None:
    """Hand ``layer`` its shards as the GGUF iterator names them, then finish loading."""
    for shard_id, (qtype, q) in shards.items():
        for name, value in (("qweight_type", torch.tensor(int(qtype))), ("qweight", q)):
            param = getattr(layer, name)
            param.weight_loader(param, value, *([] if shard_id is None else [shard_id]))
    layer.linear_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_fused_layer_keeps_blocks_and_matches(rows):
    """Decode-sized batches take the block kernel, larger ones the dequantized GEMM; both equal
    the reference on the fused gate/up rows."""
    layer = build(MergedColumnParallelLinear, 96, [40, 24], bias=False, prefix="mlp.gate_up_proj")
    (q0, w0), (q1, w1) = blocks(40, 96, Q.Q4_1, 1), blocks(24, 96, Q.Q4_1, 2)
    load(layer, {1: (Q.Q4_1, q1), 0: (Q.Q4_1, q0)})
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 60)
    assert int(layer.qweight_type) == Q.Q4_1 and layer.linear_method.dense is None
    x = torch.randn(2, rows, 96)
    out = layer(x)
    assert out.shape == (2, rows, 64)
    torch.testing.assert_close(out, reference(x, torch.cat([w0, w1])), atol=1e-3, rtol=1e-4)


def test_mixed_or_unsupported_types_are_dequantized_once(caplog):
    layer = build(QKVParallelLinear, 64, 16, 2, 1, bias=False, prefix="attn.qkv_proj")
    (qq, wq), (qk, wk) = blocks(32, 64, Q.Q8_0, 3), blocks(16, 64, Q.Q4_0, 4)
    wv = torch.randn(16, 64).half()
    with caplog.at_level("INFO", logger="tokenmill"):
        load(layer, {"q": (Q.Q8_0, qq), "k": (Q.Q4_0, qk), "v": (Q.F16, wv.view(torch.uint8))})
    assert "attn.qkv_proj: GGUF Q8_0/Q4_0/F16 weights dequantized to float32 at load" in caplog.text
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), reference(x, torch.cat([wq, wk, wv.float()])), atol=1e-4, rtol=1e-4)


def test_rows_of_the_wrong_width_are_refused():
    layer = build(MergedColumnParallelLinear, 96, [7, 7], bias=False, prefix="mlp.gate_up_proj")
    q, _ = blocks(7, 64, Q.Q8_0, 5)
    with pytest.raises(ValueError, match="mlp.gate_up_proj: GGUF Q8_0 rows do not hold 96 weights"):
        load(layer, {0: (Q.Q8_0, q), 1: (Q.Q8_0, q)})
