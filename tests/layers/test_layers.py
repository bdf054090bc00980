"""Shared model layers against transformers' reference implementations, weight-loading shard
placement (including the tensor-parallel slicing math) and checkpoint iteration."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.layers import linear, vocab_embedding
from tokenmill.layers.activation import SiluAndMul, get_act_fn
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenmill.layers.rotary_embedding import get_rope, rope_config
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.model_loader.weights import iter_weights

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(autouse=True)
def build_ctx():
    torch.manual_seed(0)
    with model_build_context(BuildContext(attn_backend=TorchRefBackend)) as ctx:
        yield ctx


def fake_tp(monkeypatch: pytest.MonkeyPatch, module, size: int, rank: int) -> None:
    """Make layers built next believe they are rank ``rank`` of ``size``."""
    monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)
    monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)


# --- rotary embedding ---------------------------------------------------------------------


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rope_matches_transformers(rope_scaling: dict | None) -> None:
    heads, kv_heads, head_dim, max_pos = 4, 2, 16, 512
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rope_theta=500000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers mutates it
    )
    theta, scaling = rope_config(config)
    assert theta == 500000.0
    assert (scaling is None) == (rope_scaling is None)
    rope = get_rope(head_dim, head_dim, max_pos, theta, scaling)

    positions = torch.randint(0, max_pos, (10,))
    q = torch.randn(10, heads * head_dim)
    k = torch.randn(10, kv_heads * head_dim)
    q_out, k_out = rope(positions, q.clone(), k.clone())

    hf_rope = LlamaRotaryEmbedding(config=config)
    cos, sin = hf_rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, 10, heads, head_dim).transpose(1, 2),
        k.view(1, 10, kv_heads, head_dim).transpose(1, 2),
        cos,
        sin,
    )
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(10, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(10, -1), atol=1e-5, rtol=0)


def test_rope_linear_scaling_is_position_interpolation() -> None:
    scaled = get_rope(8, 8, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    plain = get_rope(8, 8, 64, 10000.0, None)
    q, k = torch.randn(1, 8), torch.randn(1, 8)
    scaled_qk = scaled(torch.tensor([8]), q.clone(), k.clone())
    for a, b in zip(scaled_qk, plain(torch.tensor([2]), q.clone(), k.clone())):
        torch.testing.assert_close(a, b)


def test_rope_partial_rotary_dim_passes_the_rest_through() -> None:
    rope = get_rope(16, 8, 32, 10000.0)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    q_out, k_out = rope(torch.tensor([0, 5, 9]), q.clone(), k.clone())
    torch.testing.assert_close(q_out.view(3, 2, 16)[..., 8:], q.view(3, 2, 16)[..., 8:])
    assert not torch.allclose(q_out.view(3, 2, 16)[1:, :, :8], q.view(3, 2, 16)[1:, :, :8])


def test_rope_is_shared_and_unknown_type_is_rejected() -> None:
    assert get_rope(8, 8, 64, 10000.0) is get_rope(8, 8, 64, 10000.0)
    with pytest.raises(NotImplementedError, match="dynamic"):
        get_rope(8, 8, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_rope_config_reads_both_config_styles() -> None:
    legacy = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_config(legacy) == (1e6, {"type": "linear", "factor": 2.0})
    assert rope_config(SimpleNamespace(rope_theta=5e5, rope_scaling=None)) == (5e5, None)
    v5 = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
    assert rope_config(v5) == (1e4, None)
    v5_scaled = SimpleNamespace(rope_parameters={"rope_theta": 5e5, **LLAMA3_SCALING})
    assert rope_config(v5_scaled) == (5e5, LLAMA3_SCALING)


# --- norm and activation ------------------------------------------------------------------


def test_rmsnorm_matches_transformers() -> None:
    norm = RMSNorm(32, eps=1e-5)
    ref = LlamaRMSNorm(32, eps=1e-5)
    weight = torch.randn(32)
    norm.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    x = torch.randn(7, 32)
    torch.testing.assert_close(norm(x), ref(x))


def test_rmsnorm_fused_residual() -> None:
    norm = RMSNorm(32)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


def test_rmsnorm_bf16_keeps_dtype() -> None:
    with model_build_context(BuildContext(attn_backend=TorchRefBackend, dtype=torch.bfloat16)):
        norm = RMSNorm(16)
    out, res = norm(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 16).bfloat16())
    assert out.dtype == res.dtype == torch.bfloat16


def test_silu_and_mul_and_act_fn() -> None:
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
    torch.testing.assert_close(get_act_fn("gelu_pytorch_tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="unsupported activation"):
        get_act_fn("nope")


# --- linear layers: shard placement -------------------------------------------------------


def test_qkv_loading_and_single_gemm() -> None:
    hidden, head, heads, kv_heads = 32, 8, 4, 2
    layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, prefix="qkv")
    q_w, k_w, v_w = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    q_b, k_b, v_b = torch.randn(32), torch.randn(16), torch.randn(16)
    for shard, w, b in (("q", q_w, q_b), ("k", k_w, k_b), ("v", v_w, v_b)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    torch.testing.assert_close(layer.weight.data, torch.cat([q_w, k_w, v_w]))
    torch.testing.assert_close(layer.bias.data, torch.cat([q_b, k_b, v_b]))
    x = torch.randn(3, hidden)
    expected = torch.cat([F.linear(x, w, b) for w, b in ((q_w, q_b), (k_w, k_b), (v_w, v_b))], -1)
    torch.testing.assert_close(layer(x), expected)

    fused = QKVParallelLinear(hidden, head, heads, kv_heads, bias=False)
    fused.weight.weight_loader(fused.weight, torch.cat([q_w, k_w, v_w]))
    torch.testing.assert_close(fused.weight.data, layer.weight.data)
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 32), "k")


def test_gate_up_loading() -> None:
    layer = MergedColumnParallelLinear(16, [24, 24], bias=False, prefix="gate_up")
    gate, up = torch.randn(24, 16), torch.randn(24, 16)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    torch.testing.assert_close(layer.weight.data, torch.cat([gate, up]))
    x = torch.randn(5, 16)
    torch.testing.assert_close(SiluAndMul()(layer(x)), F.silu(x @ gate.T) * (x @ up.T))


def test_qkv_tensor_parallel_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp=2 with 4 query heads and 1 KV head: each rank holds 2 query heads and a replica of
    the KV head."""
    head = 4
    q_w, k_w, v_w = torch.randn(16, 8), torch.randn(4, 8), torch.randn(4, 8)
    for rank in range(2):
        fake_tp(monkeypatch, linear, 2, rank)
        layer = QKVParallelLinear(8, head, 4, 1, bias=False)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 2)
        for shard, w in zip("qkv", (q_w, k_w, v_w)):
            layer.weight.weight_loader(layer.weight, w, shard)
        expected = torch.cat([q_w[rank * 8 : (rank + 1) * 8], k_w, v_w])
        torch.testing.assert_close(layer.weight.data, expected)


def test_merged_column_tensor_parallel_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    x = torch.randn(3, 4)
    outs = []
    for rank in range(2):
        fake_tp(monkeypatch, linear, 2, rank)
        layer = MergedColumnParallelLinear(4, [8, 8], bias=False)
        layer.weight.weight_loader(layer.weight, torch.cat([gate, up]))
        expected = torch.cat([gate[rank * 4 : (rank + 1) * 4], up[rank * 4 : (rank + 1) * 4]])
        torch.testing.assert_close(layer.weight.data, expected)
        outs.append(SiluAndMul()(layer(x)))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.silu(x @ gate.T) * (x @ up.T))


def test_column_then_row_parallel_sums_to_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column-parallel output shards feed row-parallel shards; the partial sums plus a bias
    counted once equal the unsharded result."""
    w1, b1, w2, b2 = torch.randn(8, 6), torch.randn(8), torch.randn(5, 8), torch.randn(5)
    x = torch.randn(3, 6)
    total = torch.zeros(3, 5)
    for rank in range(2):
        fake_tp(monkeypatch, linear, 2, rank)
        col = ColumnParallelLinear(6, 8, bias=True)
        row = RowParallelLinear(8, 5, bias=True)
        for layer, w, b in ((col, w1, b1), (row, w2, b2)):
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
        assert row.weight.shape == (5, 4)
        total += row(col(x))
    torch.testing.assert_close(total, F.linear(F.linear(x, w1, b1), w2, b2))


def test_replicated_linear_and_no_bias() -> None:
    layer = ReplicatedLinear(4, 3, bias=False)
    assert layer.bias is None
    w = torch.randn(3, 4)
    layer.weight.weight_loader(layer.weight, w)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ w.T)


def test_linear_takes_method_from_quantization() -> None:
    class Doubling(linear.UnquantizedLinearMethod):
        def apply(self, layer, x, bias):
            return 2 * super().apply(layer, x, bias)

    class Quant:
        def get_linear_method(self, layer, prefix):
            return Doubling() if prefix.endswith("down") else None

    with model_build_context(BuildContext(attn_backend=TorchRefBackend, quant_method=Quant())):
        down = ReplicatedLinear(2, 2, bias=False, prefix="down")
        up = ReplicatedLinear(2, 2, prefix="up")
    assert isinstance(down.linear_method, Doubling)
    assert type(up.linear_method) is linear.UnquantizedLinearMethod
    down.weight.data.copy_(torch.eye(2))
    torch.testing.assert_close(down(torch.ones(1, 2)), torch.full((1, 2), 2.0))


# --- vocabulary ---------------------------------------------------------------------------


def test_embedding_and_tied_lm_head() -> None:
    embed = VocabParallelEmbedding(10, 4)
    head = ParallelLMHead(10, 4)
    w = torch.randn(10, 4)
    embed.weight.weight_loader(embed.weight, w)
    head.tie_weights(embed)
    assert head.weight is embed.weight
    ids = torch.tensor([0, 9, 3])
    torch.testing.assert_close(embed(ids), w[ids])
    h = torch.randn(2, 4)
    logits = head.compute_logits(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, h @ w.T)


def test_vocab_tensor_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """An odd vocabulary over 2 ranks: masked lookups sum to the full embedding and the
    gathered logits drop the padding row."""
    w = torch.randn(7, 4)
    ids = torch.tensor([0, 3, 4, 6])
    total = torch.zeros(4, 4)
    shards = []
    for rank in range(2):
        fake_tp(monkeypatch, vocab_embedding, 2, rank)
        embed = VocabParallelEmbedding(7, 4)
        embed.weight.weight_loader(embed.weight, w)
        assert embed.weight.shape == (4, 4)
        total += embed(ids)
        head = ParallelLMHead(7, 4)
        head.weight.weight_loader(head.weight, w)
        shards.append(head.weight.data)
    torch.testing.assert_close(total, w[ids])
    full = torch.cat(shards)
    torch.testing.assert_close(full[:7], w)
    assert full[7].abs().sum() == 0


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_quantized_lm_head_loads_its_vocabulary_rows(monkeypatch, method) -> None:
    """An online-quantized head's weight loads this rank's rows of the full checkpoint tensor
    (padding rows zero) before it is quantized, as the float head's does."""
    from tokenmill.quant.int8 import Int8Config, W8A8Int8Config, quantize_int8

    quant = {"int8": Int8Config, "w8a8": W8A8Int8Config}[method]()
    w = torch.randn(7, 8)
    for rank in range(2):
        fake_tp(monkeypatch, vocab_embedding, 2, rank)
        with model_build_context(BuildContext(attn_backend=TorchRefBackend, quant_method=quant)):
            head = ParallelLMHead(7, 8, prefix="lm_head")
        with pytest.raises(ValueError, match=r"lm_head: checkpoint tensor has shape \(8, 8\), expected \(7, 8\)"):
            head.weight.weight_loader(head.weight, torch.randn(8, 8))
        head.weight.weight_loader(head.weight, w)
        head.linear_method.process_weights_after_loading(head)
        rows = torch.cat([w, torch.zeros(1, 8)])[4 * rank : 4 * rank + 4]
        codes, scale = quantize_int8(rows)
        torch.testing.assert_close(head.linear_method.dequantize(head), codes.float() * scale[:, None])


# --- checkpoint iteration -----------------------------------------------------------------


def test_iter_weights_sharded_index(tmp_path) -> None:
    tensors = {f"layer.{i}.weight": torch.randn(3, 2) for i in range(4)}
    tensors["ids"] = torch.arange(3)
    shard1 = {k: tensors[k] for k in ("layer.0.weight", "layer.1.weight", "ids")}
    shard2 = {k: tensors[k] for k in ("layer.2.weight", "layer.3.weight")}
    save_file(shard1, tmp_path / "model-00001-of-00002.safetensors")
    save_file(shard2, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard1}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in shard2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    loaded = dict(iter_weights(tmp_path, dtype=torch.bfloat16))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        if name == "ids":
            assert loaded[name].dtype == torch.int64
            assert torch.equal(loaded[name], tensor)
        else:
            assert loaded[name].dtype == torch.bfloat16
            torch.testing.assert_close(loaded[name], tensor.bfloat16())


def test_iter_weights_progress_over_every_shard(tmp_path, capsys) -> None:
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.ones(2)}, tmp_path / "model-2.safetensors")
    assert [n for n, _ in iter_weights(tmp_path)] == ["a", "b", "c"]
    assert capsys.readouterr().err == ""
    assert [n for n, _ in iter_weights(tmp_path, use_tqdm=True)] == ["a", "b", "c"]
    final = capsys.readouterr().err.split("\r")[-1]
    assert final.startswith("Loading weights: 100%") and "| 3/3 [" in final, final


def test_iter_weights_single_file_and_fallback(tmp_path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model.safetensors")
    assert [n for n, _ in iter_weights(tmp_path)] == ["a"]
    other = tmp_path / "other"
    other.mkdir()
    save_file({"b": torch.ones(2)}, other / "consolidated.safetensors")
    assert [n for n, _ in iter_weights(other)] == ["b"]


def test_iter_weights_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(iter_weights(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        list(iter_weights(tmp_path))
