"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache index."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class KVCacheEvent:
    """Blocks entering (``BlockStored``) or leaving (``BlockRemoved``) the prefix-cache index,
    by hash: what an instance publishes for a router's prefix affinity (vLLM's KV events)."""

    type: Literal["BlockStored", "BlockRemoved"]
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one physical block. A block with ``ref_cnt == 0`` sits in the free queue but
    keeps its ``block_hash`` (and contents) until it is evicted for reuse."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed first; O(1) removal from the
    middle when a cached free block is hit again."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is None or block is self.tail:
            raise RuntimeError("no free KV-cache blocks")
        self.remove(block)
        return block


class BlockPool:
    """Hands out blocks, takes them back, and indexes full blocks by hash for prefix caching."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.events: list[KVCacheEvent] = []

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached content."""
        if n > self.get_num_free_blocks():
            raise RuntimeError(f"asked for {n} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop the block from the prefix-cache index (its contents are no longer trusted)."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self._record("BlockRemoved", block.block_hash)
            block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int, end: int) -> None:
        """Index blocks ``start..end-1`` (now full) under their hashes."""
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block.block_hash = block_hashes[i]
            if self.cached.setdefault(block.block_hash, block) is block:
                self._record("BlockStored", block.block_hash)

    def _record(self, kind: Literal["BlockStored", "BlockRemoved"], block_hash: bytes) -> None:
        if not self.events or self.events[-1].type != kind:
            self.events.append(KVCacheEvent(kind))
        self.events[-1].block_hashes.append(block_hash)

    def take_events(self) -> list[KVCacheEvent]:
        """The index's changes since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching zero join the free queue in the given
        order, so the first ones given are evicted first."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

