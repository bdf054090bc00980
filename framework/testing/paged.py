"""Random mixed batches over a paged KV cache, and drivers that run any attention backend on
one: against the reference backend, in the reference layout or in the backend's own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces import FullAttentionSpec
from tokenmill.interfaces.attention import AttentionBackend, CommonAttentionMetadata


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
    and schedules ``query_lens[i]`` new ones, laid out by :func:`paged_metadata`."""
    gen = torch.Generator().manual_seed(seed)
    common, num_blocks = paged_metadata(query_lens, context_lens, block_size, gen, device)
    qkv = random_qkv(gen, sum(query_lens), num_heads, num_kv_heads, head_size, dtype, device)
    cache = randn(gen, (2, num_blocks, block_size, num_kv_heads, head_size), dtype, device)
    return PagedBatch(*qkv, cache, common, block_size)


def randn(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """Standard normal values drawn from ``gen`` on the CPU (the same on every device)."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def random_qkv(
    gen: torch.Generator,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random queries [T, heads, head_size], keys and values [T, kv_heads, head_size]."""
    return (
        randn(gen, (num_tokens, num_heads, head_size), dtype, device),
        randn(gen, (num_tokens, num_kv_heads, head_size), dtype, device),
        randn(gen, (num_tokens, num_kv_heads, head_size), dtype, device),
    )


def paged_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[CommonAttentionMetadata, int]:
    """The metadata of requests ``i`` with ``context_lens[i]`` cached tokens scheduling
    ``query_lens[i]`` new ones, and the number of blocks in the pool: blocks are a random
    permutation of the pool (drawn from ``gen``), and the block table is wider than any
    request needs."""
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
    return _metadata(query_lens, context_lens, block_table, slots, device), num_blocks


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


def _metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_table: torch.Tensor,
    slots: list[torch.Tensor],
    device: str | torch.device,
) -> CommonAttentionMetadata:
    """The metadata of requests scheduling ``query_lens`` new tokens on ``context_lens`` cached
    ones, whose new tokens go to ``slots``."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(context_lens, dtype=torch.int32),
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def context_metadata(common: CommonAttentionMetadata, block_size: int) -> CommonAttentionMetadata:
    """The metadata of the step that writes ``common``'s cached contexts: each request with a
    context prefills it as new tokens over the same block table."""
    context = common.num_computed_tokens_cpu.tolist()
    rows = [i for i, c in enumerate(context) if c > 0]
    lens = [context[i] for i in rows]
    block_table = common.block_table.cpu()[rows]
    slots = [
        block_table[j, torch.arange(n) // block_size].long() * block_size
        + torch.arange(n) % block_size
        for j, n in enumerate(lens)
    ]
    return _metadata(lens, [0] * len(lens), block_table, slots, common.block_table.device)


def context_fill(batch: PagedBatch, seed: int = 1) -> PagedBatch:
    """The step that writes ``batch``'s cached context itself (:func:`context_metadata`, with
    random Q/K/V), so a backend's cache can be filled by the backend, in whatever layout it
    keeps."""
    fill = context_metadata(batch.common, batch.block_size)
    heads, head_size = batch.query.shape[1:]
    qkv = random_qkv(
        torch.Generator().manual_seed(seed), fill.num_actual_tokens, heads, batch.key.shape[1],
        head_size, batch.query.dtype, batch.query.device,
    )
    return PagedBatch(*qkv, torch.zeros_like(batch.kv_cache), fill, batch.block_size)


def run_steps(
    backend: type[AttentionBackend],
    steps: list[PagedBatch],
    scale: float | None = None,
    sliding_window: int | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run one layer of ``backend`` over ``steps`` in order on one cache that starts zeroed, in
    the backend's own layout (``get_kv_cache_shape``): each step's output, and the cache after
    the last step, as the backend keeps it."""
    first = steps[0]
    num_heads, head_size = first.query.shape[1:]
    num_kv_heads = first.key.shape[1]
    _, num_blocks, block_size, _, _ = first.kv_cache.shape
    scale = head_size**-0.5 if scale is None else scale
    spec = FullAttentionSpec(block_size, first.kv_cache.dtype, num_kv_heads, head_size)
    builder = backend.get_metadata_builder_cls()(spec, first.query.device)
    impl = backend.get_impl_cls()(
        num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window
    )
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache = torch.zeros(shape, dtype=first.kv_cache.dtype, device=first.query.device)
    outputs = [
        impl.forward(step.query, step.key, step.value, cache, builder.build(step.common))
        for step in steps
    ]
    return outputs, cache


def layout_permutation(shape: tuple[int, ...], reference: tuple[int, ...]) -> tuple[int, ...] | None:
    """``perm`` such that a cache of ``shape`` permuted by it is in the ``reference`` layout;
    None when ``shape`` is not ``reference`` and either the sizes are not all different or it
    is not a permutation of them (a packed or padded layout)."""
    shape = tuple(shape)
    if shape == tuple(reference):
        return tuple(range(len(shape)))
    if len(set(reference)) < len(reference) or sorted(shape) != sorted(reference):
        return None
    return tuple(shape.index(size) for size in reference)
