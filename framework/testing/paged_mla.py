"""Random mixed batches for MLA attention backends over a paged latent cache, and a driver that
runs any MLA backend on one (the layer's inputs as ``tokenmill.layers.mla_attention`` hands
them over: rotated queries, normalised latents ``kv_c`` and rotated shared keys ``k_pe``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.interfaces import MLAAttentionSpec
from tokenmill.interfaces.attention import AttentionBackend, CommonAttentionMetadata
from tokenmill.testing.paged import context_metadata, paged_metadata, randn


@dataclass(frozen=True)
class MLAShape:
    """One MLA layer's dimensions; the cache holds ``kv_lora_rank + qk_rope_head_dim`` per token."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int = 32
    v_head_dim: int = 16

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """A query head's size: the no-rope part, then the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __str__(self) -> str:
        return (
            f"heads={self.num_heads} kv_lora_rank={self.kv_lora_rank} "
            f"rope={self.qk_rope_head_dim} nope={self.qk_nope_head_dim} v={self.v_head_dim}"
        )


@dataclass
class MLAStep:
    query: torch.Tensor  # [T, heads, nope + rope]
    kv_c: torch.Tensor  # [T, kv_lora_rank]
    k_pe: torch.Tensor  # [T, rope]
    common: CommonAttentionMetadata


@dataclass
class MLABatch:
    """Steps to run in order on one cache: with cached contexts, first the step that prefills
    them (:func:`tokenmill.testing.paged.context_metadata`), then the mixed step."""

    shape: MLAShape
    block_size: int
    num_blocks: int
    kv_b_proj: torch.nn.Linear  # [heads * (nope + v), kv_lora_rank]
    steps: list[MLAStep]


def random_mla_batch(
    query_lens: list[int],
    context_lens: list[int],
    shape: MLAShape,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> MLABatch:
    """Request ``i`` schedules ``query_lens[i]`` new tokens after ``context_lens[i]`` cached
    ones (written by the batch's first step), laid out by
    :func:`tokenmill.testing.paged.paged_metadata`; random inputs and ``kv_b_proj``."""
    gen = torch.Generator().manual_seed(seed)
    common, num_blocks = paged_metadata(query_lens, context_lens, block_size, gen, device)
    commons = [context_metadata(common, block_size), common] if any(context_lens) else [common]

    steps = []
    for c in commons:
        t = c.num_actual_tokens
        query = randn(gen, (t, shape.num_heads, shape.qk_head_dim), dtype, device)
        kv_c = randn(gen, (t, shape.kv_lora_rank), dtype, device)
        k_pe = randn(gen, (t, shape.qk_rope_head_dim), dtype, device)
        steps.append(MLAStep(query, kv_c, k_pe, c))
    rank = shape.kv_lora_rank
    out_features = shape.num_heads * (shape.qk_nope_head_dim + shape.v_head_dim)
    kv_b_proj = torch.nn.Linear(rank, out_features, bias=False, device="meta")
    weight = randn(gen, (out_features, rank), dtype, device) * rank**-0.5
    kv_b_proj.weight = torch.nn.Parameter(weight, requires_grad=False)
    return MLABatch(shape, block_size, num_blocks, kv_b_proj, steps)


def run_mla_steps(
    backend: type[AttentionBackend], batch: MLABatch
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run one MLA layer of ``backend`` over ``batch``'s steps in order on one cache that
    starts zeroed, in the backend's own layout (``get_kv_cache_shape`` with one KV head of the
    latent's size): each step's output [T, heads, v_head_dim], and the cache after the last."""
    shape = batch.shape
    first = batch.steps[0]
    dtype, device = first.query.dtype, first.query.device
    spec = MLAAttentionSpec(batch.block_size, dtype, shape.latent_size)
    builder = backend.get_metadata_builder_cls()(spec, device)
    impl = backend.get_impl_cls()(
        shape.num_heads,
        shape.latent_size,
        shape.qk_head_dim**-0.5,
        1,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        kv_b_proj=batch.kv_b_proj,
    )
    cache_shape = backend.get_kv_cache_shape(batch.num_blocks, batch.block_size, 1, shape.latent_size)
    cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    outputs = [
        impl.forward(step.query, step.kv_c, step.k_pe, cache, builder.build(step.common))
        for step in batch.steps
    ]
    return outputs, cache
