"""Interfaces the core defines and plugins implement."""

from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from tokenmill.interfaces.build_context import BuildContext
from tokenmill.interfaces.decode_graph import DecodeGraphRunner, GraphCapturableBuilder
from tokenmill.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRequest,
    KVConnectorRole,
    KVLoadError,
)
from tokenmill.interfaces.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from tokenmill.interfaces.model import CausalLM, SupportsEagle3, SupportsMTP
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.proposer import FlatInputs, Proposal, ProposalBatch, Proposer, TargetStep, TokenView
from tokenmill.interfaces.quantization import FusedMoEMethod, LinearMethod, QuantizationMethod

__all__ = [
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "BuildContext",
    "CausalLM",
    "CommonAttentionMetadata",
    "DecodeGraphRunner",
    "FlatInputs",
    "FullAttentionSpec",
    "FusedMoEMethod",
    "GraphCapturableBuilder",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRequest",
    "KVConnectorRole",
    "KVLoadError",
    "LinearMethod",
    "MLAAttentionSpec",
    "Platform",
    "Proposal",
    "ProposalBatch",
    "Proposer",
    "QuantizationMethod",
    "SupportsEagle3",
    "SupportsMTP",
    "TargetStep",
    "TokenView",
]
