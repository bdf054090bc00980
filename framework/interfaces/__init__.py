"""Interfaces the core defines and plugins implement."""

from tokenmill.interfaces.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from tokenmill.interfaces.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from tokenmill.interfaces.model import CausalLM, ModelRegistry
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.proposer import FlatInputs, Proposal, ProposalBatch, Proposer, TargetStep
from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod

__all__ = [
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CausalLM",
    "CommonAttentionMetadata",
    "FlatInputs",
    "FullAttentionSpec",
    "KVCacheSpec",
    "LinearMethod",
    "MLAAttentionSpec",
    "ModelRegistry",
    "Platform",
    "Proposal",
    "ProposalBatch",
    "Proposer",
    "QuantizationMethod",
    "TargetStep",
]
