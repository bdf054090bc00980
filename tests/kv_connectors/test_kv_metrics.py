"""A KV connector's hits reach /metrics apart from the local prefix cache's, under vLLM's names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.entrypoints.openai.metrics import EngineStatsCollector


def test_external_hits_are_exported_apart_on_metrics():
    stats = {
        "prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 32,
        "external_prefix_cache_query_tokens": 68, "external_prefix_cache_hit_tokens": 48,
        "kv_transfer_recomputed": 3,
        "num_running_requests": 0, "num_waiting_requests": 0, "kv_blocks_total": 8, "kv_blocks_free": 8,
    }
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, lambda: [stats], "m", "vllm"))
    text = generate_latest(registry).decode()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0' in text
    assert 'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 68.0' in text
    assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 48.0' in text
    assert 'tokenmill:kv_transfer_recomputed_total{engine="0",model_name="m"} 3.0' in text
