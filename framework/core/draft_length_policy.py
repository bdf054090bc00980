"""How many tokens each request drafts after a step: fixed, or adaptive to what drafts earn.

Adaptive (``SpeculativeConfig.adaptive_draft_length``), per step with ``n`` running requests:

- **Acceptance**, per draft position ``j``: the share of verifications of position ``j``
  (when the positions before it were accepted) that accepted it. Engine-wide, over the last
  ~50 verifications of each position (``PRIOR_DECAY``); per request, its own decayed counts
  with the engine-wide share counted as ``PRIOR_WEIGHT`` verifications. A request's counts
  decay at every step it samples in, so one that stopped drafting drifts back to the
  engine-wide share. (An EWMA per request with weight 0.3 fell below the break-even after two
  rejections in a row, a third of the time at an acceptance of 0.4: the EAGLE heads drafted
  in a third of the steps where one draft a step paid 1.12x.) The chance that draft ``j`` is
  accepted is the product over positions ``0..j``.
- **Cost**, per batch-size bucket (1, 2, 3-4, 5-8, ...): an exponentially weighted least
  squares fit of the engine core's measured step seconds over decode-only steps,
  ``seconds = a + b_p [p > 0] + b_v [v > 0] + m_p p + m_v v`` for the ``p`` drafts the step
  proposed and the ``v`` it verified (a draft is proposed in one step and verified in the
  next; a step after one that drafted nothing verifies nothing, and one before a step that
  drafts nothing proposes nothing, and the two cost very differently: a draft model runs a
  whole forward per proposed token, a verified token is one more row of the target's). ``a /
  n`` is what one token costs without drafts, ``m = m_p + m_v`` what one draft token costs,
  ``b = b_p + b_v`` what drafting costs at all, however few drafts: running the proposer, and
  on the CPU a verification's extra rows can take a step off its decode graph onto eager
  kernels. A small ridge keeps the jumps at 0 while the steps cannot tell them from the
  per-token costs, and a jump the fit finds negative is held at 0 (``StepCostFit._solve``).
  Until the fit is ready (steps without drafts, steps that proposed, steps that verified), a
  request drafts at most ``COLD_LENGTH`` tokens, where its acceptance is at
  least ``PRIOR_THETA`` or the proposer's own estimate of a draft's cost
  (``Proposer.draft_cost``), whichever is higher. Where that estimate is 1 or more no draft
  can pay, and none is drafted to measure it: a draft model as large as the target would cost
  each new request a prefill of its own to find out.
- A request drafts the longest prefix of positions whose acceptance chance is at least
  ``theta = m n / a`` (0: none); when all its drafts were accepted, the estimate of the
  position after them moves toward the last one's (so the length can grow back, and be
  measured there). The step drafts only if the tokens its drafts are expected to add are worth
  their cost, ``expected * a / n >= b + m * drafted``; else nothing. A request at 0 drafts one
  token again after 4 steps, then after 8, 16, ... up to 64 while those probes are rejected,
  so that drafts come back when they pay again; a new request starts from the interval the
  last probe left (as from the engine-wide acceptance), so short requests do not each probe
  their way down from 4 steps again. A bucket whose fit has seen too few steps without
  drafts lately (``PAUSE_WEIGHT``) pauses, two steps without drafts, unless its drafts are
  expected to earn ``CLEAR_MARGIN`` times their cost (prompt lookup on a copy: a pause there
  loses more than any stale fit, and the bucket keeps the last cost its fit gave).

The batch-size cut-off follows: in a bucket where no draft would pay even if every one were
accepted (``theta >= 1``, or ``num_speculative_tokens`` drafts per request not worth ``b``
plus theirs), no request drafts, not even the one-token probes above (one request's probe
would cost the whole batch ``b``). After ``EXPLORE_EVERY`` steps of such a bucket each
request drafts ``num_speculative_tokens`` (an exploration), so that the fit keeps measuring
what drafts cost where the verdict is made, then after twice as many steps, and so on up to
``EXPLORE_MAX``. A fit that has seen only short drafts cannot tell a jump from a cost per
token, and its ridge charges the jump to the tokens, so a bucket that has not explored yet
explores at once when its own fit first finds that no draft pays. (At 2 requests on a noisy
host, steps with one draft per request once measured nearly as dear as steps with four;
charged per token, that stopped prompt lookup drafting on a copy after the cold steps, which
draft one token, and one-token explorations never showed otherwise.) As soon as the fit
finds drafts costing twice what they earn or more (an exploration itself can show it), the next one waits
``EXPLORE_MAX`` steps after the last; between those steps the bucket keeps the last verdict its
fit gave. A bucket without a fit of its own takes the nearest smaller bucket's cost, and does
not explore: at more requests a step costs more, so that cost makes drafts look dearer than
they are (``theta = m n / a`` with the smaller ``a``), never cheaper; a request drafts at most
``COLD_LENGTH`` tokens only where no bucket has a fit yet. ``disable_by_batch_size``, given,
still caps it.

Fixed: every request drafts ``num_speculative_tokens`` (fewer where its room is less) while
fewer than ``disable_by_batch_size`` requests run (vLLM's behaviour).

Either way a request drafts no more than its room: the tokens its ``max_tokens`` and the model
length leave after the one it samples (none on its last step)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

PRIOR_DECAY = 0.98
"""Weight the engine's earlier verifications of a draft position keep at each new one."""
PRIOR_WEIGHT = 10.0
"""Verifications the engine-wide acceptance counts as in a request's estimate."""
REQUEST_DECAY = 0.9
"""Weight a request's earlier verifications keep at each step it samples in (so a request
that stopped drafting drifts back to the engine-wide acceptance)."""
PRIOR_ACCEPTANCE, FIRST_WEIGHT = 0.7, 3.0
"""The engine-wide acceptance before any verification, counted as ``FIRST_WEIGHT``
verifications (a few early rejections in a row must not stop a fresh engine's drafts: then
only the rare probes would measure them)."""
PRIOR_THETA = 0.2
"""Break-even acceptance of a bucket whose cost fit is not ready."""
COST_DECAY = 0.97
"""Weight kept by a bucket's earlier step timings at each new one."""
MIN_FIT_WEIGHT = 5.0
"""Weighted step count a bucket's cost fit needs."""
MIN_KIND_WEIGHT = 0.5
"""Weighted count of steps without drafts, of steps that proposed and of steps that verified,
a fit needs."""
PAUSE_WEIGHT = 0.6
"""A bucket whose fit holds less than this weighted count of steps without drafts pauses:
drafts nothing until it has one more (two steps: the first still verifies the drafts before
it)."""
CLEAR_MARGIN = 2.0
"""Drafts expected to earn this many times their cost or more do not pause (a pause's lost
drafts cost more than a stale fit could)."""
EARLY_PROBES = (3, 4)
"""Steps of a bucket that draft nothing, so that its fit is ready early."""
COLD_LENGTH = 1
"""The most a request drafts in a bucket whose fit is not ready."""
PROBE_SYNC = 16
"""A request's one-token probe that does not pay for its step waits for a step with drafts
that do, or for one in this many (so that the probes of several requests share a step)."""
EXPLORE_EVERY, EXPLORE_MAX = 64, 4096
"""In a bucket where no draft pays, a step drafts in full for every request after this many steps,
then after twice as many, ... up to ``EXPLORE_MAX`` while no draft pays; ``EXPLORE_MAX`` after
the last as soon as drafts are found far from paying (an exploration can be dear: a draft
model first catches up on every token since its request last drafted, its whole prompt for a
request that never did, and that step's cost shows it)."""
FAR_FROM_PAYING = 2.0
"""Drafts that would cost this many times what they earn at best are far from paying."""
REPROBE_FIRST, REPROBE_MAX = 4, 64
"""Steps a request without drafts waits before drafting one token again, doubled after each
rejected probe."""


def bucket_of(num_reqs: int) -> int:
    """Batch-size bucket: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return max(num_reqs - 1, 0).bit_length()


@dataclass(frozen=True)
class StepCost:
    """A bucket's fitted step seconds, a drafting round's cost summed over the step that
    proposes the drafts and the one that verifies them.

    Attributes:
        a: a step without drafts.
        b: what drafting costs at all, however few drafts (running the proposer; on the CPU a
            verification's extra rows can take a step off its decode graph).
        m: what each draft token costs (proposed, then verified).
    """

    a: float
    b: float
    m: float

    def theta(self, num_reqs: int) -> float:
        """The acceptance chance at which one more draft token pays: ``m n / a``."""
        return self.m * num_reqs / self.a

    def pays(self, num_reqs: int, expected: float, drafted: int) -> bool:
        """Whether ``drafted`` draft tokens expected to add ``expected`` tokens are worth
        their time."""
        return expected * self.a / num_reqs >= self.b + self.m * drafted


def _features(verified: int, proposed: int) -> np.ndarray:
    out: np.ndarray = np.array(
        [1.0, float(proposed > 0), float(verified > 0), float(proposed), float(verified)]
    )
    return out


_JUMPS = np.diag([0.0, 1.0, 1.0, 0.0, 0.0])
"""The fit's ridge: the two jumps, which the steps may not tell from the per-token costs (all
drafting steps of one length), stay 0 then."""
_IS_JUMP = np.diag(_JUMPS) > 0
RIDGE = 1e-3


@dataclass
class StepCostFit:
    """Exponentially weighted least squares of step seconds on ``[1, p > 0, v > 0, p, v]`` for
    ``p`` drafts proposed and ``v`` verified in the step (proposing a draft and verifying it
    cost very differently, and a step often does only one of them), with a small ridge on the
    two jumps."""

    w: float = 0.0
    kinds: np.ndarray = field(default_factory=lambda: np.zeros(3))
    ff: np.ndarray = field(default_factory=lambda: np.zeros((5, 5)))
    ft: np.ndarray = field(default_factory=lambda: np.zeros(5))

    def add(self, verified: int, proposed: int, t: float) -> None:
        f = _features(verified, proposed)
        self.w = self.w * COST_DECAY + 1
        self.kinds = self.kinds * COST_DECAY + np.array([not (verified or proposed), proposed > 0, verified > 0])
        self.ff = self.ff * COST_DECAY + np.outer(f, f)
        self.ft = self.ft * COST_DECAY + f * t

    def cost(self) -> StepCost | None:
        """The fitted cost; None until the fit has steps without drafts, steps that proposed
        and steps that verified."""
        if self.w < MIN_FIT_WEIGHT or self.kinds.min() < MIN_KIND_WEIGHT:
            return None
        a, b_propose, b_verify, m_propose, m_verify = self._solve()
        if a <= 0:
            return None
        return StepCost(
            float(a), float(b_propose + b_verify),
            max(float(m_propose), 0.0) + max(float(m_verify), 0.0),
        )

    def _solve(self) -> np.ndarray:
        """The least squares solution with no negative jump: a jump it finds negative is
        dropped (held at 0) and the rest solved again. Clamped after the solution instead,
        the per-token costs would keep what the negative jump took off them: one
        exploration among steps of one draft each (its three drafts proposed where the head
        first catches up) had the fit pay for it with jumps of -14 and -5 ms and a draft at
        28 ms, three times what a step of one draft cost over one without."""
        ff = self.ff + RIDGE * self.w * _JUMPS
        keep: np.ndarray = np.ones(len(self.ft), dtype=bool)
        while True:
            solution = np.zeros(len(self.ft))
            solution[keep] = np.linalg.lstsq(ff[np.ix_(keep, keep)], self.ft[keep], rcond=None)[0]
            negative = keep & _IS_JUMP & (solution < 0)
            if not negative.any():
                return solution
            keep &= ~negative


@dataclass
class _Request:
    """A request's decayed counts of accepted drafts and of verified ones per position."""

    hits: list[float]
    trials: list[float]
    idle: int = 0
    reprobe_after: int = REPROBE_FIRST
    probing: bool = False


@dataclass
class DraftLengthPolicy:
    """Chooses each request's draft length (see the module docstring).

    Attributes:
        max_length: ``num_speculative_tokens``.
        adaptive: adaptive lengths (else ``max_length`` for all).
        disable_by_batch_size: no drafts with this many running requests or more (0: no cap).
        draft_cost: the proposer's estimate of a draft token's cost before any is timed, as a
            share of a one-request target step (``Proposer.draft_cost``).
        length_counts: how often each length was chosen for a request (index = length).
    """

    max_length: int
    adaptive: bool
    disable_by_batch_size: int = 0
    draft_cost: float = 0.0
    length_counts: list[int] = field(default_factory=list)
    prior_hits: list[float] = field(default_factory=list)
    prior_trials: list[float] = field(default_factory=list)
    fits: dict[int, StepCostFit] = field(default_factory=dict)
    costs: dict[int, StepCost] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    explore_at: dict[int, int] = field(default_factory=dict)
    explore_gaps: dict[int, int] = field(default_factory=dict)
    requests: dict[str, _Request] = field(default_factory=dict)
    explored: set[int] = field(default_factory=set)
    """Buckets that have explored (drafted in full for every request)."""
    reprobe_first: int = REPROBE_FIRST
    """The interval new requests probe after: the one the last probe left."""

    def __post_init__(self) -> None:
        self.length_counts = [0] * (self.max_length + 1)
        self.prior_hits = [PRIOR_ACCEPTANCE * FIRST_WEIGHT] * self.max_length
        self.prior_trials = [FIRST_WEIGHT] * self.max_length
        if self.adaptive and self.draft_cost >= 1:
            logger.warning(
                "speculative decoding drafts nothing: the proposer reckons a draft token costs "
                "%.2f of a target step (Proposer.draft_cost), so no draft can pay",
                self.draft_cost,
            )

    def lengths(self, rooms: dict[str, int], num_running: int) -> dict[str, int]:
        """The draft length of each request that samples this step (``rooms``: the most
        drafts each could still use, as its ``max_tokens`` and the model length leave room for)
        after it; those without drafts are left out. A request without room drafts nothing,
        not even a probe."""
        req_ids = [r for r, room in rooms.items() if room > 0]
        if 0 < self.disable_by_batch_size <= num_running:
            out = {}
        elif self.adaptive:
            out = self._adaptive(req_ids, rooms, num_running)
        else:
            out = self._in_full(req_ids, rooms)
        self.length_counts[0] += len(rooms) - len(out)
        for length in out.values():
            self.length_counts[length] += 1
        return out

    def _in_full(self, req_ids: list[str], rooms: dict[str, int]) -> dict[str, int]:
        """``num_speculative_tokens`` for each request, fewer where its room is less."""
        return {r: min(self.max_length, rooms[r]) for r in req_ids}

    def _adaptive(self, req_ids: list[str], rooms: dict[str, int], num_running: int) -> dict[str, int]:
        bucket = bucket_of(num_running)
        step = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                req = self.requests[req_id] = _Request(
                    [0.0] * self.max_length, [0.0] * self.max_length, reprobe_after=self.reprobe_first
                )
            req.hits = [h * REQUEST_DECAY for h in req.hits]
            req.trials = [t * REQUEST_DECAY for t in req.trials]
        own = self._cost(bucket)
        cost = own or next(filter(None, map(self._cost, reversed(range(bucket)))), None)
        if cost is not None:
            pays: bool | None = self._can_pay(cost, num_running)
        else:
            pays = False if self.draft_cost >= 1 else None
        out: dict[str, int] = {}
        if step not in EARLY_PROBES and pays is not False:
            out = self._drafts(req_ids, rooms, num_running, cost, step, self._pause(bucket))
        gap = self.explore_gaps.get(bucket, EXPLORE_EVERY)
        if out:
            self.explore_gaps[bucket] = EXPLORE_EVERY
            self.explore_at[bucket] = step + EXPLORE_EVERY
        elif own is not None:
            due = self.explore_at.setdefault(bucket, gap + 1)
            if not pays and gap < EXPLORE_MAX and self._far_from_paying(own, num_running):
                due = self.explore_at[bucket] = due - gap + EXPLORE_MAX
                gap = self.explore_gaps[bucket] = EXPLORE_MAX
            if req_ids and (step >= due or not pays and bucket not in self.explored):
                self.explored.add(bucket)
                out = self._in_full(req_ids, rooms)
                self.explore_gaps[bucket] = min(2 * gap, EXPLORE_MAX)
                self.explore_at[bucket] = step + self.explore_gaps[bucket]
        return out

    def _drafts(
        self, req_ids: list[str], rooms: dict[str, int], num_running: int, cost: StepCost | None, step: int,
        pause: bool,
    ) -> dict[str, int]:
        """Each request's longest paying run of drafts, none if together they do not pay for
        the step; the one-token probes due, if they pay or other drafts do, else every
        ``PROBE_SYNC``-th step."""
        theta = max(PRIOR_THETA, self.draft_cost) if cost is None else cost.theta(num_running)
        out: dict[str, int] = {}
        expected = 0.0
        for req_id in req_ids:
            req = self.requests[req_id]
            length, chance = 0, 1.0
            for j in range(min(self.max_length if cost is not None else COLD_LENGTH, rooms[req_id])):
                chance *= self._acceptance(req, j)
                if chance < theta:
                    break
                length += 1
                expected += chance
            if length:
                out[req_id] = length
        if cost is not None and out and not cost.pays(num_running, expected, sum(out.values())):
            out = {}
        if pause and not (
            cost is not None and out and cost.pays(num_running, expected / CLEAR_MARGIN, sum(out.values()))
        ):
            return {}
        due = []
        for req_id in req_ids:
            req = self.requests[req_id]
            if req_id in out:
                req.idle, req.reprobe_after = 0, REPROBE_FIRST
                continue
            req.idle += 1
            if req.idle >= req.reprobe_after:
                due.append(req_id)
        if due and (
            out
            or step % PROBE_SYNC == PROBE_SYNC // 2
            or cost is None
            or cost.pays(num_running, sum(self._acceptance(self.requests[r], 0) for r in due), len(due))
        ):
            for req_id in due:
                req = self.requests[req_id]
                req.idle, req.probing = 0, True
                out[req_id] = 1
        return out

    def _acceptance(self, req: _Request, j: int) -> float:
        """The chance that ``req``'s draft at position ``j`` is accepted when those before it
        are: its own decayed counts, with the engine-wide acceptance counted as
        ``PRIOR_WEIGHT`` verifications."""
        prior = self.prior_hits[j] / self.prior_trials[j]
        return (prior * PRIOR_WEIGHT + req.hits[j]) / (PRIOR_WEIGHT + req.trials[j])

    def _pause(self, bucket: int) -> bool:
        """Whether the bucket's fit has seen too few steps without drafts lately (then two
        steps draft nothing: the second verifies none either)."""
        fit = self.fits.get(bucket)
        return fit is not None and fit.w >= MIN_FIT_WEIGHT and fit.kinds[0] < PAUSE_WEIGHT

    def _cost(self, bucket: int) -> StepCost | None:
        """The bucket's fitted cost, else the last one its fit gave (a bucket that stopped
        drafting stops feeding its fit), else None."""
        fit = self.fits.get(bucket)
        cost = fit.cost() if fit is not None else None
        if cost is None:
            return self.costs.get(bucket)
        self.costs[bucket] = cost
        return cost

    def _far_from_paying(self, cost: StepCost, num_reqs: int) -> bool:
        """Whether drafts would cost ``FAR_FROM_PAYING`` times what they earn or more at
        ``num_reqs`` requests, all of them drafting ``max_length`` tokens, every one accepted."""
        drafted = num_reqs * self.max_length
        return cost.b + cost.m * drafted >= FAR_FROM_PAYING * drafted * cost.a / num_reqs

    def _can_pay(self, cost: StepCost, num_reqs: int) -> bool:
        """Whether any draft could pay at ``num_reqs`` requests: all of them drafting
        ``max_length`` tokens, every one accepted."""
        drafted = num_reqs * self.max_length
        return cost.theta(num_reqs) < 1 and cost.pays(num_reqs, drafted, drafted)

    def observe_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` drafts of which the first ``num_accepted`` held."""
        req = self.requests.get(req_id)
        for j in range(min(num_accepted + 1, num_drafts)):
            hit = float(j < num_accepted)
            self.prior_hits[j] = self.prior_hits[j] * PRIOR_DECAY + hit
            self.prior_trials[j] = self.prior_trials[j] * PRIOR_DECAY + 1
            if req is not None:
                req.hits[j] += hit
                req.trials[j] += 1
        if req is not None and 0 < num_drafts == num_accepted < self.max_length:
            last = self._acceptance(req, num_drafts - 1)
            if last > self._acceptance(req, num_drafts):
                req.hits[num_drafts] += last
                req.trials[num_drafts] += 1
        if req is not None and req.probing:
            req.probing = False
            req.reprobe_after = self.reprobe_first = (
                REPROBE_FIRST if num_accepted else min(2 * req.reprobe_after, REPROBE_MAX)
            )

    def observe_step(self, num_reqs: int, verified: int, proposed: int, seconds: float) -> None:
        """A decode-only step of ``num_reqs`` requests that verified ``verified`` drafts and
        proposed ``proposed``, in ``seconds``."""
        if self.adaptive and num_reqs:
            self.fits.setdefault(bucket_of(num_reqs), StepCostFit()).add(verified, proposed, seconds)

    def finish(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def cutoff(self) -> int:
        """The smallest batch size from which no draft pays (by the fits, or
        ``disable_by_batch_size``), 0 when none is known."""
        sizes = [self.disable_by_batch_size] if self.disable_by_batch_size else []
        for bucket in self.fits:
            low = 1 if bucket == 0 else (1 << (bucket - 1)) + 1
            cost = self._cost(bucket)
            if cost is not None and not self._can_pay(cost, low):
                sizes.append(low)
        return min(sizes, default=0)

    def as_dict(self) -> dict[str, int]:
        """``spec_draft_length_<k>`` for each length ``k`` (0: no draft) and
        ``spec_disable_by_batch_size`` (``cutoff``)."""
        out = {f"spec_draft_length_{k}": n for k, n in enumerate(self.length_counts)}
        out["spec_disable_by_batch_size"] = self.cutoff()
        return out
