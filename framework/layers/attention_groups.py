"""Attention groups (vLLM's ``AttentionGroup``): a model's attention layers grouped by backend
and KV-cache spec, each group with one metadata builder.

A model may mix layer kinds (MLA layers next to full-attention ones, or backends chosen per
layer for other reasons): every step builds each group's metadata once, and the forward context
maps each layer's name to its group's. All groups share the block pool and the block tables;
each layer's cache keeps its own backend's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.layers.attention import Attention
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.interfaces.decode_graph import GraphCapturableBuilder


@dataclass
class AttentionGroup:
    backend: type[AttentionBackend]
    builder: AttentionMetadataBuilder
    layer_names: list[str] = field(default_factory=list)


class LayerMetadataBuilder:
    """``build(common)``: every group's metadata for one step, as ``{layer name: metadata}``."""

    def __init__(self, groups: list[AttentionGroup]) -> None:
        self.groups = groups

    def build(self, common: CommonAttentionMetadata) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for group in self.groups:
            metadata.update(dict.fromkeys(group.layer_names, group.builder.build(common)))
        return metadata


class CapturableLayerMetadataBuilder(LayerMetadataBuilder):
    """A :class:`LayerMetadataBuilder` whose groups' builders all take part in CUDA graphs
    (``GraphCapturableBuilder``), so it does too."""

    def build_for_graph(self, common: CommonAttentionMetadata) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for group in self.groups:
            group_metadata = group.builder.build_for_graph(common)
            metadata.update(dict.fromkeys(group.layer_names, group_metadata))
        return metadata

    def update_for_graph(self, metadata: dict[str, Any], common: CommonAttentionMetadata) -> None:
        for group in self.groups:
            group.builder.update_for_graph(metadata[group.layer_names[0]], common)


def model_attention_layers(model: nn.Module) -> list[Attention | MLAAttention]:
    """The attention layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (Attention, MLAAttention))]


def make_metadata_builder(
    layers: Iterable[Attention | MLAAttention],
    block_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
) -> LayerMetadataBuilder:
    """Group ``layers`` by (backend, KV-cache spec) and build each group's metadata builder."""
    groups: dict[tuple[type[AttentionBackend], KVCacheSpec], AttentionGroup] = {}
    for layer in layers:
        spec = layer.get_kv_cache_spec(block_size, kv_cache_dtype)
        key = (layer.backend, spec)
        if key not in groups:
            builder = layer.backend.get_metadata_builder_cls()(spec, device)
            groups[key] = AttentionGroup(layer.backend, builder)
        groups[key].layer_names.append(layer.layer_name)
    capturable = all(isinstance(g.builder, GraphCapturableBuilder) for g in groups.values())
    cls = CapturableLayerMetadataBuilder if capturable else LayerMetadataBuilder
    return cls(list(groups.values()))
