"""The draft-length policy: lengths follow acceptance and the measured cost of drafts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.core.draft_length_policy import PROBE_EVERY, REPROBE_MAX, DraftLengthPolicy, bucket_of
from tokenmill.entrypoints.openai.metrics import EngineStatsCollector


def _run(policy: DraftLengthPolicy, accepted: float, steps: int, num_running: int = 1) -> list[int]:
    """``steps`` steps of one request ``r`` whose drafts are accepted at rate ``accepted``
    (the first ``round(accepted * k)`` of ``k``); the lengths chosen."""
    chosen = []
    for _ in range(steps):
        k = policy.lengths(["r"], num_running).get("r", 0)
        chosen.append(k)
        if k:
            policy.observe_acceptance("r", k, round(accepted * k))
    return chosen


def test_rejected_drafts_drive_the_length_to_zero_and_accepted_ones_back_up():
    policy = DraftLengthPolicy(max_length=4, adaptive=True)
    rejected = _run(policy, 0.0, 400)
    assert rejected[0] == 4 and rejected[-REPROBE_MAX:].count(0) >= REPROBE_MAX - 2
    assert sum(rejected[100:]) <= 8  # only the backed-off one-token probes
    accepted = _run(policy, 1.0, 200)
    assert accepted[-20:].count(4) >= 18
    stats = policy.as_dict()
    assert sum(stats[f"spec_draft_length_{k}"] for k in range(5)) == 600
    assert stats["spec_draft_length_0"] > 300 and stats["spec_draft_length_4"] > 150


def test_high_acceptance_keeps_the_length_up_except_the_probe_steps():
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    chosen = _run(policy, 1.0, 10 * PROBE_EVERY)
    assert chosen.count(3) == len(chosen) - 10 and chosen.count(0) == 10


def test_drafts_that_cost_more_than_they_earn_stop_at_that_batch_size():
    """First drafts always accepted, second ones never; cost per step 1 + 0.02 x at one
    request (cheap drafts), 1 + 0.5 x at 8 requests (each draft costs more than the token it
    could save): drafts alone, none at 8, and the cut-off is reported."""
    policy = DraftLengthPolicy(max_length=2, adaptive=True)
    reqs = [f"r{i}" for i in range(8)]
    for n, slope in ((1, 0.02), (8, 0.5)):
        for step in range(60):
            lengths = policy.lengths(reqs[:n], n)
            for r, k in lengths.items():
                policy.observe_acceptance(r, k, 1)
            drafts = 2 * sum(lengths.values()) if step % 3 else 0
            policy.observe_step(n, drafts, 1 + slope * drafts)
    assert policy.lengths(reqs[:1], 1)["r0"] >= 1
    assert sum(policy.lengths(reqs, 8).values()) <= 1
    assert policy.cutoff() == 5 == policy.as_dict()["spec_disable_by_batch_size"]  # bucket 5..8
    assert bucket_of(1) == 0 and bucket_of(2) == 1 and bucket_of(4) == 2 and bucket_of(5) == 3


def test_fixed_lengths_and_the_configured_cutoff():
    policy = DraftLengthPolicy(max_length=3, adaptive=False, disable_by_batch_size=2)
    assert policy.lengths(["a"], 1) == {"a": 3}
    assert policy.lengths(["a", "b"], 2) == {}
    assert policy.as_dict() == {
        "spec_draft_length_0": 2, "spec_draft_length_1": 0, "spec_draft_length_2": 0,
        "spec_draft_length_3": 1, "spec_disable_by_batch_size": 2,
    }


def test_draft_lengths_are_exported_on_metrics():
    stats = {
        "spec_draft_length_0": 5, "spec_draft_length_1": 2, "spec_disable_by_batch_size": 4,
        "num_running_requests": 0, "num_waiting_requests": 0, "kv_blocks_total": 8, "kv_blocks_free": 8,
    }
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, lambda: [stats], "m", "vllm"))
    text = generate_latest(registry).decode()
    assert 'tokenmill:spec_decode_num_drafts_per_length_total{engine="0",length="0",model_name="m"} 5.0' in text
    assert 'tokenmill:spec_decode_num_drafts_per_length_total{engine="0",length="1",model_name="m"} 2.0' in text
    assert 'tokenmill:spec_decode_disable_by_batch_size{engine="0",model_name="m"} 4.0' in text
