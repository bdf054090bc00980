"""Decode plans (``cpu_ops.pack_plan`` / ``run_plan``, ``csrc/plan.c``): a chain of dependent
kernel calls, recorded as a decode graph records them, run as one C call in one OpenMP region
gives the kernels' own results bit for bit, on any number of threads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.ops import cpu as cpu_ops
from tokenmill.ops import cpu_quant
from tokenmill.platforms.cpu_graph import _Recorder
from tokenmill.quant.int8 import pack_panels, quantize_int8

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler")

H, KVH, D, HIDDEN, INTER, VOCAB, BLOCK, BLOCKS = 4, 2, 16, 64, 96, 50, 4, 8


def q4_1(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A random [rows, cols] weight in GGUF Q4_1 blocks, as uint8 [rows, row_bytes]."""
    w = torch.randn(rows, cols, generator=gen).numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)))


def decoder_layer(t: int, gen: torch.Generator):
    """Random inputs and weights, a function running one decoder layer's decode path for ``t``
    tokens through the C kernels and returning what it wrote (the KV cache last), and one
    restoring the KV cache, the only state a run reads that it does not compute."""
    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (t,), generator=gen)
    norm_w = torch.rand(HIDDEN, generator=gen) + 0.5
    qkv_w = torch.randn((H + 2 * KVH) * D, HIDDEN, generator=gen) / 8
    cos_sin = torch.randn(64, D, generator=gen)
    positions = torch.randint(0, 64, (t,), generator=gen)
    kv_init = torch.randn(2, BLOCKS, BLOCK, KVH, D, generator=gen)
    kv = kv_init.clone()
    seq_lens = torch.randint(1, BLOCKS * BLOCK // 2, (t,), generator=gen)
    perm = torch.randperm(BLOCKS, generator=gen)
    block_table = torch.stack([perm.roll(-i)[: BLOCKS // 2] for i in range(t)])
    slots = block_table[:, 0] * BLOCK  # one per request (t <= BLOCKS), so no two writes race
    o_w = q4_1(HIDDEN, H * D, gen)
    up_w, up_scale = quantize_int8(torch.randn(2 * INTER, HIDDEN, generator=gen))
    down_w, down_scale = quantize_int8(torch.randn(HIDDEN, INTER, generator=gen))
    down_panels = pack_panels(down_w)
    rows = torch.arange(t)

    def run() -> list[torch.Tensor]:
        hidden = cpu_ops.embedding(ids, table)
        residual = torch.empty(t, HIDDEN)
        cpu_ops.residual_sum(residual, hidden, None)
        x = cpu_ops.rms_norm(hidden, norm_w, 1e-6)
        qkv = cpu_quant.f32_linear(x, qkv_w, None)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        cpu_ops.rotary_embedding(positions, q, k, cos_sin, D, D, True)
        cpu_ops.kv_cache_write(kv[0], kv[1], slots, k.view(t, KVH, D), v.view(t, KVH, D))
        attn = torch.empty(t, H, D)
        cpu_ops.paged_decode_attention(
            q.view(t, H, D), attn, rows, kv[0], kv[1], block_table, seq_lens, BLOCKS * BLOCK, D**-0.5
        )
        o = torch.empty(t, HIDDEN)
        cpu_ops.load().gguf_matmul_q8(
            int(gguf.GGMLQuantizationType.Q4_1), o_w.data_ptr(), o_w.shape[1], attn.data_ptr(), t, H * D,
            o.data_ptr(), HIDDEN,
        )
        x, residual = cpu_ops.fused_add_rms_norm(o, residual, norm_w, 1e-6)
        up = cpu_quant.int8_linear(x, up_w, up_scale, None)
        act = cpu_ops.silu_and_mul(up)
        down = cpu_quant.w8a8_linear(act, down_panels, down_scale, None)
        out = torch.empty(t, HIDDEN)
        cpu_ops.residual_sum(out, down, residual)
        return [hidden, qkv, attn, o, up, act, out, kv]

    return run, lambda: kv.copy_(kv_init)


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_a_plan_gives_the_kernels_results_bit_for_bit(tokens):
    run, restore_kv = decoder_layer(tokens, torch.Generator().manual_seed(tokens))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            restore_kv()
            expected = [t.clone() for t in run()]
            restore_kv()
            with _Recorder() as recorder:
                outputs = run()
            plan = cpu_ops.pack_plan([(kernel.__name__, args) for kernel, args in recorder.calls])
            assert len(plan) == 14
            for t in outputs[:-1]:
                t.fill_(float("nan"))
            restore_kv()
            cpu_ops.run_plan(plan)
            names = ["hidden", "qkv", "attn", "o", "up", "act", "out", "kv"]
            for name, got, want in zip(names, outputs, expected):
                assert torch.equal(got, want), f"{name} differs at {n} threads"
    finally:
        torch.set_num_threads(threads)


def test_a_kernel_no_plan_runs_is_refused():
    with pytest.raises(ValueError, match="lora_apply"):
        cpu_ops.pack_plan([("lora_apply", ())])
