"""The CPU SDPA backend against the reference backend on random mixed paged batches."""

from __future__ import annotations

import pytest
import torch

from tokenmill.testing.paged import MIXED_SHAPES, random_batch, run_backend, run_reference
from tokenmill.attention_backends.cpu_sdpa import CpuSdpaBackend
from tokenmill.ops import cpu as cpu_ops

SHAPES = MIXED_SHAPES + [
    ([1] * 7, [5, 16, 17, 31, 64, 1, 90]),
    ([48], [0]),
    ([16, 16], [16, 0]),
]


@pytest.fixture(params=["c-kernel", "sdpa-fallback"])
def decode_path(request, monkeypatch):
    """Decode through the C kernel, and through the SDPA path used without a C compiler."""
    if request.param == "c-kernel":
        assert cpu_ops.load() is not None, "the C kernels should build on this machine"
    else:
        monkeypatch.setattr(cpu_ops, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("query_lens,context_lens", SHAPES)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 4, 64), (8, 2, 128), (9, 3, 64), (6, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_reference(decode_path, query_lens, context_lens, heads, kv_heads, head_size, block_size):
    batch = random_batch(query_lens, context_lens, heads, kv_heads, head_size, block_size, seed=len(query_lens) + heads)
    out, cache = run_backend(CpuSdpaBackend, batch)
    ref_out, ref_cache = run_reference(batch)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


def test_cpu_platform_prefers_it():
    from tokenmill.interfaces.attention import AttentionConfig
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.selector import select_attention_backend

    config = AttentionConfig(head_size=64, dtype=torch.float32)
    assert select_attention_backend(CpuPlatform, config) is CpuSdpaBackend
    with pytest.raises(ValueError, match="CPU only"):
        select_attention_backend(CpuPlatform, AttentionConfig(head_size=64, dtype=torch.float32, device_type="cuda"), "cpu_sdpa")
