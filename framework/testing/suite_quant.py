"""Contract points of a quantization method: built with ``from_config({})`` (quantizing a float
checkpoint online), its linear layers load float weights (whole and fused shards), keep less
memory than float32, dequantize close to what they loaded, and compute ``apply`` as
``x @ dequantize(layer).T + bias`` for single rows, small and large batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill import plugins
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.platforms.cpu import CpuPlatform

HIDDEN, INTERMEDIATE, HEAD, HEADS, KV_HEADS = 128, 160, 32, 4, 2
ROWS = (1, 3, 48)
"""Input rows: a single decode, a few (the kernels' row tiles), a prefill-sized batch."""
OUTPUT_TOLERANCE = 2e-2
"""``|apply - x @ W.T| / |x @ W.T|`` (Frobenius norms) allowed: float summation order, and
methods that also quantize activations."""
WEIGHT_TOLERANCE = 0.15
"""``|dequantize - W| / |W|`` allowed: 4-bit round-to-nearest on Gaussian weights is ~0.09."""


@pytest.fixture(scope="module")
def layers(tokenmill_quantization: str) -> dict[str, tuple[LinearBase, torch.Tensor]]:
    """A fused gate/up, a fused q/k/v and a row-parallel layer with bias, built with the
    method and loaded (shard by shard for the fused ones) with random float weights; name ->
    (layer, the float weight it loaded)."""
    method_cls = plugins.get_registry("quantization_methods").load(tokenmill_quantization)
    try:
        method = method_cls.from_config({})
    except ValueError as e:
        pytest.skip(f"{tokenmill_quantization} does not quantize float checkpoints online: {e}")
    ctx = BuildContext(TorchRefBackend, torch.float32, method, ops=CpuPlatform.get_ops())
    with model_build_context(ctx):
        built = {
            "gate_up_proj": MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False, prefix="mlp.gate_up_proj"),
            "qkv_proj": QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, prefix="self_attn.qkv_proj"),
            "down_proj": RowParallelLinear(INTERMEDIATE, HIDDEN, bias=True, prefix="mlp.down_proj"),
        }
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for name, layer in built.items():
            weight = torch.randn(layer.output_size, layer.input_size, generator=gen) * 0.05
            param = layer.weight
            if isinstance(layer, QKVParallelLinear):
                q, kv = HEADS * HEAD, KV_HEADS * HEAD
                for shard, part in zip("qkv", weight.split([q, kv, kv])):
                    param.weight_loader(param, part, shard)
            elif isinstance(layer, MergedColumnParallelLinear):
                for shard, part in enumerate(weight.split(layer.output_sizes)):
                    param.weight_loader(param, part, shard)
            else:
                param.weight_loader(param, weight)
            if layer.bias is not None:
                layer.bias.weight_loader(layer.bias, torch.randn(layer.output_size, generator=gen))
            layer.linear_method.process_weights_after_loading(layer)
            out[name] = (layer, weight)
    return out


def _weight_bytes(layer: nn.Module) -> int:
    tensors = [t for name, t in layer.named_parameters(recurse=False) if name != "bias"]
    tensors += [t for t in layer.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_loaded_memory_below_float(layers):
    """keeps each loaded linear layer's weights in fewer bytes than float32"""
    for name, (layer, weight) in layers.items():
        quantized, full = _weight_bytes(layer), weight.numel() * 4
        assert quantized < full, (
            f"{name}: the loaded layer holds {quantized} bytes of weights, float32 needs {full}"
        )


def test_dequantize_close_to_loaded_weight(layers):
    """dequantizes to the float weight it loaded, every fused shard in its place"""
    for name, (layer, weight) in layers.items():
        deq = layer.linear_method.dequantize(layer).float()
        assert deq.shape == weight.shape, f"{name}: dequantize gives {tuple(deq.shape)}, expected {tuple(weight.shape)}"
        rows = layer.output_sizes if hasattr(layer, "output_sizes") else [layer.output_size]
        for i, (ours, ref) in enumerate(zip(deq.split(rows), weight.split(rows))):
            error = ((ours - ref).norm() / ref.norm()).item()
            assert error < WEIGHT_TOLERANCE, (
                f"{name} shard {i}: dequantized weight is {error:.3f} (relative) from the loaded "
                f"float weight (allowed {WEIGHT_TOLERANCE})"
            )


@pytest.mark.parametrize("rows", ROWS)
def test_output_matches_dequantized_matmul(layers, rows):
    """computes apply(x) as x @ dequantize(layer).T + bias"""
    gen = torch.Generator().manual_seed(rows)
    for name, (layer, _) in layers.items():
        x = torch.randn(rows, layer.input_size, generator=gen)
        with torch.no_grad():
            ours = layer.linear_method.apply(layer, x, layer.bias)
            ref = x @ layer.linear_method.dequantize(layer).float().T
            if layer.bias is not None:
                ref = ref + layer.bias
        assert ours.shape == ref.shape, f"{name}: output shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
        error = ((ours - ref).norm() / ref.norm()).item()
        assert error < OUTPUT_TOLERANCE, (
            f"{name}, {rows} rows: layer output differs from dequantize-then-matmul by {error:.2e} "
            f"(relative; allowed {OUTPUT_TOLERANCE})"
        )
