"""Counters of speculative decoding, kept by the scheduler (vLLM's ``SpecDecodingStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started.

    Attributes:
        num_drafts: verification steps of a request that had drafts.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted drafts by their position (0 = first draft).
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def as_dict(self) -> dict[str, int]:
        """``spec_num_drafts``, ``spec_num_draft_tokens``, ``spec_num_accepted_tokens`` and
        ``spec_num_accepted_tokens_pos_<i>`` for each draft position ``i``."""
        out = {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
        }
        for pos, n in enumerate(self.num_accepted_tokens_per_pos):
            out[f"spec_num_accepted_tokens_pos_{pos}"] = n
        return out
