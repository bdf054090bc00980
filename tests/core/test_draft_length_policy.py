"""The draft-length policy: lengths follow acceptance and the measured cost of drafts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.core.draft_length_policy import (
    EARLY_PROBES,
    EXPLORE_EVERY,
    PROBE_EVERY,
    REPROBE_MAX,
    DraftLengthPolicy,
    StepCostFit,
    bucket_of,
)
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
    probes = 10 + len(EARLY_PROBES)
    assert chosen.count(3) == len(chosen) - probes and chosen.count(0) == probes


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


def test_where_no_draft_pays_requests_do_not_probe_and_the_bucket_explores_rarely():
    """Four requests at a time, each replaced after 48 steps (staggered), whose drafts are half
    accepted; a step costs 1, or 2 + 0.05 per draft token as soon as it has any (on the CPU
    one draft can move a step off its decode graph). Once the fit shows that, no request
    drafts, not even the one-token probes of new requests, except all of them one token on
    every EXPLORE_EVERY-th step, and the fit keeps its verdict in between."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    verified: dict[str, int] = {}
    drafting_steps = []
    reqs: list[str] = []
    for step in range(12 * EXPLORE_EVERY):
        previous, reqs = reqs, [f"{i}-{(step + 12 * i) // 48}" for i in range(4)]
        for r in set(previous) - set(reqs):
            policy.finish(r)
        lengths = policy.lengths(reqs, 4)
        for r, k in verified.items():
            policy.observe_acceptance(r, k, k // 2)
        drafts = sum(verified.values()) + sum(lengths.values())
        policy.observe_step(4, drafts, 2 + 0.05 * drafts if drafts else 1.0)
        verified = lengths
        if lengths:
            drafting_steps.append(step)
    late = [s for s in drafting_steps if s >= 4 * EXPLORE_EVERY]
    assert late == [s for s in range(4 * EXPLORE_EVERY, 12 * EXPLORE_EVERY) if s % EXPLORE_EVERY == 0]
    assert policy.cutoff() == 3


def test_the_cost_fit_tells_the_jump_of_a_drafting_step_from_the_cost_per_draft():
    fit = StepCostFit()
    for x in [0, 0, 2, 5, 9, 0, 3, 12, 0, 6] * 3:
        fit.add(x, 0.010 + (0.005 if x else 0.0) + 0.0005 * x)
    cost = fit.cost()
    assert cost is not None
    assert (round(cost.a, 6), round(cost.b, 6), round(cost.m, 6)) == (0.01, 0.005, 0.0005)
    # four requests, three drafts expected to add 1.5 tokens: 1.5 * 0.01 / 4 < 2 * (0.005 + 3 * 0.0005)
    assert not cost.pays(4, 1.5, 3) and cost.pays(1, 1.5, 3)


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
