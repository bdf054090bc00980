"""Random mixed batches over a paged KV cache, and a driver that runs any attention backend on
one and hands back its output and cache in the reference layout (shared by the Triton tests and
the GPU tests)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tokenmill import plugins
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces import FullAttentionSpec
from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    CommonAttentionMetadata,
)
from tokenmill.selector import backend_reasons


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, heads, head_size]
    key: torch.Tensor  # [T, kv_heads, head_size]
    value: torch.Tensor
    kv_cache: torch.Tensor  # reference layout [2, num_blocks, block_size, kv_heads, head_size]
    common: CommonAttentionMetadata
    block_size: int


def random_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Request ``i`` has ``context_lens[i]`` cached tokens (random K/V already in the cache)
    and schedules ``query_lens[i]`` new ones; blocks are a random permutation of the pool, and
    the block table is wider than any request needs."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    width = max(blocks_needed) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        block_table[i, :n] = perm[used : used + n]
        used += n
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        pos = torch.arange(c, s)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(context_lens, dtype=torch.int32),
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(
        randn(num_tokens, num_heads, head_size),
        randn(num_tokens, num_kv_heads, head_size),
        randn(num_tokens, num_kv_heads, head_size),
        randn(2, num_blocks, block_size, num_kv_heads, head_size),
        common,
        block_size,
    )


def to_backend_layout(backend: type[AttentionBackend], kv_cache: torch.Tensor) -> torch.Tensor:
    """The reference-layout cache in ``backend``'s layout (reference or FlashInfer's NHD)."""
    _, num_blocks, block_size, kv_heads, head_size = kv_cache.shape
    shape = backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
    if shape == kv_cache.shape:
        return kv_cache.clone()
    assert shape == (num_blocks, 2, block_size, kv_heads, head_size), shape
    return kv_cache.transpose(0, 1).contiguous()


def from_backend_layout(kv_cache: torch.Tensor, reference_shape: torch.Size) -> torch.Tensor:
    return kv_cache if kv_cache.shape == reference_shape else kv_cache.transpose(0, 1)


def usable_backend(
    name: str, head_size: int, dtype: torch.dtype, block_size: int
) -> type[AttentionBackend]:
    """The registered backend ``name``, or a skip with its reasons when it cannot serve this
    configuration on the GPU here."""
    config = AttentionConfig(
        head_size=head_size, dtype=dtype, block_size=block_size, device_type="cuda"
    )
    reasons = backend_reasons(name, config)
    if reasons:
        pytest.skip(f"{name} cannot serve {config}: {'; '.join(reasons)}")
    return plugins.get_registry("attention_backends").load(name)


def run_backend(
    backend: type[AttentionBackend],
    batch: PagedBatch,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's forward on ``batch``: (output [T, heads, head_size], cache in the reference
    layout after the K/V write)."""
    num_heads, head_size = batch.query.shape[1:]
    num_kv_heads = batch.key.shape[1]
    scale = head_size**-0.5 if scale is None else scale
    spec = FullAttentionSpec(batch.block_size, batch.kv_cache.dtype, num_kv_heads, head_size)
    builder = backend.get_metadata_builder_cls()(spec, batch.query.device)
    impl = backend.get_impl_cls()(
        num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window
    )
    cache = to_backend_layout(backend, batch.kv_cache)
    out = impl.forward(batch.query, batch.key, batch.value, cache, builder.build(batch.common))
    return out, from_backend_layout(cache, batch.kv_cache.shape)


def run_reference(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference backend in float32 on the same inputs."""
    upcast = PagedBatch(
        batch.query.float(),
        batch.key.float(),
        batch.value.float(),
        batch.kv_cache.float(),
        batch.common,
        batch.block_size,
    )
    return run_backend(TorchRefBackend, upcast)


MIXED_SHAPES = [
    # (query_lens, context_lens): decodes, fresh prefills, chunks on a cached prefix
    ([1, 9, 1, 21, 1], [40, 0, 3, 17, 0]),
    ([33, 1, 1, 5], [64, 1, 130, 11]),
]
