"""Per-request block lists on top of the block pool: prefix-cache lookup, slot allocation and
freeing. The manager only counts blocks; the tensors live with the workers."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and its token count.
        At least the last token is always left to compute, so there are logits to sample.
        A lookup alone is not counted in the stats; ``record_prefix_query`` counts an admission.
        A request that wants prompt logprobs gets no hit (as in vLLM): every prompt position
        must run through the model."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (once per admission, however many
        steps it waited for room)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        admit: bool = False,
        index: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` (plus ``num_lookahead_tokens`` draft
        slots) after its computed tokens and the prefix-cache hits. Returns the newly allocated
        blocks, or None (allocating nothing) when the pool can't hold them. ``admit`` applies the
        watermark: a waiting request is only admitted if that many blocks stay free. Without
        ``index`` the new full blocks are not indexed in the prefix cache yet (a KV connector
        is still loading them): a later call indexes them."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = cdiv(num_needed, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        free = self.pool.get_num_free_blocks() - num_evictable_hits
        reserve = self.watermark_blocks if admit else 0
        if max(num_new_blocks, 0) > free - reserve:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching and index:
            num_full = min(
                (num_computed + num_new_tokens) // self.block_size, len(request.block_hashes)
            )
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last.

        Blocks are indexed in the prefix cache when they are allocated, before the forward pass
        writes them. Whatever lies past ``request.num_computed_tokens`` (a victim preempted in
        the step that scheduled it, a step that failed) was never written, so it leaves the
        index here: only computed blocks can ever be hit."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            self.pool.uncache(block)
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

