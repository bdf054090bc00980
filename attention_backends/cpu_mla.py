"""CPU MLA backend: the reference MLA backend's math with ``cpu_sdpa``'s step plan and its C
decode kernel; the CPU platform's first MLA choice.

KV layout per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, one latent
per token, as ``torch_mla``'s. In the absorbed decode every head attends over the same latents
with a query of the latent's size, which is multi-query attention with one KV head whose keys
and values are both the latent: the C kernel of ``tokenmill.ops.cpu`` runs it straight from the
paged blocks (no gather of each request's context, no padding), and the values' rope part it
also attends over is dropped before ``W_UV``. Prefill chunks decompress through ``kv_b_proj``:
fresh prompts from their own latents (all of a step's in one GEMM) and attend causally, a chunk
on a cached prefix from whole gathered blocks under its mask. An
FP8 cache is read by the kernel directly; the fresh-prompt path rounds its latents through float8
as a later read would.
"""

from __future__ import annotations

import torch

from tokenmill.attention_backends.cpu_sdpa import CpuBackend, CpuSdpaMetadata, DecodeBatch
from tokenmill.attention_backends.torch_mla import TorchMLABackend, TorchMLAImpl
from tokenmill.interfaces.attention import AttentionImpl
from tokenmill.ops import cpu as cpu_ops
from tokenmill.layers import kv_cache_quant as kv_quant


class CpuMLAImpl(TorchMLAImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuSdpaMetadata | None,
    ) -> torch.Tensor:
        output = query.new_zeros(query.shape[0], self.num_heads, self.v_head_dim)
        if attn_metadata is None:
            return output
        md = attn_metadata
        self.write(key, value, kv_cache, md.slot_mapping)
        plan = md.plan(None)
        fresh = [chunk for chunk in plan.prefills if chunk.block_ids is None]
        if fresh:  # fresh prompts: one decompression of all their new latents
            first, last = fresh[0].token_start, fresh[-1].token_end
            new = torch.cat((key[first:last], value[first:last]), dim=-1)
            new_k, new_v = self.decompress(kv_quant.round_trip(new, self.k_scale, kv_cache.dtype))
        for chunk in plan.prefills:
            s, e = chunk.token_start, chunk.token_end
            if chunk.block_ids is None:
                rows = slice(s - first, e - first)
                output[s:e] = self.attend(query[s:e], new_k[rows], new_v[rows], None)
            else:
                blocks = kv_cache.index_select(0, chunk.block_ids).flatten(0, 1)
                latents = kv_quant.read(blocks[: chunk.mask.shape[1]], self.k_scale, query.dtype)
                output[s:e] = self.attend_decompressed(query[s:e], latents, chunk.mask)
        if plan.decode is not None:
            output[plan.decode.token_idx] = self._decode(query, kv_cache, plan.decode)
        return output

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch) -> torch.Tensor:
        """The decode rows' outputs [B, H, v]: the C kernel over the paged latents, or without
        it the reference's absorbed attention over gathered blocks."""
        q = query[decode.token_idx]
        if self.head_size % 8 == 0 and cpu_ops.supports(q) and cpu_ops.supports_kv_cache(kv_cache):
            q_lat = self.absorb_query(q)  # [B, H, L+R]
            o_lat = torch.empty_like(q_lat)
            latents = kv_cache.unsqueeze(2)  # [blocks, block_size, one KV head, L+R]
            cpu_ops.paged_decode_attention(
                q_lat, o_lat, torch.arange(q.shape[0]), latents, latents, decode.block_ids,
                decode.seq_lens, decode.max_len, self.scale,
                k_scale=self.k_scale, v_scale=self.k_scale,
            )
            return self.absorb_output(o_lat[..., : self.kv_lora_rank])
        blocks = kv_cache.index_select(0, decode.block_ids.flatten())
        latents = kv_quant.read(blocks, self.k_scale, q.dtype).view(q.shape[0], -1, self.head_size)
        return self.attend_absorbed(q, latents, decode.mask[:, 0, 0, :])


class CpuMLABackend(CpuBackend, TorchMLABackend):
    @staticmethod
    def get_name() -> str:
        return "cpu_mla"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuMLAImpl
