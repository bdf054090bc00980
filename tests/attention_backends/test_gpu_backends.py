"""Each GPU attention backend against the reference backend on random mixed batches, on the GPU
(a backend that cannot serve here, not installed or GPU too old, is skipped with its reasons);
and, anywhere, the metadata the FlashAttention and FlashInfer builders derive from a batch."""

from __future__ import annotations

import pytest
import torch

from support.paged_batches import usable_backend
from tokenmill.testing.paged import MIXED_SHAPES, random_batch, run_backend, run_reference
from tokenmill.attention_backends.flash_attn import FlashAttentionMetadataBuilder
from tokenmill.attention_backends.flashinfer import FlashInferMetadataBuilder
from tokenmill.interfaces import FullAttentionSpec

DECODE_ONLY = ([1, 1, 1, 1, 1], [5, 40, 17, 100, 0])
SHAPES = [*MIXED_SHAPES, DECODE_ONLY]
# (backend, dtype, block_size, max abs error)
CASES = [
    ("triton", torch.float32, 16, 1e-3),
    ("triton", torch.bfloat16, 16, 2e-2),
    ("flashinfer", torch.bfloat16, 16, 2e-2),
    ("flashinfer", torch.float16, 32, 1e-2),
    ("flash_attn", torch.bfloat16, 256, 2e-2),
    ("flash_attn", torch.float16, 256, 1e-2),
]
# (num_heads, num_kv_heads, head_size)
HEADS = [(8, 2, 64), (8, 8, 128), (12, 4, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("name, dtype, block_size, tol", CASES)
def test_backend_matches_reference(name, dtype, block_size, tol, heads, shape):
    num_heads, num_kv_heads, head_size = heads
    backend = usable_backend(name, head_size, dtype, block_size)
    batch = random_batch(
        *shape, num_heads, num_kv_heads, head_size, block_size, dtype=dtype, device="cuda"
    )
    out, cache = run_backend(backend, batch)
    ref_out, ref_cache = run_reference(batch)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert torch.equal(cache.float(), ref_cache)


def test_flash_attn_metadata_cumulates_context_lengths():
    batch = random_batch([1, 9, 4], [40, 0, 3], 4, 2, 64, 16)
    builder = FlashAttentionMetadataBuilder(FullAttentionSpec(16, torch.float32, 2, 64), "cpu")
    metadata = builder.build(batch.common)
    assert metadata.cu_seqlens_k.tolist() == [0, 41, 50, 57]
    batch.common.seq_lens[:] = torch.tensor([3, 0, 2])
    builder.update_for_graph(metadata, batch.common)
    assert metadata.cu_seqlens_k.tolist() == [0, 3, 3, 5]


def test_flashinfer_page_table():
    """Pages of each request in block-table order, and the fill of its last page; an empty
    (padding) request has no page and a last-page length of 1."""
    batch = random_batch([1, 9, 1], [31, 0, 0], 4, 2, 64, 16)
    batch.common.seq_lens_cpu[2] = 0
    builder = FlashInferMetadataBuilder(FullAttentionSpec(16, torch.float16, 2, 64), "cpu")
    pages = builder._pages(batch.common)
    table = batch.common.block_table
    assert pages.qo_indptr.tolist() == [0, 1, 10, 11]
    assert pages.kv_indptr.tolist() == [0, 2, 3, 3]
    assert pages.kv_indices.tolist() == [*table[0, :2].tolist(), table[1, 0].item()]
    assert pages.kv_last_page_len.tolist() == [16, 9, 1]
