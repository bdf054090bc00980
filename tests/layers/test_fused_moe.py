"""FusedMoE: routing against transformers' DeepSeek routers, the sorted-expert computation
against a per-token loop, and checkpoint stacking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.fused_moe import (
    FusedMoE,
    run_experts_sorted,
    select_experts,
    stacked_expert_mlp,
)

E, H, FF = 8, 32, 16


def loop_reference(x, w13, w2, topk_weights, topk_ids):
    """Each token, each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e] @ x[t]).split(FF)
            out[t] += topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * FF, H, generator=gen) * 0.2, torch.randn(E, H, FF, generator=gen) * 0.2


def test_sorted_experts_equal_loop_reference_with_idle_experts():
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, H, generator=gen)
    # experts 2, 5 and 7 get no token; expert 0 gets several
    topk_ids = torch.tensor([[0, 1], [0, 3], [4, 0], [6, 1], [3, 4], [0, 6], [1, 3]])
    topk_weights = torch.rand(7, 2, generator=gen)
    out = run_experts_sorted(x, topk_weights, topk_ids, E, stacked_expert_mlp(w13, w2))
    assert (out - loop_reference(x, w13, w2, topk_weights, topk_ids)).abs().max() < 1e-5


def test_sigmoid_grouped_routing_matches_hf_v3_router():
    config = transformers.DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(2)
    router.weight.data = torch.randn(E, H, generator=gen)
    router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    x = torch.randn(64, H, generator=gen)
    _, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(
        F.linear(x, router.weight), 3, scoring_func="sigmoid", renormalize=True,
        num_expert_group=4, topk_group=2, e_score_correction_bias=router.e_score_correction_bias,
        routed_scaling_factor=2.5,
    )
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
    distinct_groups = [len(set(g.tolist())) for g in ids // (E // 4)]
    assert max(distinct_groups) <= 2  # so each token takes two of its 3 experts from one group


def test_softmax_group_limited_routing_matches_hf_v2_router():
    config = transformers.DeepseekV2Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    )
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    router.weight.data = torch.randn(E, H, generator=gen)
    x = torch.randn(64, H, generator=gen)
    _, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(
        F.linear(x, router.weight), 2, num_expert_group=2, topk_group=1, routed_scaling_factor=1.5
    )
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))


def test_fused_moe_layer_loads_per_expert_tensors_and_adds_shared():
    w13, w2 = _weights(4)
    with model_build_context(BuildContext(TorchRefBackend)):
        shared = torch.nn.Linear(H, H, bias=False)
        moe = FusedMoE(E, 2, H, FF, shared_experts=shared)
    for e in range(E):
        moe.weight_loader(moe.w13_weight, w13[e, :FF], e, "w1")
        moe.weight_loader(moe.w13_weight, w13[e, FF:], e, "w3")
        moe.weight_loader(moe.w2_weight, w2[e], e, "w2")
    with pytest.raises(ValueError, match="expected"):
        moe.weight_loader(moe.w2_weight, w2[0].t(), 0, "w2")
    names = {(p, c) for p, c, _, _ in FusedMoE.make_expert_params_mapping(2)}
    assert ("experts.w13_", "experts.1.up_proj.") in names and ("experts.w2_", "experts.0.down_proj.") in names
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    weights, ids = select_experts(logits, 2)
    expected = loop_reference(x, w13, w2, weights, ids) + shared(x)
    with torch.no_grad():
        assert (moe(x, logits) - expected).abs().max() < 1e-5


def test_cpu_onednn_experts_equal_loop_reference_with_idle_experts():
    """The CPU platform's method on per-expert weights packed at load."""
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.platforms.cpu_fused_moe import OneDNNFusedMoEMethod

    w13, w2 = _weights(6)
    with model_build_context(BuildContext(TorchRefBackend, ops=CpuPlatform.get_ops())):
        moe = FusedMoE(E, 2, H, FF)
    assert isinstance(moe.moe_method, OneDNNFusedMoEMethod) and moe.moe_method.packed is None
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    moe.moe_method.process_weights_after_loading(moe)
    assert moe.moe_method.packed is not None
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(7, H, generator=gen)
    topk_ids = torch.tensor([[0, 1], [0, 3], [4, 0], [6, 1], [3, 4], [0, 6], [1, 3]])
    topk_weights = torch.rand(7, 2, generator=gen)
    expected = loop_reference(x, w13, w2, topk_weights, topk_ids)
    out = moe.moe_method.apply(moe, x, topk_weights, topk_ids)
    assert (out - expected).abs().max() < 1e-5
    moe.w13_weight.data.zero_()  # the packed copies were taken at load
    assert (moe.moe_method.apply(moe, x, topk_weights, topk_ids) - expected).abs().max() < 1e-5


def test_triton_fused_moe_matches_loop_reference():
    """Under the Triton interpreter on the CPU (conftest sets it), on the GPU when present."""
    triton = pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and type(triton.language.sum).__name__ != "InterpretedFunction":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1 on a machine without a GPU")
    from tokenmill.layers.fused_moe_triton import align_pairs_by_expert, fused_experts_triton

    w13, w2 = _weights(6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(21, H, generator=gen)
    topk_ids = torch.randint(0, E - 3, (21, 2), generator=gen)  # the last 3 experts stay idle
    topk_ids[:, 1] = (topk_ids[:, 0] + 1) % (E - 3)
    topk_weights = torch.rand(21, 2, generator=gen)
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, 16)
    assert set(block_expert.tolist()) == set(topk_ids.flatten().tolist())
    assert sorted(p for p in sorted_pairs.tolist() if p < 42) == list(range(42))
    out = fused_experts_triton(*(t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)))
    assert (out.cpu() - loop_reference(x, w13, w2, topk_weights, topk_ids)).abs().max() < 1e-5


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_quantized_experts_equal_their_dequantized_weights(method):
    """A quantization method's MoE method: each expert's projections quantized by its linear
    method, the float stacks dropped, the output that of the dequantized experts (w8a8 also
    rounds the activations to int8 per row)."""
    from tokenmill import plugins
    from tokenmill.platforms.cpu import CpuPlatform

    quant = plugins.get_registry("quantization_methods").load(method)()
    w13, w2 = _weights(8)
    with model_build_context(BuildContext(TorchRefBackend, quant_method=quant, ops=CpuPlatform.get_ops())):
        moe = FusedMoE(E, 2, H, FF)
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    moe.process_weights_after_loading()
    assert not hasattr(moe, "w13_weight") and len(moe.quantized_experts) == E
    method_13, method_2 = moe.moe_method.gate_up_method, moe.moe_method.down_method
    dq13 = torch.stack([method_13.dequantize(pair[0]) for pair in moe.quantized_experts])
    dq2 = torch.stack([method_2.dequantize(pair[1]) for pair in moe.quantized_experts])
    assert (dq13 - w13).abs().max() < 0.01 and (dq2 - w2).abs().max() < 0.01
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, H, generator=gen)
    topk_ids = torch.tensor([[0, 1], [0, 3], [4, 0], [6, 1], [3, 4], [0, 6], [1, 3]])
    topk_weights = torch.rand(7, 2, generator=gen)
    expected = loop_reference(x, dq13, dq2, topk_weights, topk_ids)
    out = moe.moe_method.apply(moe, x, topk_weights, topk_ids)
    tolerance = 1e-4 if method == "int8" else 0.02 * expected.abs().max()
    assert (out - expected).abs().max() < tolerance


def test_a_method_without_moe_support_is_refused_by_name():
    from tokenmill import plugins

    quant = plugins.get_registry("quantization_methods").load("int4")()
    with model_build_context(BuildContext(TorchRefBackend, quant_method=quant)):
        with pytest.raises(NotImplementedError, match="mlp.experts: quantization method Int4Config does not quantize MoE experts"):
            FusedMoE(E, 2, H, FF, prefix="mlp.experts")
