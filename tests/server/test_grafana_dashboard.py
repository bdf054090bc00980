"""``docs/grafana/tokenmill.json``: a well-formed Grafana dashboard whose every query names
metrics that the server's ``/metrics`` renders (a real engine and ``PrometheusMetrics`` after
one request), so a renamed metric fails here rather than as an empty panel."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from conftest import make_tiny_checkpoint, save_byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.metrics import PrometheusMetrics
from tokenmill.sampling_params import SamplingParams

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "tokenmill.json"
METRIC = re.compile(r"tokenmill:[A-Za-z0-9_:]+")


def queries(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    out += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def rendered_names(tmp_path) -> set[str]:
    path = make_tiny_checkpoint(tmp_path / "m")
    save_byte_tokenizer(path)
    engine = AsyncLLM.from_engine_args(
        model=path, engine_process=False, num_kv_blocks=32, block_size=8, max_model_len=64
    )
    metrics = PrometheusMetrics(engine.get_stats, engine.get_engine_stats, "tiny", "both", 64)
    engine.stat_loggers.append(metrics)

    async def run() -> None:
        async for _ in engine.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True)):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    families = text_string_to_metric_families(metrics.render().decode())
    return {sample.name for family in families for sample in family.samples}


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name"}
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids)
        for target in panel["targets"]:
            assert 'model_name="$model_name"' in target["expr"], target["expr"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_every_metric_the_dashboard_names_exists(tmp_path):
    named = {
        name
        for query in queries(json.loads(DASHBOARD.read_text()))
        for name in METRIC.findall(query)
    }
    assert len(named) >= 10
    missing = named - rendered_names(tmp_path)
    assert not missing, f"the dashboard names metrics that /metrics does not render: {missing}"
