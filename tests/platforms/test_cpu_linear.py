"""The CPU platform's unquantized linear method: oneDNN on weights packed after loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from tokenmill.layers.vocab_embedding import ParallelLMHead
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cpu_linear import STREAM_MAX_ROWS, OneDNNLinearMethod


def build(make, dtype=torch.float32):
    with model_build_context(BuildContext(TorchRefBackend, dtype, ops=CpuPlatform.get_ops())):
        layer = make()
    for param in layer.parameters():
        param.data.normal_()
    layer.linear_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 301])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(37, 19), (960, 576)])
def test_matches_f_linear(rows, bias, out_features, in_features):
    layer = build(lambda: ReplicatedLinear(in_features, out_features, bias=bias))
    assert isinstance(layer.linear_method, OneDNNLinearMethod)
    assert layer.linear_method.packed is not None
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)


def test_strided_and_batched_inputs():
    layer = build(lambda: ReplicatedLinear(19, 37, bias=True))
    wide = torch.randn(5, 40)[:, 3:22]
    assert not wide.is_contiguous()
    torch.testing.assert_close(layer(wide), F.linear(wide, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    x = torch.randn(2, 3, 19)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)


def test_lm_head_packs_the_tied_weight_after_loading():
    head = build(lambda: ParallelLMHead(101, 24))
    assert isinstance(head.linear_method, OneDNNLinearMethod)
    h = torch.randn(9, 24)
    torch.testing.assert_close(head.compute_logits(h), F.linear(h, head.weight), atol=1e-4, rtol=1e-5)


def test_before_loading_and_for_other_dtypes_it_is_f_linear():
    with model_build_context(BuildContext(TorchRefBackend, ops=CpuPlatform.get_ops())):
        layer = ReplicatedLinear(8, 4, bias=False)
    layer.weight.data.normal_()
    assert layer.linear_method.packed is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))

    half = build(lambda: ReplicatedLinear(8, 4, bias=False), torch.bfloat16)
    assert half.linear_method.packed is None
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(half(xb), F.linear(xb, half.weight))


def test_packed_weight_is_a_copy_taken_at_load():
    layer = build(lambda: ReplicatedLinear(8, 4, bias=False))
    x = torch.randn(STREAM_MAX_ROWS + 1, 8)  # oneDNN's rows, not the C kernel's
    before = layer(x)
    layer.weight.data.mul_(2)
    torch.testing.assert_close(layer(x), before)
    layer.linear_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), 2 * before, atol=1e-4, rtol=1e-5)


def test_without_the_op_table_layers_use_f_linear():
    with model_build_context(BuildContext(TorchRefBackend)):
        layer = ReplicatedLinear(8, 4)
        head = ParallelLMHead(10, 8)
    assert type(layer.linear_method) is UnquantizedLinearMethod
    assert type(head.linear_method) is UnquantizedLinearMethod
