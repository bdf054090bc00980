"""Deliberately broken parts the conformance kit must catch (registered at run time by the
``conftest.py`` that tests/plugins/test_conformance_kit.py writes for its pytest run)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.attention_backends.torch_mla import TorchMLABackend, TorchMLAImpl
from tokenmill.attention_backends.torch_ref import TorchRefBackend, TorchRefImpl
from tokenmill.interfaces import AttentionConfig
from tokenmill.interfaces.proposer import Proposal, Proposer
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.ops import cpu_quant
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.quant.int8 import Int8Config, Int8LinearMethod


class WrongSlotImpl(TorchRefImpl):
    """Writes each token's K/V one slot past where the slot mapping says."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        if attn_metadata is not None:
            num_slots = kv_cache[0].numel() // (self.num_kv_heads * self.head_size)
            shifted = (attn_metadata.slot_mapping + 1) % num_slots
            attn_metadata = dataclasses.replace(attn_metadata, slot_mapping=shifted)
        return super().forward(query, key, value, kv_cache, attn_metadata)


class WrongSlotBackend(TorchRefBackend):
    @staticmethod
    def get_impl_cls():
        return WrongSlotImpl


class NoGqaImpl(TorchRefImpl):
    """Gives query head ``h`` KV head ``h % num_kv_heads`` instead of ``h // group``."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        kv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        heads = torch.arange(self.num_heads, device=query.device)
        order = (heads % kv) * group + heads // kv
        moved = torch.empty_like(query)
        moved[:, order] = query
        return super().forward(moved, key, value, kv_cache, attn_metadata)[:, order]


class NoGqaBackend(TorchRefBackend):
    @staticmethod
    def get_impl_cls():
        return NoGqaImpl


class WrongSlotMLAImpl(TorchMLAImpl):
    """Writes each token's latent one slot past where the slot mapping says."""

    def write(self, kv_c, k_pe, kv_cache, slots):
        num_slots = kv_cache.numel() // self.head_size
        return super().write(kv_c, k_pe, kv_cache, (slots + 1) % num_slots)


class WrongSlotMLABackend(TorchMLABackend):
    @staticmethod
    def get_impl_cls():
        return WrongSlotMLAImpl


class NoRopeMLAImpl(TorchMLAImpl):
    """Drops the rope part from the decodes' scores: the absorbed query keeps only
    ``q_nope·W_UK``."""

    def absorb_query(self, q):
        q_cat = super().absorb_query(q)
        q_cat[..., self.kv_lora_rank :] = 0
        return q_cat


class NoRopeMLABackend(TorchMLABackend):
    @staticmethod
    def get_impl_cls():
        return NoRopeMLAImpl


class UnregisteredCandidatePlatform(CpuPlatform):
    """Lists a backend nobody registered."""

    name = "unregistered-candidate"

    @classmethod
    def is_auto_selectable(cls) -> bool:
        return False

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        return ["no-such-backend", *super().get_attn_backend_candidates(config)]


class RopeOffByOne(LlamaForCausalLM):
    """Rotates every token after the first as if it sat one position later (a uniform shift
    would not show: RoPE sees only distances)."""

    def forward(self, input_ids, positions):
        return super().forward(input_ids, torch.where(positions > 0, positions + 1, positions))


class CorruptingProposer(Proposer):
    """Drafts nothing but writes into the shared input batch: it replaces each request's
    newest token, which the next step feeds to the model."""

    def propose(self, batch):
        tokens = batch.input_batch.token_ids
        for row in batch.rows:
            last = batch.input_batch.num_tokens[row] - 1
            tokens[row, last] = (tokens[row, last] + 1) % 256
        k = batch.num_speculative_tokens
        return Proposal(np.zeros((len(batch.rows), k), dtype=np.int64), np.zeros(len(batch.rows), dtype=np.int64))


class NeighbourScaleMethod(Int8LinearMethod):
    """Its kernel path (up to a few hundred rows) scales each output channel by the previous one's
    scale."""

    def cpu_apply(self, layer, x, bias):
        return cpu_quant.int8_linear(x, layer.weight, layer.weight_scale.roll(1), bias)


class NeighbourScaleInt8(Int8Config):
    linear_method_cls = NeighbourScaleMethod


class KeepsFloatMethod(Int8LinearMethod):
    """Keeps the float weight next to its int8 copy."""

    def quantize(self, weight):
        return {**super().quantize(weight), "weight_float": weight}


class KeepsFloatInt8(Int8Config):
    linear_method_cls = KeepsFloatMethod
