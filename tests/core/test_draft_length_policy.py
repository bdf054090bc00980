"""The draft-length policy: lengths follow acceptance and the measured cost of drafts."""

from __future__ import annotations

import random
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.core.draft_length_policy import (
    COLD_LENGTH,
    EARLY_PROBES,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    REPROBE_MAX,
    DraftLengthPolicy,
    StepCostFit,
    bucket_of,
)
from tokenmill.entrypoints.openai.metrics import EngineStatsCollector

ROOM = 1000
"""Drafts a request has room for: more than any test drafts."""


def _simulate(
    policy: DraftLengthPolicy,
    steps: int,
    accepted: Callable[[int], int],
    seconds: Callable[[int, int], float],
    requests: Callable[[int], dict[str, int]] = lambda step: {"r": ROOM},
) -> list[int]:
    """``steps`` engine steps of the requests ``requests(step)`` gives, each with its room
    for drafts: the drafts chosen at a step are proposed in it and verified in the next,
    where the first ``accepted(k)`` of ``k`` hold; a step that verified ``v`` drafts and
    proposed ``p`` takes ``seconds(v, p)``. The drafts chosen per step."""
    chosen: list[int] = []
    verified: dict[str, int] = {}
    reqs: list[str] = []
    for step in range(steps):
        previous, rooms = reqs, requests(step)
        reqs = list(rooms)
        for r in set(previous) - set(reqs):
            policy.finish(r)
        lengths = policy.lengths(rooms, len(reqs))
        for r, k in verified.items():
            policy.observe_acceptance(r, k, accepted(k))
        v, p = sum(verified.values()), sum(lengths.values())
        policy.observe_step(len(reqs), v, p, seconds(v, p))
        verified = {r: k for r, k in lengths.items() if r in reqs}
        chosen.append(p)
    return chosen


def _share(rate: float) -> Callable[[int], int]:
    return lambda k: round(rate * k)


def _cheap(v: int, p: int) -> float:
    return 1 + 0.01 * p + 0.002 * v


def test_rejected_drafts_drive_the_length_to_zero_and_accepted_ones_back_up():
    policy = DraftLengthPolicy(max_length=4, adaptive=True)
    rejected = _simulate(policy, 400, _share(0.0), _cheap)
    assert rejected[0] == COLD_LENGTH and rejected[-REPROBE_MAX:].count(0) >= REPROBE_MAX - 2
    assert sum(rejected[120:]) <= 8  # the backed-off one-token probes and the bucket's explorations
    accepted = _simulate(policy, 200, _share(1.0), _cheap)
    assert accepted[-20:].count(4) >= 17
    stats = policy.as_dict()
    assert sum(stats[f"spec_draft_length_{k}"] for k in range(5)) == 600
    assert stats["spec_draft_length_0"] > 300 and stats["spec_draft_length_4"] > 120


def test_a_proposer_as_costly_as_the_target_never_drafts_and_a_cheaper_one_starts_cold():
    """A draft token the proposer itself reckons costs a whole target step (a draft model as
    large as the target) can never pay, and measuring it would cost each new request a prefill
    of the draft model: no draft at any batch size. Below 1 the estimate is the break-even
    acceptance of the cold steps (the prior acceptance 0.7 clears 0.5, not 0.8)."""
    def accepted(k: int) -> int:
        return k

    def dear(v: int, p: int) -> float:
        return 1 + p + 0.1 * v

    for n in (1, 4):
        def requests(step: int, n: int = n) -> dict[str, int]:
            return {f"r{i}": ROOM for i in range(n)}

        policy = DraftLengthPolicy(max_length=3, adaptive=True, draft_cost=1.0)
        assert sum(_simulate(policy, 300, accepted, dear, requests)) == 0
        assert policy.as_dict()["spec_draft_length_0"] == 300 * n
    assert _simulate(DraftLengthPolicy(max_length=3, adaptive=True, draft_cost=0.5), 2, accepted, _cheap)[0] == COLD_LENGTH
    assert _simulate(DraftLengthPolicy(max_length=3, adaptive=True, draft_cost=0.8), 2, accepted, _cheap)[0] == 0


def test_short_requests_start_from_the_probe_interval_the_last_probe_left():
    """Drafts never accepted, each costing 0.3 of a step, requests of 24 steps one after
    another: once probes are rejected, a new request waits as long as the last probe left
    before probing (it probed again after 4 idle steps, so every short request paid for its
    own probes)."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    dear = lambda v, p: 1 + 0.15 * (v + p)  # noqa: E731
    chosen = _simulate(policy, 40 * 24, _share(0.0), dear, lambda step: {f"r{step // 24}": 22 - step % 24})
    assert sum(k > 0 for k in chosen[-20 * 24 :]) <= 3  # the bucket's explorations


def test_drafts_that_clearly_pay_never_pause():
    """Drafts always accepted, at a few per cent of a step: after the early steps without
    drafts that make the fit ready, every step drafts the most."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    chosen = _simulate(policy, 200, _share(1.0), _cheap)
    assert [s + 1 for s, k in enumerate(chosen) if k == 0] == list(EARLY_PROBES)
    assert chosen[: EARLY_PROBES[0] - 1] == [COLD_LENGTH] * (EARLY_PROBES[0] - 1)
    assert chosen[10:] == [3] * 190


def test_drafts_that_pay_by_a_margin_keep_drafting_through_runs_of_rejections():
    """An EAGLE head on unseen chat prompts: each draft accepted 42 % of the time (when the
    one before it was), one draft a step costing 0.26 of a step, so one draft pays (1.12x
    with one draft at every step) and a second about breaks even. Requests of 45 steps one
    after another. A request still drafts at more than 80 % of its steps: rejections in a row
    come a third of the time at that acceptance, and a per-request EWMA that fell below the
    break-even after two of them kept it from drafting in two steps of three."""
    rng = random.Random(0)

    def accepted(k: int) -> int:
        n = 0
        while n < k and rng.random() < 0.42:
            n += 1
        return n

    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    chosen = _simulate(
        policy, 40 * 45, accepted,
        lambda v, p: (1 + 0.05 * (p > 0) + 0.1 * p + 0.11 * v) * rng.uniform(0.9, 1.1),
        lambda step: {f"r{step // 45}": 43 - step % 45},
    )
    assert sum(k > 0 for k in chosen[100:]) > 0.8 * len(chosen[100:])
    assert sum(chosen[100:]) < 1.6 * len(chosen[100:])


def test_a_proposer_as_slow_as_the_target_stops_drafting_at_once():
    """A draft model as large as the target (each proposed token costs a whole step, each
    verified one a little): drafts never pay, however often accepted. Steps after a step
    without drafts still verify that step's, and steps before one propose none, so the fit
    must tell proposing from verifying (lumped together, the steps that only verified made
    drafts look cheap, and it drafted 3 tokens at every step)."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    chosen = _simulate(policy, 4 * EXPLORE_EVERY, _share(0.7), lambda v, p: 1 + (0.5 if p else 0) + p + 0.02 * v)
    *cold, (first, k), later = [(s, k) for s, k in enumerate(chosen) if k]
    assert len(cold) <= 4 and all(k == 1 for _, k in cold)  # then the fit finds no draft pays:
    assert first < 8 and k == 3 and later == (first + 2 * EXPLORE_EVERY, 3)  # it explores at once
    cost = policy.costs[0]
    assert abs(cost.a - 1) < 0.01 and cost.b + cost.m > 1.2 and cost.theta(1) > 1
    assert policy.cutoff() == 1


def test_drafts_that_cost_more_than_they_earn_stop_at_that_batch_size():
    """First drafts always accepted, second ones never; a proposed or verified token costs
    0.01 of a step at one request (cheap drafts), 0.5 at 8 requests (each draft costs more
    than the token it could save): drafts alone, none at 8, and the cut-off is reported."""
    policy = DraftLengthPolicy(max_length=2, adaptive=True)
    reqs = [f"r{i}" for i in range(8)]
    for n, slope in ((1, 0.01), (8, 0.5)):
        _simulate(
            policy, 60, lambda k: min(k, 1),
            lambda v, p, slope=slope: 1 + slope * (v + p), lambda step, n=n: dict.fromkeys(reqs[:n], ROOM),
        )
    assert policy.lengths({"r0": ROOM}, 1)["r0"] >= 1
    assert sum(policy.lengths(dict.fromkeys(reqs, ROOM), 8).values()) <= 1
    assert policy.cutoff() == 5 == policy.as_dict()["spec_disable_by_batch_size"]  # bucket 5..8
    assert bucket_of(1) == 0 and bucket_of(2) == 1 and bucket_of(4) == 2 and bucket_of(5) == 3


def test_a_new_batch_size_drafts_by_a_smaller_ones_cost_until_it_has_its_own():
    """Half the first drafts accepted; a draft token costs 0.1 of a step of 1 at 2 requests
    (theta 0.2: drafts pay). At 8 requests, until the bucket has a fit, the 2-request cost
    makes a draft worth it only at acceptance 0.8: requests draft nothing but one-token probes
    (they drafted a token each at every step, as where no bucket has a fit). Its own fit
    then finds a step of 2 there (theta 0.4), and drafts pay."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    flips = iter(range(10**6))
    half = lambda k: min(k, next(flips) % 2)  # noqa: E731
    reqs = [f"r{i}" for i in range(8)]
    chosen = _simulate(policy, 60, half, lambda v, p: 1 + 0.05 * (v + p), lambda step: dict.fromkeys(reqs[:2], ROOM))
    assert sum(chosen[-10:]) >= 10 and policy.costs[bucket_of(2)].theta(2) < 0.5
    eight = lambda step: dict.fromkeys(reqs, ROOM)  # noqa: E731
    chosen = _simulate(policy, 9, half, lambda v, p: 2 + 0.05 * (v + p), eight)
    assert chosen == [0] * 7 + [8, 0]  # the one-token probes, in one step
    cost = policy.fits[bucket_of(8)].cost()
    assert cost is not None and abs(cost.theta(8) - 0.4) < 0.01
    assert sum(_simulate(policy, 20, half, lambda v, p: 2 + 0.05 * (v + p), eight)[-10:]) >= 40


def test_a_new_batch_size_takes_a_smaller_ones_verdict_that_no_draft_pays():
    """Drafts never pay at 2 requests; at 4 (a bucket without a fit) none is drafted, not
    even explorations (the smaller bucket explores for it)."""
    policy = DraftLengthPolicy(max_length=3, adaptive=True)
    dear = lambda v, p: 1 + 0.5 * (v + p)  # noqa: E731
    _simulate(policy, 40, _share(1.0), dear, lambda step: dict.fromkeys("ab", ROOM))
    assert policy.cutoff() == 2
    chosen = _simulate(policy, 2 * EXPLORE_EVERY, _share(1.0), dear, lambda step: dict.fromkeys("abcd", ROOM))
    assert not any(chosen) and policy.fits[bucket_of(4)].cost() is None


def test_where_no_draft_pays_requests_do_not_probe_and_the_bucket_explores_rarely():
    """Four requests at a time, each replaced after 48 steps (staggered), whose drafts are half
    accepted; a step costs 1, or 2 + 0.05 per draft token as soon as it proposes or verifies
    any (on the CPU one draft can move a step off its decode graph). Once the fit shows that,
    no request drafts, not even the one-token probes of new requests, except all of them in
    full: at once (the cold steps' one-token drafts cannot tell the jump from a cost per
    token), then after twice EXPLORE_EVERY steps, and so on while drafts are not far from
    paying; the fit keeps its verdict in between. Where a draft costs twice as much and the
    jump is twice as high, drafts are far from paying, and the next exploration waits
    EXPLORE_MAX steps."""
    for jump, slope in ((1, 0.05), (2, 0.1)):
        policy = DraftLengthPolicy(max_length=3, adaptive=True)
        chosen = _simulate(
            policy, 12 * EXPLORE_EVERY, lambda k: k // 2,
            lambda v, p, jump=jump, slope=slope: 1 + jump + slope * (v + p) if v + p else 1.0,
            lambda step: {f"{i}-{(step + 12 * i) // 48}": ROOM for i in range(4)},
        )
        drafting = [(s, k) for s, k in enumerate(chosen) if k]
        first = drafting[2][0]
        far = jump == 2
        later = [] if far else [(first + 2 * EXPLORE_EVERY, 12), (first + 6 * EXPLORE_EVERY, 12)]
        assert drafting == [(0, 4), (1, 4), (first, 12), *later] and first < 8
        assert policy.explore_at[bucket_of(4)] == (first + 1 + EXPLORE_MAX if far else later[-1][0] + 1 + 8 * EXPLORE_EVERY)
        assert policy.cutoff() == (3 if far else 0)  # at 3 requests the milder drafts could pay


def test_the_cost_fit_tells_proposing_from_verifying_and_the_jumps_from_the_cost_per_draft():
    fit = StepCostFit()
    steps = [(0, 0), (0, 3), (3, 3), (3, 0), (0, 0), (0, 1), (1, 2), (2, 5), (5, 0), (0, 0), (0, 4), (4, 4)]
    for v, p in steps * 3:
        fit.add(v, p, 0.010 + (0.004 if p else 0.0) + (0.001 if v else 0.0) + 0.003 * p + 0.0005 * v)
    cost = fit.cost()
    assert cost is not None
    assert abs(cost.a - 0.01) < 1e-4 and abs(cost.b - 0.005) < 2e-4 and abs(cost.m - 0.0035) < 5e-5
    # four requests, three drafts expected to add 1.5 tokens: 1.5 * 0.01 / 4 < 0.005 + 3 * 0.0035
    assert not cost.pays(4, 1.5, 3) and cost.pays(1, 2.5, 3)
    assert StepCostFit().cost() is None


def test_a_fit_whose_steps_always_propose_and_verify_alike_is_still_solved():
    """Every drafting step both verifies and proposes k (the features of proposing and
    verifying are then collinear): the fit still gives the cost of a draft token, and
    does not raise."""
    fit = StepCostFit()
    for v, p in [(0, 0), (3, 3), (3, 3), (0, 0), (2, 2), (3, 3)] * 3:
        fit.add(v, p, 1.0 + (0.5 if p else 0.0) + 0.25 * (v + p))
    cost = fit.cost()
    assert cost is not None and abs(cost.a - 1) < 1e-3 and abs(cost.b + 2 * 3 * cost.m / 2 - 2) < 0.05


def test_a_fit_without_steps_that_draft_nothing_is_not_ready():
    fit = StepCostFit()
    for v, p in [(0, 3), (3, 3), (3, 0)] * 4:
        fit.add(v, p, 1.0 + v + p)
    assert fit.cost() is None


def test_fixed_lengths_and_the_configured_cutoff():
    policy = DraftLengthPolicy(max_length=3, adaptive=False, disable_by_batch_size=2)
    assert policy.lengths({"a": ROOM}, 1) == {"a": 3}
    assert policy.lengths({"a": ROOM, "b": ROOM}, 2) == {}
    assert policy.as_dict() == {
        "spec_draft_length_0": 2, "spec_draft_length_1": 0, "spec_draft_length_2": 0,
        "spec_draft_length_3": 1, "spec_disable_by_batch_size": 2,
    }


def test_drafts_stop_at_a_requests_room():
    """A request whose ``max_tokens`` leaves room for fewer drafts than the length drafts
    that many (the rest would be cut unverified), and one on its last token none: not even
    an adaptive probe, whose verdict would never arrive."""
    fixed = DraftLengthPolicy(max_length=3, adaptive=False)
    assert fixed.lengths({"a": 2, "b": 0, "c": ROOM}, 3) == {"a": 2, "c": 3}
    assert fixed.as_dict()["spec_draft_length_0"] == 1
    adaptive = DraftLengthPolicy(max_length=3, adaptive=True)
    chosen = _simulate(adaptive, 60, _share(1.0), _cheap)
    assert chosen[-1] == 3
    assert adaptive.lengths({"r": 1}, 1) == {"r": 1}
    assert adaptive.lengths({"r": 0}, 1) == {}


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


def test_a_jump_in_the_cost_of_drafting_is_not_charged_to_the_tokens():
    """Two requests whose drafts are never accepted; a step that proposes or verifies any
    draft costs 1.2 more than one without, each draft token 0.02. The cold steps' one-token
    drafts cannot tell the jump from a cost per token, and charged per token (0.6 each) no
    draft could pay: the bucket stopped drafting for 64 steps. It explores in full at once
    instead, and its fit finds the jump, which four drafts per request, all accepted, would
    pay for."""
    policy = DraftLengthPolicy(max_length=4, adaptive=True)
    chosen = _simulate(
        policy, 40, _share(0.0), lambda v, p: 2.2 + 0.02 * (v + p) if v + p else 1.0,
        lambda step: dict.fromkeys("ab", ROOM),
    )
    assert 8 in chosen[:10] and policy.cutoff() == 0
    cost = policy.costs[bucket_of(2)]
    assert cost.m < 0.2 and cost.b > 1.5


def test_an_exploration_among_one_draft_steps_does_not_make_drafts_look_dear():
    """The EAGLE head at one request, as measured on 2 AVX2 cores (mean ms per step): 39.2
    without drafts, 49.0 verifying one draft and proposing one, 48.8 proposing one after a
    step without (the head first catches up on the state it kept), 44.4 verifying one and
    proposing none; then one exploration, three drafts proposed (89.4) and verified (57.9).
    Least squares paid for the exploration with negative jumps, and clamped at 0 they left a
    draft at 28 ms, 0.72 of a step: no draft paid at the head's acceptance of 0.42 any more.
    Without negative jumps a draft costs about what a step of one draft costs over one
    without (9.8 ms)."""
    ms = {(0, 0): 39.2, (1, 1): 49.0, (0, 1): 48.8, (1, 0): 44.4, (0, 3): 89.4, (3, 0): 57.9}
    pattern = [(0, 0)] * 8 + [(0, 1)] + [(1, 1)] * 6 + [(1, 0)]
    fit = StepCostFit()
    for verified, proposed in pattern * 3 + [(0, 3), (3, 0)] + pattern * 3:
        fit.add(verified, proposed, ms[verified, proposed] / 1000)
    cost = fit.cost()
    assert cost is not None and 0.008 < cost.b + cost.m < 0.012
    assert cost.pays(1, 0.42, 1)
