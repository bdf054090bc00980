"""Prometheus metrics for ``n > 1``: as in vLLM, each completion counts as a request in every
per-request series, so counters and histograms agree."""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.metrics import PrometheusMetrics
from tokenmill.sampling_params import SamplingParams

PROMPT = "hello"


def samples(metrics: PrometheusMetrics) -> dict[str, float]:
    """Sample name -> value, summed over labels, without buckets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_n2_request_counts_two_requests_in_every_series(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    save_byte_tokenizer(path)
    engine = AsyncLLM.from_engine_args(model=path, num_kv_blocks=32, block_size=8, max_model_len=64)
    metrics = PrometheusMetrics(engine.get_stats, engine.get_engine_stats, "tiny", "both", 64)
    engine.stat_loggers.append(metrics)
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)

    async def run() -> None:
        async for _ in engine.generate(PROMPT, params):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    m = samples(metrics)
    assert m["tokenmill:request_success_total"] == 2
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert m[f"tokenmill:{name}_count"] == 2, name
        assert m[f"vllm:{name}_count"] == 2, name
    # One source: the phases add up to TTFT and inference time, TPOT is the decode time per
    # token after the first, and the inter-token latencies (3 per completion) sum to it.
    sums = {
        name: m[f"vllm:{name}_sum"]
        for name in (
            "time_to_first_token_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "request_time_per_output_token_seconds",
            "inter_token_latency_seconds",
        )
    }
    assert sums["request_queue_time_seconds"] + sums["request_prefill_time_seconds"] == (
        pytest.approx(sums["time_to_first_token_seconds"])
    )
    assert sums["request_prefill_time_seconds"] + sums["request_decode_time_seconds"] == (
        pytest.approx(sums["request_inference_time_seconds"])
    )
    assert sums["request_time_per_output_token_seconds"] * 3 == pytest.approx(
        sums["request_decode_time_seconds"]
    )
    assert sums["inter_token_latency_seconds"] == pytest.approx(sums["request_decode_time_seconds"])
    assert sums["request_decode_time_seconds"] > 0
    assert m["tokenmill:inter_token_latency_seconds_count"] == 2 * 3
    assert m["vllm:inter_token_latency_seconds_count"] == 2 * 3
    assert m["tokenmill:prompt_tokens_total"] == 2 * len(PROMPT)
    assert m["tokenmill:generation_tokens_total"] == 2 * 4
    for prefix in ("tokenmill", "vllm"):
        assert m[f"{prefix}:request_success_total"] == 2
        assert m[f"{prefix}:request_params_n_count"] == 2 and m[f"{prefix}:request_params_n_sum"] == 4
        assert m[f"{prefix}:request_params_max_tokens_sum"] == 2 * 4
        assert m[f"{prefix}:request_prompt_tokens_sum"] == 2 * len(PROMPT)
        assert m[f"{prefix}:request_generation_tokens_sum"] == 2 * 4
        assert m[f"{prefix}:iteration_tokens_total_count"] >= 4
        assert m[f"{prefix}:iteration_tokens_total_sum"] >= 2 * 4 + len(PROMPT)
    assert "vllm:kv_blocks_total" not in m and "tokenmill:kv_blocks_total" in m
