"""The compiled CPU kernels, through the CPU platform's op table, against the layers'
``forward_native``."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.layernorm import ResidualSum, RMSNorm
from tokenmill.layers.rotary_embedding import RotaryEmbedding
from tokenmill.layers.vocab_embedding import VocabParallelEmbedding
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces.platform import OP_NAMES
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu import CpuPlatform


@pytest.fixture(autouse=True)
def cpu_platform_ops():
    """Layers built in these tests take the CPU platform's op table, as an engine's do."""
    assert cpu_ops.load() is not None, "the C kernels should build on this machine"
    with model_build_context(BuildContext(TorchRefBackend, ops=CpuPlatform.get_ops())):
        yield


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts calls of each layer kernel of ``cpu_ops``."""
    calls = dict.fromkeys(
        ["rms_norm", "fused_add_rms_norm", "residual_sum", "silu_and_mul", "rotary_embedding", "embedding"], 0
    )
    for name in calls:
        kernel = getattr(cpu_ops, name)

        def counted(*args, _name=name, _kernel=kernel):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(cpu_ops, name, counted)
    return calls


def make_norm(n: int) -> RMSNorm:
    norm = RMSNorm(n, eps=1e-5)
    norm.weight.data.normal_()
    return norm


@pytest.mark.parametrize("rows,n", [(1, 8), (5, 37), (64, 576), (300, 576)])
def test_rms_norm(rows, n):
    norm = make_norm(n)
    x = torch.randn(rows, n) * 3
    torch.testing.assert_close(norm(x), norm.forward_native(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 8), (5, 37), (300, 576)])
def test_fused_add_rms_norm_writes_in_place(rows, n):
    norm = make_norm(n)
    x, residual = torch.randn(rows, n), torch.randn(rows, n)
    want_out, want_res = norm.forward_native(x, residual)
    x_in, res_in = x.clone(), residual.clone()
    out, res = norm(x_in, res_in)
    assert out.data_ptr() == x_in.data_ptr() and res.data_ptr() == res_in.data_ptr()
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 8), (5, 37), (4, 576)])
@pytest.mark.parametrize("first_layer", [False, True])
def test_residual_sum_into_a_column_slice(rows, n, first_layer):
    """The residual stream lands in its columns of a wider buffer; the rest stays untouched."""
    x, residual = torch.randn(rows, n), None if first_layer else torch.randn(rows, n)
    buffer = torch.full((rows, 3 * n), 7.0)
    ResidualSum()(x, residual, buffer[:, n : 2 * n])
    want = x if residual is None else x + residual
    torch.testing.assert_close(buffer[:, n : 2 * n], want, atol=0, rtol=0)
    assert (buffer[:, :n] == 7).all() and (buffer[:, 2 * n :] == 7).all()


@pytest.mark.parametrize("rows,d", [(1, 8), (3, 13), (64, 1536), (100, 1536)])
def test_silu_and_mul(rows, d):
    x = torch.randn(rows, 2 * d) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])
    act = SiluAndMul()
    torch.testing.assert_close(act(x), act.forward_native(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head_size,rotary_dim,neox", [(64, 64, True), (16, 8, True), (32, 32, False), (24, 16, False)])
@pytest.mark.parametrize("tokens", [1, 7, 600])
def test_rotary_embedding_in_place_on_strided_rows(head_size, rotary_dim, neox, tokens):
    rope = RotaryEmbedding(head_size, rotary_dim, 4096, 10000.0, neox)
    heads, kv_heads = 3, 1
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    positions = torch.randint(0, 4096, (tokens,))
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(out_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, want_k, atol=1e-5, rtol=1e-5)


def test_disabled_kernels_fall_back(monkeypatch):
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    x = torch.randn(4, 16)
    assert not cpu_ops.supports(x)
    torch.testing.assert_close(SiluAndMul()(x), SiluAndMul().forward_native(x))


def test_op_table_calls_the_kernels(kernel_calls):
    assert set(CpuPlatform.get_ops()) == set(OP_NAMES)
    norm, x = make_norm(16), torch.randn(4, 16)
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    norm(x.clone(), x.clone())
    ResidualSum()(x, x, torch.empty(4, 16))
    SiluAndMul()(torch.randn(4, 16))
    rope = RotaryEmbedding(8, 8, 64, 10000.0)
    rope(torch.arange(4), torch.randn(4, 16), torch.randn(4, 8))
    embed = VocabParallelEmbedding(50, 16)
    embed.weight.data.normal_()
    ids = torch.tensor([3, 0, 49, 3])
    torch.testing.assert_close(embed(ids), embed.forward_native(ids), atol=0, rtol=0)
    assert kernel_calls == dict.fromkeys(kernel_calls, 1)


def test_layers_built_without_the_table_use_forward_native(kernel_calls):
    with model_build_context(BuildContext(TorchRefBackend)):
        norm, act = make_norm(16), SiluAndMul()
    x = torch.randn(4, 16)
    norm(x)
    act(x)
    assert sum(kernel_calls.values()) == 0


@pytest.mark.parametrize(
    "case", ["bfloat16", "strided-features", "residual-of-another-shape", "3-d-rope"]
)
def test_inputs_the_kernels_dont_take_use_forward_native(kernel_calls, case):
    norm = make_norm(16)
    if case == "bfloat16":
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        torch.testing.assert_close(SiluAndMul()(x), SiluAndMul().forward_native(x))
    elif case == "strided-features":
        x = torch.randn(16, 4).t()
        torch.testing.assert_close(norm(x), norm.forward_native(x))
        torch.testing.assert_close(SiluAndMul()(x), SiluAndMul().forward_native(x))
    elif case == "residual-of-another-shape":
        x, residual = torch.randn(4, 16), torch.randn(1, 16)
        torch.testing.assert_close(norm(x, residual), norm.forward_native(x, residual))
    else:
        rope = RotaryEmbedding(8, 8, 64, 10000.0)
        positions, q, k = torch.arange(4), torch.randn(4, 2, 8), torch.randn(4, 1, 8)
        want = rope.forward_native(positions, q.flatten(1), k.flatten(1))
        got = rope(positions, q, k)
        torch.testing.assert_close(got[0].flatten(1), want[0])
    assert sum(kernel_calls.values()) == 0


def test_other_dtypes_use_torch():
    assert not cpu_ops.supports(torch.randn(2, 8, dtype=torch.bfloat16))
    assert not cpu_ops.supports(torch.randn(8, 2).t())


@pytest.fixture
def fresh_load():
    """``cpu_ops.load`` with its per-process cache emptied before and after the test."""
    cpu_ops.load.cache_clear()
    yield cpu_ops.load
    cpu_ops.load.cache_clear()


def test_builds_into_an_empty_cache(fresh_load, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        assert fresh_load() is not None
    assert len(list((tmp_path / "kernels").glob("cpu_kernels_*.so"))) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiling CPU kernels with ") for m in messages), messages
    assert any(re.fullmatch(r"compiled CPU kernels in \d+\.\d s", m) for m in messages), messages


def test_disable_kernels_0_keeps_them(fresh_load, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DISABLE_CPU_KERNELS", "0")
    assert fresh_load() is not None


@pytest.mark.parametrize("setting", ["disabled", "no-compiler", "unwritable-cache"])
def test_unavailable_kernels_leave_torch_paths(fresh_load, tmp_path, monkeypatch, setting):
    if setting == "disabled":
        monkeypatch.setenv("TOKENMILL_DISABLE_CPU_KERNELS", "1")
    elif setting == "no-compiler":
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        blocker = tmp_path / "file"
        blocker.write_text("")
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker))
    assert fresh_load() is None
    x = torch.randn(3, 16)
    assert not cpu_ops.supports(x)
    torch.testing.assert_close(SiluAndMul()(x), SiluAndMul().forward_native(x))
    assert CpuPlatform.get_ops() == {}


def _decode_attention_reference(q, kv, block_table, seq_lens, scale, window, k_scale, v_scale):
    """Per request: softmax(q·k * scale) · v over its (windowed) context, heads grouped."""
    h, kvh, d = q.shape[1], kv.shape[3], q.shape[2]
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        blocks = block_table[b, : -(-length // kv.shape[2])]
        k = kv[0, blocks].reshape(-1, kvh, d)[:length].float() * k_scale
        v = kv[1, blocks].reshape(-1, kvh, d)[:length].float() * v_scale
        first = max(0, length - window) if window else 0
        k, v = k[first:].repeat_interleave(h // kvh, 1), v[first:].repeat_interleave(h // kvh, 1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", weights, v)
    return out


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("seq_lens", [[1], [37], [300], [16, 250], [5, 70, 129]])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_decode_attention_splits_few_requests_over_threads(threads, seq_lens, window, kv_dtype):
    """Fewer requests than threads: each request's blocks are split over the threads and the
    partial softmaxes merged (a range may hold only masked-out or no blocks); the result is
    that of one pass over the whole context."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 7 + threads)
    h, kvh, d, bs, num_blocks = 6, 2, 64, 16, 64
    kv = torch.randn(2, num_blocks, bs, kvh, d, generator=gen).to(kv_dtype)
    lens = torch.tensor(seq_lens)
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:20] for _ in seq_lens])
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    k_scale, v_scale = (1.0, 1.0) if kv_dtype is torch.float32 else (0.5, 2.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_ops.paged_decode_attention(
            q, out, torch.arange(len(seq_lens)), kv[0], kv[1], block_table, lens, max(seq_lens),
            0.125, window or None, k_scale, v_scale,
        )
    finally:
        torch.set_num_threads(previous)
    ref = _decode_attention_reference(q, kv, block_table, lens, 0.125, window, k_scale, v_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("h,kvh", [(4, 4), (4, 2), (8, 2), (10, 2), (9, 3)])
@pytest.mark.parametrize("d", [16, 40, 64])
def test_decode_attention_takes_any_head_grouping(h, kvh, d):
    """The kernel attends up to three query heads of one kv head together: groups of 1, 2, 4
    and 5 heads (a last chunk smaller than three) and head sizes with a tail below 32 give the
    reference's result."""
    gen = torch.Generator().manual_seed(h * 100 + kvh * 10 + d)
    bs, num_blocks, seq_lens = 16, 32, [3, 50, 97]
    kv = torch.randn(2, num_blocks, bs, kvh, d, generator=gen)
    lens = torch.tensor(seq_lens)
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:8] for _ in seq_lens])
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    cpu_ops.paged_decode_attention(q, out, torch.arange(len(seq_lens)), kv[0], kv[1], block_table, lens, 97, 0.2)
    ref = _decode_attention_reference(q, kv, block_table, lens, 0.2, 0, 1.0, 1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
