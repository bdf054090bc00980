"""The ``storage`` KV connector (vLLM's ``SharedStorageConnector`` idea): the KV of every full
prompt block an engine computes is saved to a directory, one file per block named by its
prefix-cache hash; any engine with the same model that sees the same prefix (same tokens, same
``cache_salt``) loads those blocks instead of computing them.

``kv_connector_extra_config``: ``shared_storage_path`` (the directory; required). With
``kv_role`` ``kv_producer`` the engine only saves, with ``kv_consumer`` only loads,
``kv_both`` both. Loads and saves are synchronous, in the step that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
)
from tokenmill.kv_connectors import block_file


@dataclass
class StorageMetadata(KVConnectorMetadata):
    """``(block_id, block_hash)`` pairs to load before the forward pass and save after it."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class _Tracked:
    request: KVConnectorRequest
    block_ids: list[int]
    next_block: int
    """The first prompt block not yet saved (or known to be stored)."""


def follow_block_ids(tracked: dict[str, Any], scheduler_output: Any) -> None:
    """Keep each tracked request's ``block_ids`` (any object with that list) up to date with
    the blocks the step's scheduler output gave it."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in tracked:
            tracked[new.req_id].block_ids = list(new.block_ids)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, resumed, new_ids in zip(
        cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids
    ):
        if req_id in tracked and not resumed:
            tracked[req_id].block_ids += new_ids


def storage_dir(config: EngineConfig, key: str) -> Path:
    """``kv_connector_extra_config[key]``/<model namespace>, created."""
    assert config.kv_transfer is not None
    root = config.kv_transfer.extra(key)
    if not isinstance(root, str) or not root:
        raise ValueError(
            f"kv_transfer_config['kv_connector_extra_config'][{key!r}] must name a directory, "
            f"got {root!r}"
        )
    path = Path(root) / block_file.namespace(config)
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_extra_keys(config: EngineConfig, known: set[str]) -> None:
    assert config.kv_transfer is not None
    unknown = sorted(set(config.kv_transfer.kv_connector_extra_config) - known)
    if unknown:
        raise ValueError(
            f"kv_transfer_config['kv_connector_extra_config'] has unknown key(s) "
            f"{', '.join(map(repr, unknown))} for connector "
            f"{config.kv_transfer.kv_connector!r}; known: {', '.join(sorted(known))}"
        )


def check_hash_algo(config: EngineConfig) -> None:
    if config.prefix_caching_hash_algo != "sha256":
        raise ValueError(
            f"KV connector {config.kv_transfer.kv_connector!r} stores blocks under their "
            f"hashes, which must be the same in every process: prefix_caching_hash_algo must "
            f"be 'sha256', got {config.prefix_caching_hash_algo!r}"
        )


class StorageConnector(KVConnectorBase):
    """Prompt blocks saved to and loaded from a shared directory."""

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        rank: int = 0,
        kv_cache_specs: dict[str, KVCacheSpec] | None = None,
    ) -> None:
        super().__init__(config, role, rank, kv_cache_specs)
        check_extra_keys(config, {"shared_storage_path"})
        check_hash_algo(config)
        self.dir = storage_dir(config, "shared_storage_path")
        self.block_size = config.block_size
        self.checker = block_file.FileChecker()
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: list[tuple[int, bytes]] = []
        self.step_blocks: dict[bytes, dict[str, torch.Tensor]] = {}

    def path(self, block_hash: bytes) -> Path:
        return self.dir / block_file.file_name(block_hash)

    # ----- scheduler side -----

    def get_num_new_matched_tokens(
        self, request: KVConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        n = 0
        for block_hash in request.block_hashes[start:end]:
            if not self.checker.is_valid(self.path(block_hash), block_hash):
                break
            n += 1
        return n * self.block_size, False

    def update_state_after_alloc(
        self, request: KVConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        self.pending_loads += [(block_ids[i], request.block_hashes[i]) for i in range(start, end)]
        self.tracked[request.request_id] = _Tracked(request, list(block_ids), end)

    def build_connector_meta(self, scheduler_output: Any) -> StorageMetadata:
        meta = StorageMetadata(loads=self.pending_loads)
        self.pending_loads = []
        follow_block_ids(self.tracked, scheduler_output)
        if not self.kv_transfer_config.is_kv_producer:
            return meta
        for req_id in scheduler_output.num_scheduled_tokens:
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            end = min(request.num_computed_tokens, len(request.prompt_token_ids)) // self.block_size
            for i in range(tracked.next_block, end):
                block_hash = request.block_hashes[i]
                if not self.path(block_hash).exists():
                    meta.saves.append((tracked.block_ids[i], block_hash))
            tracked.next_block = max(tracked.next_block, end)
        return meta

    def request_finished(
        self, request: KVConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.tracked.pop(request.request_id, None)
        return False, None

    # ----- worker side -----

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StorageMetadata)
        for block_id, block_hash in meta.loads:
            try:
                block_file.read(self.path(block_hash), block_hash).copy_into(self.kv_caches, block_id)
            except block_file.BlockFileError as e:
                raise RuntimeError(
                    f"KV block {block_hash.hex()} changed after it was checked ({e}); the "
                    f"step is failed rather than run on a wrong cache"
                ) from e

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete when ``start_load_kv`` returns."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StorageMetadata)
        for block_id, block_hash in meta.saves:
            self.step_blocks.setdefault(block_hash, {})[layer_name] = kv_layer[block_id].to(
                "cpu", copy=True
            )

    def wait_for_save(self) -> None:
        for block_hash, layers in self.step_blocks.items():
            block_file.write(self.path(block_hash), block_file.encode(block_hash, layers))
        self.step_blocks = {}
