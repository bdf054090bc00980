"""Block pool and KV-cache manager: ref counts, LRU eviction, prefix hits, lookahead, no leaks."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request
from tokenmill.interfaces import FullAttentionSpec, MLAAttentionSpec
from tokenmill.sampling_params import SamplingParams

BS = 4


def _req(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(), None, 16, cache_salt=salt, block_hasher=make_block_hasher(BS))


def test_free_queue_is_lru_and_hits_come_out_of_it():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [111, 222], 0, 2)
    pool.free_blocks([b, a])
    assert pool.get_num_free_blocks() == 4
    assert pool.get_cached_block(111) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    fresh = pool.get_new_blocks(3)
    assert a not in fresh
    assert pool.get_cached_block(222) is None, "the cached free block is evicted on reuse"
    assert pool.get_cached_block(111) is a


def test_block_hashes_chain_and_salt():
    r1 = _req("1", list(range(10)))
    r2 = _req("2", list(range(8)) + [99, 98])
    r3 = _req("3", list(range(10)), salt="tenant-b")
    assert len(r1.block_hashes) == 2
    assert r1.block_hashes == r2.block_hashes
    assert r3.block_hashes[0] != r1.block_hashes[0] and r3.block_hashes[1] != r1.block_hashes[1]
    r1.append_output_token_ids([10, 11])
    assert len(r1.block_hashes) == 3


def test_prefix_hit_allocation_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    r1 = _req("1", list(range(13)))
    hits, n = kv.get_computed_blocks(r1)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(r1, 13) is not None
    assert kv.get_num_free_blocks() == 6
    r2 = _req("2", list(range(12)) + [77, 78])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 12 and [b.block_id for b in hits] == kv.get_block_ids("1")[:3]
    assert kv.allocate_slots(r2, 2, n, hits) is not None
    assert kv.get_block_ids("2")[:3] == kv.get_block_ids("1")[:3]
    assert kv.get_num_free_blocks() == 5
    r1.num_computed_tokens, r2.num_computed_tokens = 13, 14
    kv.free(r1)
    kv.free(r2)
    assert kv.get_num_free_blocks() == 10
    assert kv.get_computed_blocks(_req("3", list(range(13))))[1] == 12


def test_full_prompt_hit_still_computes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    r1 = _req("1", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.free(r1)
    r2 = _req("2", list(range(8)))
    _, n = kv.get_computed_blocks(r2)
    assert n == 4


def test_allocation_failure_allocates_nothing_and_lookahead_counts():
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)
    r1 = _req("1", list(range(9)))
    assert kv.allocate_slots(r1, 9, num_lookahead_tokens=3) is not None
    assert len(kv.get_block_ids("1")) == 3
    r2 = _req("2", list(range(100, 109)))
    assert kv.allocate_slots(r2, 9) is None
    assert kv.get_num_free_blocks() == 1 and kv.get_block_ids("2") == []


def test_watermark_only_applies_to_admission():
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=64, watermark=0.2)
    r1 = _req("1", list(range(36)))
    assert kv.allocate_slots(r1, 36, admit=True) is None
    assert kv.allocate_slots(r1, 32, admit=True) is not None
    r1.num_computed_tokens = 32
    assert kv.allocate_slots(r1, 8) is not None
    assert kv.get_num_free_blocks() == 0


def test_free_drops_uncomputed_blocks_from_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    r1 = _req("1", list(range(12)))
    kv.allocate_slots(r1, 12)
    r1.num_computed_tokens = 5
    kv.free(r1)
    assert kv.get_computed_blocks(_req("2", list(range(12)) + [1]))[1] == 4


def test_no_caching_means_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64, enable_caching=False)
    r1 = _req("1", list(range(9)))
    kv.allocate_slots(r1, 9)
    kv.free(r1)
    assert kv.get_computed_blocks(_req("2", list(range(9)))) == ([], 0)


def test_kv_cache_spec_page_sizes():
    import torch

    full = FullAttentionSpec(16, torch.float32, num_kv_heads=3, head_size=64)
    assert full.page_size_bytes == 2 * 16 * 3 * 64 * 4
    mla = MLAAttentionSpec(16, torch.bfloat16, head_size=576)
    assert mla.page_size_bytes == 16 * 576 * 2
