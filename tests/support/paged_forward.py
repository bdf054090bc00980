"""One request's tokens through a model on a fresh paged KV cache, chunk by chunk (the model
tests' driver: prefill, then decode-sized steps, against transformers' logits)."""

from __future__ import annotations

import math

import torch

from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.attention import AttentionBackend, CommonAttentionMetadata
from tokenmill.layers.attention import Attention
from tokenmill.layers.mla_attention import MLAAttention


def run_paged_forward(
    model: torch.nn.Module,
    backend: type[AttentionBackend],
    token_ids: torch.Tensor,
    chunks: list[int],
    block_size: int,
) -> torch.Tensor:
    """Feed ``token_ids`` in ``chunks`` through ``model`` (built with ``backend``) over a zeroed
    cache of shuffled blocks; return the logits of every token."""
    layers = [m for m in model.modules() if isinstance(m, (Attention, MLAAttention))]
    assert len({layer.layer_name for layer in layers}) == len(layers), "layer names must be unique"
    num_blocks = math.ceil(len(token_ids) / block_size)
    for layer in layers:
        layer.kv_cache = torch.zeros(
            backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        )
    spec = layers[0].get_kv_cache_spec(block_size, torch.float32)
    builder = backend.get_metadata_builder_cls()(spec, torch.device("cpu"))
    block_table = torch.randperm(num_blocks, dtype=torch.int32)[None]
    logits, done = [], 0
    for n in chunks:
        positions = torch.arange(done, done + n)
        slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq_lens = torch.tensor([done + n], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=torch.tensor([done], dtype=torch.int32),
            block_table=block_table,
            slot_mapping=slots,
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=done + n,
        )
        with torch.inference_mode(), set_forward_context(builder.build(common)):
            logits.append(model.compute_logits(model(token_ids[done : done + n], positions)))
        done += n
    return torch.cat(logits)
