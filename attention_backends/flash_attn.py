"""FlashAttention backend on the ``flash_attn`` package (FlashAttention-2, NVIDIA GPUs).

KV layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``. New K/V go into
the cache through the Triton slot-mapping kernel; then one ``flash_attn_varlen_func`` call with
the block table attends for the whole mixed batch (its causal mask is aligned to the end of each
sequence, which is exactly "a chunk against its cached prefix"). FlashAttention-2's paged KV needs
``block_size`` to be a multiple of 256. ``flash_attn`` is imported only when a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention_backends.cuda_library import device_reasons, library_reasons
from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

PAGE_MULTIPLE = 256
MIN_CAPABILITY = (8, 0)


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32: cumulative context lengths
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        cu_seqlens_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(common.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
        )

    def build_for_graph(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        """Metadata over the CUDA-graph runner's static buffers; ``common.max_seq_len`` must be
        the longest context any replay will see (it sizes the kernel's split-KV launch)."""
        return self.build(common)

    def update_for_graph(
        self, metadata: FlashAttentionMetadata, common: CommonAttentionMetadata
    ) -> None:
        torch.cumsum(common.seq_lens, 0, dtype=torch.int32, out=metadata.cu_seqlens_k[1:])


class FlashAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata | None,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return torch.zeros_like(query)
        from flash_attn import flash_attn_varlen_func

        from tokenmill.attention_backends.triton_kernels import reshape_and_cache

        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key[:n], value[:n], key_cache, value_cache, attn_metadata.slot_mapping)
        return flash_attn_varlen_func(
            query[:n],
            key_cache,
            value_cache,
            cu_seqlens_q=attn_metadata.query_start_loc,
            cu_seqlens_k=attn_metadata.cu_seqlens_k,
            max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=attn_metadata.block_table,
        )


class FlashAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "flash_attn"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(config)
        reasons += library_reasons(config, "flash_attn", "flash-attn")
        if config.head_size % 8 or config.head_size > 256:
            reasons.append(f"head size {config.head_size} is not a multiple of 8 up to 256")
        if config.block_size % PAGE_MULTIPLE:
            reasons.append(
                f"its paged KV cache needs block_size to be a multiple of {PAGE_MULTIPLE} "
                f"(got {config.block_size})"
            )
        return reasons or device_reasons("flash_attn", MIN_CAPABILITY)
