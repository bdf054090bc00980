"""Prometheus metrics named as vLLM's, under ``tokenmill:``, vLLM's ``vllm:`` or both
(``--metrics-names``; series vLLM has no counterpart of, ``NO_VLLM_COUNTERPART``, are always
``tokenmill:``).

Request histograms and the success counter are recorded as requests finish; the engine's
counters and gauges (tokens, KV blocks, prefix cache, preemptions) are read from its
latest ``get_stats()`` at each scrape.

Every per-request series counts completions, vLLM's convention (its engine runs a request
with ``n > 1`` as ``n`` child requests): an ``n = 2`` request adds 2 to
``request_success_total`` and to the count of each request histogram (TTFT, TPOT, end to end,
the queue, prefill, decode and inference phases), each observation timing one completion, and
its prompt twice to ``prompt_tokens_total``. The phases and the inter-token latencies come
from the same per-completion timestamps as TTFT and TPOT (``RequestMetrics``); inter-token
latencies are recorded at each engine step, as in vLLM."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.async_llm import RequestStats

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]

ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]

NO_VLLM_COUNTERPART = frozenset(
    {
        "kv_blocks_total",
        "kv_blocks_free",
        "num_requests_routed",
        "num_dummy_steps",
        "kv_transfer_recomputed",
        "spec_decode_num_drafts_per_length",
        "spec_decode_disable_by_batch_size",
    }
)
"""Series vLLM has no counterpart of: exported under ``tokenmill:`` whatever the names."""

PREFIXES = {"tokenmill": ("tokenmill",), "vllm": ("vllm",), "both": ("tokenmill", "vllm")}
"""``--metrics-names`` -> the prefixes of the series vLLM also has."""


def build_1_2_5_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def series_names(name: str, names: str) -> list[str]:
    """The exported names of series ``name`` (without prefix) under ``--metrics-names``."""
    if name in NO_VLLM_COUNTERPART:
        return [f"tokenmill:{name}"]
    return [f"{prefix}:{name}" for prefix in PREFIXES[names]]


ENGINE_COUNTERS = {
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens processed."),
    "num_generated_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed)."),
    "prefix_cache_query_tokens": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "external_prefix_cache_query_tokens": (
        "external_prefix_cache_queries",
        "Prompt tokens past the local prefix-cache hits looked up in the KV connector.",
    ),
    "external_prefix_cache_hit_tokens": (
        "external_prefix_cache_hits",
        "Prompt tokens the KV connector supplied (not computed, not local prefix-cache hits).",
    ),
    "kv_transfer_recomputed": (
        "kv_transfer_recomputed",
        "Requests whose KV load from the connector failed, their prompts computed locally.",
    ),
    "spec_num_drafts": ("spec_decode_num_drafts", "Speculative-decoding drafts."),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "num_requests_routed": (
        "num_requests_routed",
        "Requests the front end routed to the engine core (data parallelism).",
    ),
    "num_dummy_steps": (
        "num_dummy_steps",
        "Steps the engine core ran without requests of its own, to meet the other cores in "
        "the MoE layers (data parallelism with enable_expert_parallel).",
    ),
}
"""get_stats() key -> (metric name after the prefix, help); exported as ``..._total``."""

PER_POS_PREFIX = "spec_num_accepted_tokens_pos_"
"""get_stats() keys ``spec_num_accepted_tokens_pos_<i>``, exported with a ``position`` label."""

PER_LENGTH_PREFIX = "spec_draft_length_"
"""get_stats() keys ``spec_draft_length_<k>``, exported with a ``length`` label."""

ENGINE_GAUGES = {
    "num_running_requests": ("num_requests_running", "Requests in the running batch."),
    "num_waiting_requests": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_blocks_total": ("kv_blocks_total", "KV-cache blocks in the pool."),
    "kv_blocks_free": ("kv_blocks_free", "KV-cache blocks free (cached or empty)."),
}
SPEC_GAUGES = {
    "spec_disable_by_batch_size": (
        "spec_decode_disable_by_batch_size",
        "Running requests from which no draft pays (configured, or found by adaptive draft "
        "lengths); 0: none known.",
    ),
}
"""Exported when the engine speculates."""
LORA_GAUGES = {
    "num_running_loras": ("lora_adapters_running", "Distinct LoRA adapters of the running requests."),
    "num_waiting_loras": ("lora_adapters_waiting", "Distinct LoRA adapters of the waiting requests."),
}
"""Exported when the engine runs with ``enable_lora``."""


class EngineStatsCollector(Collector):
    """Exports the stats as counters and gauges at scrape time: each engine core's
    (``get_engine_stats()``, one dict per data-parallel rank) with an ``engine`` label, and the
    front end's counters (the keys of ``get_stats()`` that no core reports) without."""

    def __init__(
        self,
        get_stats: Callable[[], dict[str, int]],
        get_engine_stats: Callable[[], list[dict[str, int]]],
        model_name: str,
        names: str,
    ) -> None:
        self.get_stats = get_stats
        self.get_engine_stats = get_engine_stats
        self.model_name = model_name
        self.names = names

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            for full_name in series_names(family.name, self.names):
                copy = type(family)(full_name, family.documentation, labels=[])
                copy.samples = [
                    s._replace(name=full_name + s.name[len(family.name) :]) for s in family.samples
                ]
                yield copy

    def _families(self) -> Iterator[Metric]:
        """The series, named without prefix."""
        engines = self.get_engine_stats()
        front_end = {k: v for k, v in self.get_stats().items() if k not in engines[0]}
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in front_end:
                metric = CounterMetricFamily(name, doc, labels=["model_name"])
                metric.add_metric([self.model_name], front_end[key])
                yield metric
            elif key in engines[0]:
                yield self._per_engine(CounterMetricFamily, name, doc, engines, key)
        positions = sorted(
            int(key.rsplit("_", 1)[1]) for key in engines[0] if key.startswith(PER_POS_PREFIX)
        )
        if positions:
            per_pos = CounterMetricFamily(
                "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by their position in the draft.",
                labels=["model_name", "engine", "position"],
            )
            for engine, stats in enumerate(engines):
                for pos in positions:
                    per_pos.add_metric(
                        [self.model_name, str(engine), str(pos)], stats[f"{PER_POS_PREFIX}{pos}"]
                    )
            yield per_pos
        lengths = sorted(
            int(key.rsplit("_", 1)[1]) for key in engines[0] if key.startswith(PER_LENGTH_PREFIX)
        )
        if lengths:
            per_length = CounterMetricFamily(
                "spec_decode_num_drafts_per_length",
                "Requests' steps by the draft length chosen for them (0: no draft).",
                labels=["model_name", "engine", "length"],
            )
            for engine, stats in enumerate(engines):
                for length in lengths:
                    per_length.add_metric(
                        [self.model_name, str(engine), str(length)], stats[f"{PER_LENGTH_PREFIX}{length}"]
                    )
            yield per_length
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield self._per_engine(GaugeMetricFamily, name, doc, engines, key)
        for key, (name, doc) in {**SPEC_GAUGES, **LORA_GAUGES}.items():
            if key in engines[0]:
                yield self._per_engine(GaugeMetricFamily, name, doc, engines, key)
        usage = GaugeMetricFamily(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use.",
            labels=["model_name", "engine"],
        )
        for engine, stats in enumerate(engines):
            total = stats["kv_blocks_total"]
            used = 1 - stats["kv_blocks_free"] / total if total else 0.0
            usage.add_metric([self.model_name, str(engine)], used)
        yield usage

    def _per_engine(
        self, family: type, name: str, doc: str, engines: list[dict[str, int]], key: str
    ) -> Metric:
        metric = family(name, doc, labels=["model_name", "engine"])
        for engine, stats in enumerate(engines):
            metric.add_metric([self.model_name, str(engine)], stats[key])
        return metric


class PrometheusMetrics:
    """One registry per server; ``record_finished`` and ``record_iteration`` make it an
    ``AsyncLLM`` stat logger. ``get_stats`` and ``get_engine_stats`` are the engine's
    (``AsyncLLM``'s methods); ``names``: ``--metrics-names``; ``max_model_len`` bounds the
    buckets of token counts."""

    def __init__(
        self,
        get_stats: Callable[[], dict[str, int]],
        get_engine_stats: Callable[[], list[dict[str, int]]],
        model_name: str,
        names: str,
        max_model_len: int,
    ) -> None:
        if names not in PREFIXES:
            raise ValueError(f"--metrics-names must be one of {', '.join(PREFIXES)}, got {names!r}")
        disable_created_metrics()
        self.model_name = model_name
        self.names = names
        self.registry = CollectorRegistry()
        self.request_success = [
            Counter(
                full_name,
                "Finished requests, by finish reason.",
                ["model_name", "finished_reason"],
                registry=self.registry,
            )
            for full_name in series_names("request_success", names)
        ]
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Request latency, end to end.", LATENCY_BUCKETS
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS
        )
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Time from first scheduling to the first token.",
            LATENCY_BUCKETS,
        )
        self.decode_time = self._histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", LATENCY_BUCKETS
        )
        self.inference_time = self._histogram(
            "request_inference_time_seconds",
            "Time from first scheduling to the last token (prefill and decode).",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds",
            "Time between a completion's successive engine steps that brought it tokens.",
            TPOT_BUCKETS,
        )
        self.prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens of a request.", token_buckets
        )
        self.generation_tokens = self._histogram(
            "request_generation_tokens", "Tokens a request generated.", token_buckets
        )
        self.params_n = self._histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = self._histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", token_buckets
        )
        self.max_generation_tokens = self._histogram(
            "request_max_num_generation_tokens",
            "Most tokens a request may generate (its max_tokens).",
            token_buckets,
        )
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS
        )
        self.registry.register(EngineStatsCollector(get_stats, get_engine_stats, model_name, names))

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> list[Histogram]:
        return [
            Histogram(
                full_name, doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(self.model_name)
            for full_name in series_names(name, self.names)
        ]

    def record_finished(self, stats: RequestStats) -> None:
        for counter in self.request_success:
            counter.labels(self.model_name, stats.finish_reason).inc()
        observations = [
            (self.e2e, stats.e2e_latency),
            (self.ttft, stats.time_to_first_token),
            (self.tpot, stats.time_per_output_token),
            (self.queue_time, stats.queue_time),
            (self.prefill_time, stats.prefill_time),
            (self.decode_time, stats.decode_time),
            (self.inference_time, stats.inference_time),
            (self.prompt_tokens, stats.num_prompt_tokens),
            (self.generation_tokens, stats.num_generation_tokens),
            (self.params_n, stats.n),
            (self.params_max_tokens, stats.max_tokens),
            (self.max_generation_tokens, stats.max_tokens),
        ]
        for histograms, value in observations:
            if value is not None:
                for histogram in histograms:
                    histogram.observe(value)

    def record_iteration(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        if num_tokens:
            for histogram in self.iteration_tokens:
                histogram.observe(num_tokens)
        for latency in inter_token_latencies:
            for histogram in self.inter_token_latency:
                histogram.observe(latency)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
