"""Triton attention backend: this project's own paged-attention kernels (``triton_kernels``).

KV layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, as the reference
backend. One kernel writes the step's K/V by slot mapping, one unified kernel attends for the
whole mixed batch of prefill chunks and decode tokens. Runs on CUDA and ROCm, and on the CPU
under ``TRITON_INTERPRET=1`` (for tests). Decode-only steps can be captured in CUDA graphs: the
metadata only refers to the runner's tensors and the launch grid depends on batch shape alone.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 256


def triton_reasons(config: AttentionConfig) -> list[str]:
    """Why this project's Triton kernels cannot run ``config``'s device and dtype (empty: they
    can): Triton missing, a device other than CUDA/ROCm (or the CPU under ``TRITON_INTERPRET=1``,
    not in bfloat16), an unsupported dtype."""
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed (pip install triton)")
    if config.device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append("needs a CUDA or ROCm device (on the CPU only with TRITON_INTERPRET=1)")
        if config.dtype == torch.bfloat16:
            reasons.append("the Triton interpreter computes bfloat16 dot products wrongly")
    elif config.device_type != "cuda":
        reasons.append(f"needs a CUDA or ROCm device, not {config.device_type!r}")
    if config.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {config.dtype} is not supported")
    return reasons


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
        )

    def build_for_graph(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Metadata over the CUDA-graph runner's static buffers (see ``interfaces/decode_graph.py``)."""
        return self.build(common)

    def update_for_graph(
        self, metadata: TritonAttentionMetadata, common: CommonAttentionMetadata
    ) -> None:
        """Nothing is derived from the static buffers, so nothing to refresh before a replay."""


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata | None,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return torch.zeros_like(query)
        from tokenmill.attention_backends.triton_kernels import (
            reshape_and_cache,
            unified_attention,
        )

        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key[:n], value[:n], key_cache, value_cache, attn_metadata.slot_mapping)
        output = torch.empty_like(query)
        unified_attention(
            query,
            key_cache,
            value_cache,
            output,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            attn_metadata.num_reqs,
            attn_metadata.max_query_len,
            self.scale,
        )
        return output


class TritonAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(config) + triton_reasons(config)
        if config.head_size > MAX_HEAD_SIZE:
            reasons.append(f"head size {config.head_size} is larger than {MAX_HEAD_SIZE}")
        return reasons
