"""How many tokens each request drafts after a step: fixed, or adaptive to what drafts earn.

Adaptive (``SpeculativeConfig.adaptive_draft_length``), per step with ``n`` running requests:

- **Acceptance**, per request and draft position ``j``: an EWMA of whether position ``j`` was
  accepted when the positions before it were (new requests start from the engine-wide EWMA).
  The chance that draft ``j`` is accepted is the product over positions ``0..j``.
- **Cost**, per batch-size bucket (1, 2, 3-4, 5-8, ...): an exponentially weighted least
  squares fit of the engine core's measured step seconds on the draft tokens the step handled
  (verified plus proposed), over decode-only steps: ``seconds = a + m * drafts``. ``a / n``
  is what one token costs without drafts, ``2 m`` what one draft token costs (it is proposed in
  one step and verified in the next), so draft position ``j`` pays while its acceptance chance
  is at least ``theta = 2 m n / a``.
- A request drafts the longest prefix of positions that pay (0: none); when all its drafts
  were accepted, the estimate of the position after them moves toward the last one's (so the
  length can grow back, and be measured there). A request at 0 drafts
  one token again after 4 steps, then after 8, 16, ... up to 64 while those probes are
  rejected, so that drafts come back when they pay again. One step in ``PROBE_EVERY`` of a
  bucket drafts nothing, so that the fit sees steps without drafts.

The batch-size cut-off follows: in a bucket where ``theta >= 1`` no draft pays, and nothing is
drafted there but the probes. ``disable_by_batch_size``, given, still caps it.

Fixed: every request drafts ``num_speculative_tokens`` while fewer than
``disable_by_batch_size`` requests run (vLLM's behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ACCEPTANCE_ALPHA = 0.3
"""Weight of a request's newest verification in its acceptance EWMA."""
PRIOR_ALPHA = 0.05
"""Weight of any verification in the engine-wide acceptance EWMA new requests start from."""
PRIOR_ACCEPTANCE = 0.7
"""The engine-wide acceptance before any verification."""
PRIOR_THETA = 0.2
"""Break-even acceptance of a bucket whose cost fit is not ready."""
COST_DECAY = 0.97
"""Weight kept by a bucket's earlier step timings at each new one."""
MIN_FIT_WEIGHT = 6.0
"""Weighted step count a bucket's cost fit needs."""
MIN_FIT_VARIANCE = 0.25
"""Variance of the draft tokens per step a bucket's cost fit needs (it needs steps with few and
many drafts)."""
PROBE_EVERY = 16
"""One step in this many of a bucket drafts nothing."""
REPROBE_FIRST, REPROBE_MAX = 4, 64
"""Steps a request without drafts waits before drafting one token again, doubled after each
rejected probe."""


def bucket_of(num_reqs: int) -> int:
    """Batch-size bucket: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return max(num_reqs - 1, 0).bit_length()


@dataclass
class StepCostFit:
    """Exponentially weighted least squares of step seconds ``t`` on draft tokens ``x``."""

    w: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    st: float = 0.0
    sxt: float = 0.0

    def add(self, x: float, t: float) -> None:
        d = COST_DECAY
        self.w = self.w * d + 1
        self.sx = self.sx * d + x
        self.sxx = self.sxx * d + x * x
        self.st = self.st * d + t
        self.sxt = self.sxt * d + x * t

    def theta(self, num_reqs: int) -> float | None:
        """The break-even acceptance ``2 m n / a``; None until the fit is ready."""
        if self.w < MIN_FIT_WEIGHT:
            return None
        mx, mt = self.sx / self.w, self.st / self.w
        var = self.sxx / self.w - mx * mx
        if var < MIN_FIT_VARIANCE:
            return None
        m = (self.sxt / self.w - mx * mt) / var
        a = mt - m * mx
        if a <= 0:
            return None
        return max(2 * m * num_reqs / a, 0.0)


@dataclass
class _Request:
    accept: list[float]
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
        length_counts: how often each length was chosen for a request (index = length).
    """

    max_length: int
    adaptive: bool
    disable_by_batch_size: int = 0
    length_counts: list[int] = field(default_factory=list)
    prior: list[float] = field(default_factory=list)
    fits: dict[int, StepCostFit] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    requests: dict[str, _Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.length_counts = [0] * (self.max_length + 1)
        self.prior = [PRIOR_ACCEPTANCE] * self.max_length

    def lengths(self, req_ids: list[str], num_running: int) -> dict[str, int]:
        """The draft length of each of ``req_ids`` (requests that sample this step) after it;
        those without drafts are left out."""
        capped = 0 < self.disable_by_batch_size <= num_running
        if not self.adaptive or capped:
            length = 0 if capped else self.max_length
            self.length_counts[length] += len(req_ids)
            return {r: length for r in req_ids} if length else {}
        bucket = bucket_of(num_running)
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        probe = self.steps[bucket] % PROBE_EVERY == 0
        fit = self.fits.get(bucket)
        theta = fit.theta(num_running) if fit is not None else None
        theta = PRIOR_THETA if theta is None else theta
        out = {}
        for req_id in req_ids:
            length = 0 if probe else self._length(req_id, theta)
            self.length_counts[length] += 1
            if length:
                out[req_id] = length
        return out

    def _length(self, req_id: str, theta: float) -> int:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = _Request(list(self.prior))
        length, chance = 0, 1.0
        for p in req.accept:
            chance *= p
            if chance < theta:
                break
            length += 1
        if length:
            req.idle, req.reprobe_after = 0, REPROBE_FIRST
            return length
        req.idle += 1
        if req.idle < req.reprobe_after:
            return 0
        req.idle, req.probing = 0, True
        return 1

    def observe_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` drafts of which the first ``num_accepted`` held."""
        req = self.requests.get(req_id)
        for j in range(min(num_accepted + 1, num_drafts)):
            hit = float(j < num_accepted)
            self.prior[j] += PRIOR_ALPHA * (hit - self.prior[j])
            if req is not None:
                req.accept[j] += ACCEPTANCE_ALPHA * (hit - req.accept[j])
        if req is not None and 0 < num_drafts == num_accepted < self.max_length:
            gap = req.accept[num_drafts - 1] - req.accept[num_drafts]
            req.accept[num_drafts] += ACCEPTANCE_ALPHA * max(gap, 0.0)
        if req is not None and req.probing:
            req.probing = False
            req.reprobe_after = REPROBE_FIRST if num_accepted else min(2 * req.reprobe_after, REPROBE_MAX)

    def observe_step(self, num_reqs: int, num_draft_tokens: int, seconds: float) -> None:
        """A decode-only step of ``num_reqs`` requests that verified and proposed
        ``num_draft_tokens`` drafts in all, in ``seconds``."""
        if self.adaptive and num_reqs:
            self.fits.setdefault(bucket_of(num_reqs), StepCostFit()).add(num_draft_tokens, seconds)

    def finish(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def cutoff(self) -> int:
        """The smallest batch size from which no draft pays (the fits' ``theta >= 1``, or
        ``disable_by_batch_size``), 0 when none is known."""
        sizes = [self.disable_by_batch_size] if self.disable_by_batch_size else []
        for bucket, fit in self.fits.items():
            low = 1 if bucket == 0 else (1 << (bucket - 1)) + 1
            theta = fit.theta(low)
            if theta is not None and theta >= 1:
                sizes.append(low)
        return min(sizes, default=0)

    def as_dict(self) -> dict[str, int]:
        """``spec_draft_length_<k>`` for each length ``k`` (0: no draft) and
        ``spec_disable_by_batch_size`` (``cutoff``)."""
        out = {f"spec_draft_length_{k}": n for k, n in enumerate(self.length_counts)}
        out["spec_disable_by_batch_size"] = self.cutoff()
        return out
