"""KV events: the block pool's record of its prefix-cache index and the front end's log of it,
which ``GET /kv_events`` publishes for a router's prefix affinity."""

from tokenmill.core.block_pool import BlockPool, KVCacheEvent
from tokenmill.engine.kv_events import KVEventLog


def test_block_pool_records_stored_and_evicted_hashes():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.take_events() == [KVCacheEvent("BlockStored", [b"a", b"b"])]
    assert pool.take_events() == []
    pool.free_blocks(blocks)
    assert pool.take_events() == []
    pool.get_new_blocks(3)
    assert pool.take_events() == [KVCacheEvent("BlockRemoved", [b"a", b"b"])]


def test_block_pool_duplicate_hash_is_not_stored_twice():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [b"a"], 0, 1)
    pool.cache_full_blocks(second, [b"a"], 0, 1)
    assert pool.take_events() == [KVCacheEvent("BlockStored", [b"a"])]
    pool.uncache(second[0])
    assert pool.take_events() == []


def test_log_gives_events_after_a_sequence_number_and_snapshots_otherwise():
    log = KVEventLog(max_events=2)
    log.extend([KVCacheEvent("BlockStored", [b"\x01", b"\x02"])])
    first = log.since(0, log.log_id)
    assert first == {
        "log_id": log.log_id,
        "seq": 1,
        "reset": False,
        "events": [{"type": "BlockStored", "block_hashes": ["01", "02"]}],
    }
    log.extend([KVCacheEvent("BlockRemoved", [b"\x01"]), KVCacheEvent("BlockStored", [b"\x03"])])
    assert [e["type"] for e in log.since(1, log.log_id)["events"]] == [
        "BlockRemoved",
        "BlockStored",
    ]
    behind = log.since(0, log.log_id)
    assert behind["reset"] and sorted(behind["blocks"]) == ["02", "03"] and behind["seq"] == 3
    other = log.since(3, "another server's log")
    assert other["reset"] and sorted(other["blocks"]) == ["02", "03"]


def test_log_counts_a_hash_held_by_two_engine_cores():
    log = KVEventLog()
    log.extend([KVCacheEvent("BlockStored", [b"\x01"]), KVCacheEvent("BlockStored", [b"\x01"])])
    log.extend([KVCacheEvent("BlockRemoved", [b"\x01"])])
    assert log.since(0, None)["blocks"] == ["01"]
    log.extend([KVCacheEvent("BlockRemoved", [b"\x01"])])
    assert log.since(0, None)["blocks"] == []
