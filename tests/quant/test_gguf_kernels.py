"""The GGUF block kernels and the gguf linear method against a dequantize-then-matmul reference
(the ``gguf`` package's dequantizer and a float64 torch matmul): with float32 activations
(``TOKENMILL_GGUF_FLOAT_ACTIVATIONS=1``) on the activations as given, by default on the
activations rounded to int8 blocks as llama.cpp rounds them."""

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


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] with each block of 32 rounded to int8 codes times ``max|block| / 127``."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).view_as(x)


@pytest.fixture(params=["q8", "float32"])
def activations(request, monkeypatch) -> str:
    """Each product: activations quantized to int8 blocks (the default) or float32."""
    monkeypatch.setenv("TOKENMILL_GGUF_FLOAT_ACTIVATIONS", str(int(request.param == "float32")))
    return request.param


def activation_reference(activations: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return reference(q8_rounded(x) if activations == "q8" else x, w)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 576), (130, 1536)])
def test_dequantize_equals_gguf(qtype, n, k):
    q, w = blocks(n, k, qtype, seed=n + k)
    out = gguf_method.dequantize(qtype, q, n, k)
    torch.testing.assert_close(out, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (67, 576), (193, 1536)])
def test_matmul_equals_dequantized_reference(activations, qtype, t, n, k):
    q, w = blocks(n, k, qtype, seed=3 * n + k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    x[0, :32] = 0  # a zero block: scale 0, codes 0
    y = gguf_method.matmul(qtype, q, x, n)
    torch.testing.assert_close(y, activation_reference(activations, x, w), atol=2e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("sign", [1, -1])
def test_q8_extreme_codes_do_not_saturate(activations, sign):
    """Q8_0 codes -128 and 127 against activation codes of +-127: the int16 pair sums of the
    integer product are at their largest."""
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    codes = np.array([-128, 127] * 16, dtype=np.int8).view(np.uint8)
    q = torch.from_numpy(np.tile(np.concatenate([d, codes]), (3, 2)))
    w = torch.from_numpy(dequantize(q.numpy(), Q.Q8_0).astype(np.float32))
    x = sign * torch.tensor([[-1.0, 1.0] * 32])
    y = gguf_method.matmul(Q.Q8_0, q, x, 3)
    torch.testing.assert_close(y, activation_reference(activations, x, w))
    assert y[0, 0].item() == sign * 0.5 * 255 * 32


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
def test_fused_layer_keeps_blocks_and_matches(activations, rows):
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
    w = torch.cat([w0, w1])
    expected = activation_reference(activations, x.view(-1, 96), w) if 2 * rows <= gguf_method.GEMV_MAX_ROWS else reference(x, w)
    torch.testing.assert_close(out.view(-1, 64), expected.view(-1, 64), atol=1e-3, rtol=1e-4)


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
