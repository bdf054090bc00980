"""The ``offload`` KV connector: tiers below the device cache, so a prefix the block pool had
to evict comes back without recomputing it.

Every full block an engine computes (prompt and output, so a returning conversation finds its
earlier answer too) is copied to a bounded **host-memory tier** once its forward pass wrote
it, so evicting it from the device cache loses nothing (write-through). The host tier is an
LRU: when full, its least recently used block moves to a bounded **disk tier** (an LRU of
files, one per block, named by the block's prefix-cache hash), whose least recently used
file is deleted when that is full. A waiting request's blocks past its device-cache hits
load from either tier. The disk tier survives a restart: a new engine with the same
directory (and model) starts with its files, least recently written first out.

Hashes are the engine's SHA-256 chain over the tokens and ``cache_salt``, so tenants never
share blocks; each file is checked (size, header digest, payload digest) before use, and a
corrupt or truncated file is a miss with a warning.

``kv_connector_extra_config``: ``host_gib`` (host tier size, default 1; 0: blocks go straight
to disk), ``disk_gib`` (disk tier size, default 0: no disk tier), ``disk_path`` (the disk
tier's directory; needed with ``disk_gib``). The scheduler side keeps the tiers' index and
decides every move; the worker side holds the host tier's bytes and writes the files, in the
order the metadata lists the moves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
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
from tokenmill.kv_connectors.storage import (
    check_extra_keys,
    check_hash_algo,
    follow_block_ids,
    storage_dir,
)

logger = logging.getLogger(__name__)

HOST, DISK = "host", "disk"


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """The step's moves. ``loads``: ``(block_id, block_hash, tier)`` into the device cache
    before the forward pass. ``ops`` after it, in order: ``("save", block_hash, block_id)``
    device -> host (or -> disk without a host tier), ``("demote", block_hash)`` host -> disk,
    ``("drop_host", block_hash)``, ``("drop_disk", block_hash)``."""

    loads: list[tuple[int, bytes, str]] = field(default_factory=list)
    ops: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass
class _Tracked:
    request: KVConnectorRequest
    block_ids: list[int]
    next_block: int
    """The first full block not yet offered to the tiers."""


def _gib(config: EngineConfig, key: str, default: float) -> float:
    assert config.kv_transfer is not None
    value = config.kv_transfer.extra(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(
            f"kv_transfer_config['kv_connector_extra_config'][{key!r}] must be a size in GiB "
            f">= 0, got {value!r}"
        )
    return float(value)


class OffloadConnector(KVConnectorBase):
    """A host-memory tier, then a disk tier, below the device cache."""

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        rank: int = 0,
        kv_cache_specs: dict[str, KVCacheSpec] | None = None,
    ) -> None:
        super().__init__(config, role, rank, kv_cache_specs)
        check_extra_keys(config, {"host_gib", "disk_gib", "disk_path"})
        check_hash_algo(config)
        if self.block_bytes <= 0:
            raise ValueError("the offload connector needs the model's KV-cache specs")
        host_gib, disk_gib = _gib(config, "host_gib", 1.0), _gib(config, "disk_gib", 0.0)
        self.host_capacity = int(host_gib * 2**30 // self.block_bytes)
        self.disk_capacity = int(disk_gib * 2**30 // self.block_bytes)
        if self.host_capacity + self.disk_capacity == 0:
            raise ValueError(
                f"kv_transfer_config: host_gib={host_gib} and disk_gib={disk_gib} hold no "
                f"block of {self.block_bytes} bytes"
            )
        self.dir: Path | None = storage_dir(config, "disk_path") if self.disk_capacity else None
        self.block_size = config.block_size
        self.host: OrderedDict[bytes, Any] = OrderedDict()
        """LRU, oldest first. Scheduler side: the index; worker side: each block's bytes."""
        self.disk: OrderedDict[bytes, None] = OrderedDict()
        """The disk tier's index, oldest first (scheduler side)."""
        self.checker = block_file.FileChecker()
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: list[tuple[int, bytes, str]] = []
        self.step_blocks: dict[bytes, dict[str, torch.Tensor]] = {}
        if role == KVConnectorRole.SCHEDULER and self.dir is not None:
            self._scan_disk()

    def path(self, block_hash: bytes) -> Path:
        assert self.dir is not None
        return self.dir / block_file.file_name(block_hash)

    def _scan_disk(self) -> None:
        """Index the files an earlier engine left, least recently written first; delete the
        oldest beyond the capacity."""
        assert self.dir is not None
        files = sorted(self.dir.glob("*" + block_file.SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(block_file.SUFFIX))
            except ValueError:
                continue
            self.disk[block_hash] = None
        while len(self.disk) > self.disk_capacity:
            old, _ = self.disk.popitem(last=False)
            self.path(old).unlink(missing_ok=True)
        if self.disk:
            logger.info("offload connector: %d block(s) in the disk tier %s", len(self.disk), self.dir)

    # ----- scheduler side -----

    def _tier(self, block_hash: bytes) -> str | None:
        if block_hash in self.host:
            return HOST
        if block_hash in self.disk and self.checker.is_valid(self.path(block_hash), block_hash):
            return DISK
        return None

    def get_num_new_matched_tokens(
        self, request: KVConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        n = 0
        for block_hash in request.block_hashes[start:end]:
            if self._tier(block_hash) is None:
                break
            n += 1
        return n * self.block_size, False

    def update_state_after_alloc(
        self, request: KVConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        for i in range(start, end):
            block_hash = request.block_hashes[i]
            tier = self._tier(block_hash)
            assert tier is not None, "a block offered in this step left the tiers"
            (self.host if tier == HOST else self.disk).move_to_end(block_hash)
            self.pending_loads.append((block_ids[i], block_hash, tier))
        self.tracked[request.request_id] = _Tracked(request, list(block_ids), end)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        meta = OffloadMetadata(loads=self.pending_loads)
        self.pending_loads = []
        follow_block_ids(self.tracked, scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
            for i in range(tracked.next_block, end):
                self._offer(request.block_hashes[i], tracked.block_ids[i], meta.ops)
            tracked.next_block = max(tracked.next_block, end)
        return meta

    def _offer(self, block_hash: bytes, block_id: int, ops: list[tuple[Any, ...]]) -> None:
        """Plan saving a computed block, making room in the tiers (LRU)."""
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return
        if block_hash in self.disk:
            if self.checker.is_valid(self.path(block_hash), block_hash):
                self.disk.move_to_end(block_hash)
                return
            del self.disk[block_hash]
        ops.append(("save", block_hash, block_id))
        if self.host_capacity:
            self.host[block_hash] = None
            if len(self.host) <= self.host_capacity:
                return
            block_hash, _ = self.host.popitem(last=False)
            if not self.disk_capacity:
                ops.append(("drop_host", block_hash))
                return
            ops.append(("demote", block_hash))
        self.disk[block_hash] = None
        if len(self.disk) > self.disk_capacity:
            old, _ = self.disk.popitem(last=False)
            ops.append(("drop_disk", old))

    def request_finished(
        self, request: KVConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.tracked.pop(request.request_id, None)
        return False, None

    # ----- worker side -----

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        for block_id, block_hash, tier in meta.loads:
            try:
                if tier == HOST:
                    block = block_file.decode(self.host[block_hash], block_hash)
                else:
                    block = block_file.read(self.path(block_hash), block_hash)
            except block_file.BlockFileError as e:
                raise RuntimeError(
                    f"KV block {block_hash.hex()} in the {tier} tier changed after it was "
                    f"checked ({e}); the step is failed rather than run on a wrong cache"
                ) from e
            block.copy_into(self.kv_caches, block_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete when ``start_load_kv`` returns."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        for op in meta.ops:
            if op[0] == "save":
                self.step_blocks.setdefault(op[1], {})[layer_name] = kv_layer[op[2]].to(
                    "cpu", copy=True
                )

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        for kind, block_hash, *_ in meta.ops:
            if kind == "save":
                data = block_file.encode(block_hash, self.step_blocks[block_hash])
                if self.host_capacity:
                    self.host[block_hash] = data
                else:
                    block_file.write(self.path(block_hash), data)
            elif kind == "demote":
                block_file.write(self.path(block_hash), self.host.pop(block_hash))
            elif kind == "drop_host":
                del self.host[block_hash]
            elif kind == "drop_disk":
                self.path(block_hash).unlink(missing_ok=True)
        self.step_blocks = {}
