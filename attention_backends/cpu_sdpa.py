"""CPU attention on PyTorch's fused SDPA kernels; the CPU platform's first choice.

KV layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``. Differences from
the reference backend, all about moving fewer bytes:

- context is gathered a whole block at a time (``index_select`` of contiguous blocks), never a
  token at a time;
- a prefill chunk with no cached prefix attends over its own K/V with ``is_causal``, reading
  nothing back from the cache; SDPA gets 4-D ``[1, heads, tokens, head_size]`` inputs, which
  take its fused CPU kernel (3-D ones take a path several times slower);
- decode tokens, and each token of a short query (up to ``MAX_DECODE_QUERY_LEN``: speculative
  decoding's verification, a short prompt or last prefill chunk) as a decode row of its own
  with its own sequence length, (float32) go to a C kernel (``tokenmill.ops.cpu``) that reads each request's
  context straight from its blocks, once; without a C compiler they run as one batched SDPA call
  with the query heads of each KV group folded into the query-length axis, so grouped-query
  attention needs no K/V expansion;
- with a sliding window, a chunk on a cached prefix gathers only the blocks its window reaches
  and the C kernel skips the blocks before each request's window; the rest is masked. The plan
  of each step (blocks and masks) is made once per window, on first use, and shared by every
  layer with that window.

An FP8 cache (``kv_cache_dtype="fp8"``) is quantized on write; the C kernel reads float8
directly, the torch paths convert the blocks they gather, and a fresh prefill attends over its
own K/V rounded through float8 (what a later read of the cache returns), so a prefix-cache hit
and a recomputation after preemption see the same values as the first run.

Padding up to a whole block reads slots that may hold another request's values or be
unwritten; they are masked out, and since the model runner zero-fills the cache they are always
finite (a NaN there would leak through ``0 * NaN`` in the weighted sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention_backends.torch_ref import causal_mask
from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from tokenmill.ops import cpu as cpu_ops
from tokenmill.layers import kv_cache_quant as kv_quant
from tokenmill.kv_cache_dtype import KV_CACHE_DTYPES


MAX_DECODE_QUERY_LEN = 8
"""Queries up to this long run as decode rows, one per token."""


@dataclass
class PrefillChunk:
    token_start: int
    token_end: int
    block_ids: torch.Tensor | None  # blocks from the first one in the window; None: no prefix
    mask: torch.Tensor | None  # [query_len, keys] bool, True = attend; None: plain causal


@dataclass
class DecodeBatch:
    token_idx: torch.Tensor  # [B] token rows attended as single-token queries
    block_ids: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool; None in a graph's plan


@dataclass
class StepPlan:
    """One step's attention work for the layers of one sliding window (or none)."""

    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


@dataclass
class CpuSdpaMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    common: CommonAttentionMetadata
    block_size: int
    plans: dict[int | None, StepPlan] = field(default_factory=dict)
    for_graph: bool = False

    def plan(self, sliding_window: int | None) -> StepPlan:
        """The step's plan for layers with this window, made on first use."""
        if sliding_window not in self.plans:
            make = _graph_plan if self.for_graph else _make_plan
            self.plans[sliding_window] = make(self.common, self.block_size, sliding_window)
        return self.plans[sliding_window]


def _graph_plan(common: CommonAttentionMetadata, bs: int, window: int | None) -> StepPlan:
    """A decode batch over a graph's static buffers, one token per request: its own int64
    copies of the sequence lengths and the whole block table (refreshed before each replay by
    ``update_for_graph``) and the graph's length bound as ``max_len``. No mask: a replayed
    step only runs the C kernel, which needs none."""
    n = common.num_reqs
    decode = DecodeBatch(
        torch.arange(n), common.block_table.long(), common.seq_lens.long(), common.max_seq_len, None
    )
    return StepPlan(decode, [])


def _make_plan(common: CommonAttentionMetadata, bs: int, window: int | None) -> StepPlan:
    device = common.block_table.device
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens_cpu.tolist()
    query_lens = [qsl[i + 1] - qsl[i] for i in range(common.num_reqs)]
    decode_rows: list[int] = []
    decode_tokens: list[int] = []
    decode_lens: list[int] = []
    prefills = []
    for i, q_len in enumerate(query_lens):
        seq_len = seq_lens[i]
        if q_len <= MAX_DECODE_QUERY_LEN:
            decode_rows += [i] * q_len
            decode_tokens += range(qsl[i], qsl[i + 1])
            decode_lens += range(seq_len - q_len + 1, seq_len + 1)
            continue
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        if seq_len == q_len:
            mask = None
            if window is not None and q_len > window:
                mask = causal_mask(q_pos, q_pos, window)
            prefills.append(PrefillChunk(qsl[i], qsl[i + 1], None, mask))
            continue
        first_key = 0 if window is None else max(0, seq_len - q_len - window + 1)
        first_block, num_blocks = first_key // bs, -(-seq_len // bs)
        k_pos = torch.arange(first_block * bs, seq_len, device=device)
        prefills.append(
            PrefillChunk(
                qsl[i],
                qsl[i + 1],
                common.block_table[i, first_block:num_blocks].long(),
                causal_mask(q_pos, k_pos, window),
            )
        )
    decode = None
    if decode_rows:
        rows = torch.tensor(decode_rows, device=device)
        lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
        max_len = max(decode_lens)
        num_blocks = -(-max_len // bs)
        block_ids = common.block_table[rows, :num_blocks].long()
        block_pos = torch.arange(num_blocks, device=device)
        valid_blocks = block_pos[None, :] * bs < lens[:, None]
        block_ids = torch.where(valid_blocks, block_ids, block_ids[:, :1])
        pos = torch.arange(num_blocks * bs, device=device)
        mask = causal_mask(lens - 1, pos, window)[:, None, None, :]
        token_idx = torch.tensor(decode_tokens, dtype=torch.int64, device=device)
        decode = DecodeBatch(token_idx, block_ids, lens, max_len, mask)
    return StepPlan(decode, prefills)


class CpuSdpaMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        return CpuSdpaMetadata(
            common.slot_mapping, common.num_actual_tokens, common, self.kv_cache_spec.block_size
        )


class CpuSdpaGraphBuilder(CpuSdpaMetadataBuilder):
    """cpu_sdpa's builder, which also makes metadata for decode graphs (``GraphCapturableBuilder``):
    its impl writes nothing for slot -1 and reads nothing past a request's length."""

    def build_for_graph(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        """Metadata for a decode graph over the graph runner's static buffers (used by the CPU
        platform's graphs, ``platforms/cpu_graph.py``)."""
        return CpuSdpaMetadata(
            common.slot_mapping, common.num_actual_tokens, common, self.kv_cache_spec.block_size,
            for_graph=True,
        )

    def update_for_graph(self, metadata: CpuSdpaMetadata, common: CommonAttentionMetadata) -> None:
        """Copy the new step's lengths and block table into each plan's buffers."""
        for plan in metadata.plans.values():
            assert plan.decode is not None
            plan.decode.seq_lens.copy_(metadata.common.seq_lens)
            plan.decode.block_ids.copy_(metadata.common.block_table)


class CpuSdpaImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuSdpaMetadata | None,
    ) -> torch.Tensor:
        output = query.new_empty(query.shape)
        if attn_metadata is None:
            return output.zero_()
        n = attn_metadata.num_actual_tokens
        num_blocks, bs = kv_cache.shape[1], kv_cache.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        flat_k = key_cache.view(num_blocks * bs, self.num_kv_heads, self.head_size)
        flat_v = value_cache.view(num_blocks * bs, self.num_kv_heads, self.head_size)
        ks, vs = self.k_scale, self.v_scale
        slots, key_n, value_n = attn_metadata.slot_mapping, key[:n], value[:n]
        heads_contiguous = key.stride(1) == value.stride(1) == self.head_size
        if kv_cache.dtype is torch.float32 and heads_contiguous and cpu_ops.supports(key, value):
            cpu_ops.kv_cache_write(flat_k, flat_v, slots, key_n, value_n)
        else:
            if attn_metadata.for_graph:
                # A graph's padding rows carry slot -1, which index_copy_ does not take.
                real = slots >= 0
                slots, key_n, value_n = slots[real], key_n[real], value_n[real]
            kv_quant.write(flat_k, slots, key_n, ks)
            kv_quant.write(flat_v, slots, value_n, vs)
        gqa = self.num_heads != self.num_kv_heads
        plan = attn_metadata.plan(self.sliding_window)

        for chunk in plan.prefills:
            s, e = chunk.token_start, chunk.token_end
            q = query[s:e].transpose(0, 1)[None]
            if chunk.block_ids is None:
                k = kv_quant.round_trip(key[s:e], ks, kv_cache.dtype).transpose(0, 1)[None]
                v = kv_quant.round_trip(value[s:e], vs, kv_cache.dtype).transpose(0, 1)[None]
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=chunk.mask,
                    is_causal=chunk.mask is None,
                    scale=self.scale,
                    enable_gqa=gqa,
                )
            else:
                k = kv_quant.read(self._gather(key_cache, chunk.block_ids), ks, query.dtype)[None]
                v = kv_quant.read(self._gather(value_cache, chunk.block_ids), vs, query.dtype)[None]
                ctx = chunk.mask.shape[1]
                out = F.scaled_dot_product_attention(
                    q, k[..., :ctx, :], v[..., :ctx, :], attn_mask=chunk.mask, scale=self.scale, enable_gqa=gqa
                )
            output[s:e] = out[0].transpose(0, 1)

        decode = plan.decode
        if (
            decode is not None
            and self.head_size % 8 == 0
            and cpu_ops.supports(query)
            and cpu_ops.supports_kv_cache(kv_cache)
        ):
            cpu_ops.paged_decode_attention(
                query,
                output,
                decode.token_idx,
                key_cache,
                value_cache,
                decode.block_ids,
                decode.seq_lens,
                decode.max_len,
                self.scale,
                self.sliding_window,
                ks,
                vs,
            )
        elif decode is not None:
            group = self.num_heads // self.num_kv_heads
            b = decode.token_idx.shape[0]
            q = query[decode.token_idx].view(b, self.num_kv_heads, group, self.head_size)
            k = kv_quant.read(self._gather(key_cache, decode.block_ids), ks, query.dtype)
            v = kv_quant.read(self._gather(value_cache, decode.block_ids), vs, query.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=decode.mask, scale=self.scale)
            output[decode.token_idx] = out.reshape(b, self.num_heads, self.head_size)
        return output

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks of ``cache`` [blocks, bs, kvh, d] as ``[..., kvh, n*bs, d]``."""
        blocks = cache.index_select(0, block_ids.reshape(-1))
        lead = block_ids.shape[:-1]
        kvh, d = cache.shape[2], cache.shape[3]
        return blocks.view(*lead, -1, kvh, d).transpose(-3, -2)


class CpuBackend(AttentionBackend):
    """The base of the backends that run on the CPU only, over this module's step plans."""

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return CpuSdpaMetadataBuilder

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(config)
        if config.device_type != "cpu":
            reasons.append(f"runs on the CPU only, not {config.device_type}")
        return reasons


class CpuSdpaBackend(CpuBackend):
    supports_sliding_window = True
    supported_kv_cache_dtypes = tuple(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "cpu_sdpa"

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return CpuSdpaGraphBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuSdpaImpl
