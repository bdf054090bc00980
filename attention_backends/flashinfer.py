"""FlashInfer backend on ``flashinfer-python`` (NVIDIA GPUs).

KV layout per layer: FlashInfer's ``NHD`` paged cache ``[num_blocks, 2, block_size,
num_kv_heads, head_size]``. New K/V go into the cache through the Triton slot-mapping kernel.
A decode-only step runs ``BatchDecodeWithPagedKVCacheWrapper``; any step with a multi-token
chunk runs ``BatchPrefillWithPagedKVCacheWrapper`` (causal, aligned to the end of each sequence)
over the whole batch. The builder computes the page table once per step; the wrapper is planned
once per step, by the first layer, because ``plan`` needs the query head count and softmax scale
that only the layers know. ``flashinfer`` is imported only when a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.attention_backends.cuda_library import device_reasons, library_reasons
from tokenmill.interfaces import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    KVCacheSpec,
)

SUPPORTED_HEAD_SIZES = (64, 128, 256)
MIN_CAPABILITY = (7, 5)
WORKSPACE_BYTES = 256 << 20
KV_LAYOUT = "NHD"

PlanKey = tuple[int, int, int, float, torch.dtype, torch.dtype]
"""num_qo_heads, num_kv_heads, head_size, softmax scale, query dtype, KV dtype."""


@dataclass
class PagedKV:
    """FlashInfer's description of one batch's pages (indptr arrays stay on the CPU: ``plan``
    reads them there)."""

    qo_indptr: torch.Tensor  # [num_reqs + 1] CPU int32
    kv_indptr: torch.Tensor  # [num_reqs + 1] CPU int32: pages of request i are
    kv_indices: torch.Tensor  # kv_indices[kv_indptr[i]:kv_indptr[i+1]] (device int32)
    kv_last_page_len: torch.Tensor  # [num_reqs] CPU int32
    page_size: int


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    decode: bool
    wrapper: Any
    pages: PagedKV
    planned_for: PlanKey | None = None

    def plan(self, key: PlanKey) -> None:
        """Plan the wrapper for this step unless it already is for ``key``."""
        if key == self.planned_for:
            return
        num_heads, num_kv_heads, head_size, scale, q_dtype, kv_dtype = key
        p = self.pages
        layout = (p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        common = (num_heads, num_kv_heads, head_size, p.page_size)
        kwargs = dict(sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if self.decode:
            self.wrapper.plan(*layout, *common, **kwargs)
        else:
            self.wrapper.plan(p.qo_indptr, *layout, *common, causal=True, **kwargs)
        self.planned_for = key


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(kv_cache_spec, device)
        self._workspace: torch.Tensor | None = None
        self._prefill_wrapper = None
        self._decode_wrapper = None

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        decode = common.max_query_len == 1
        if decode:
            wrapper = self._decode_wrapper = self._decode_wrapper or self._new_decode_wrapper()
        else:
            from flashinfer import BatchPrefillWithPagedKVCacheWrapper

            if self._prefill_wrapper is None:
                self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace_buffer(), KV_LAYOUT
                )
            wrapper = self._prefill_wrapper
        return FlashInferMetadata(
            common.num_actual_tokens, common.slot_mapping, decode, wrapper, self._pages(common)
        )

    def build_for_graph(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """A decode wrapper of its own for this graph's batch size, over persistent page buffers
        that ``plan`` refills before every replay."""
        num_reqs = common.num_reqs
        wrapper = self._new_decode_wrapper(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(num_reqs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(
                common.block_table.numel(), dtype=torch.int32, device=self.device
            ),
            paged_kv_last_page_len_buffer=torch.zeros(
                num_reqs, dtype=torch.int32, device=self.device
            ),
        )
        return FlashInferMetadata(
            common.num_actual_tokens, common.slot_mapping, True, wrapper, self._pages(common)
        )

    def update_for_graph(
        self, metadata: FlashInferMetadata, common: CommonAttentionMetadata
    ) -> None:
        """Re-plan the graph's wrapper for the new step (outside the graph, as FlashInfer
        requires); the key is the one the capture's warm-up run planned with."""
        assert metadata.planned_for is not None, "capture must run the model once before"
        key, metadata.planned_for = metadata.planned_for, None
        metadata.pages = self._pages(common)
        metadata.plan(key)

    def _pages(self, common: CommonAttentionMetadata) -> PagedKV:
        page_size = self.kv_cache_spec.block_size
        seq_lens = common.seq_lens_cpu.to(torch.int32)
        num_pages = (seq_lens + page_size - 1) // page_size
        kv_indptr = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(num_pages, 0, dtype=torch.int32, out=kv_indptr[1:])
        rows = torch.repeat_interleave(torch.arange(common.num_reqs), num_pages)
        cols = torch.arange(int(kv_indptr[-1])) - kv_indptr[:-1].long().repeat_interleave(num_pages)
        kv_indices = common.block_table[rows.to(self.device), cols.to(self.device)]
        # FlashInfer reads 0 as a full page; an empty (padding) request gets 1, as in vLLM.
        last_page_len = torch.where(seq_lens == 0, 1, seq_lens - (num_pages - 1) * page_size)
        return PagedKV(
            common.query_start_loc_cpu.to(torch.int32),
            kv_indptr,
            kv_indices,
            last_page_len.to(torch.int32),
            page_size,
        )

    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _new_decode_wrapper(self, **kwargs: Any):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        return BatchDecodeWithPagedKVCacheWrapper(
            self._workspace_buffer(), KV_LAYOUT, use_tensor_cores=True, **kwargs
        )


class FlashInferImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata | None,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return torch.zeros_like(query)
        from tokenmill.attention_backends.triton_kernels import reshape_and_cache

        n = attn_metadata.num_actual_tokens
        reshape_and_cache(
            key[:n], value[:n], kv_cache[:, 0], kv_cache[:, 1], attn_metadata.slot_mapping
        )
        attn_metadata.plan(
            (
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                self.scale,
                query.dtype,
                kv_cache.dtype,
            )
        )
        return attn_metadata.wrapper.run(query[:n].contiguous(), kv_cache)


class FlashInferBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "flashinfer"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(config)
        reasons += library_reasons(config, "flashinfer", "flashinfer-python")
        if config.head_size not in SUPPORTED_HEAD_SIZES:
            reasons.append(f"head size {config.head_size} is not one of {SUPPORTED_HEAD_SIZES}")
        return reasons or device_reasons("flashinfer", MIN_CAPABILITY)
