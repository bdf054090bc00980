"""Log-probabilities as vLLM returns them: ``Logprob`` objects keyed by token id, one dict per
position, and ``LogprobsLists``, the plain form they cross the engine-core boundary in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: the log-probability.
        rank: 1 + the number of tokens more likely than this one (1 = the most likely).
        decoded_token: the token's text, decoded on its own; None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt position; the first is None (no token precedes it)."""
SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token."""


@dataclass
class LogprobsLists:
    """Log-probabilities of several positions as plain lists (vLLM's ``LogprobsLists``).

    Row ``i`` holds position ``i``'s token (the sampled or the prompt token) first, then the
    top-N tokens by log-probability, descending; N may differ between requests, not rows.

    Attributes:
        logprob_token_ids: per row, the token ids.
        logprobs: per row, their log-probabilities.
        ranks: per row, the rank of the row's first token.
    """

    logprob_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, end: int | None = None) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


def make_logprob_dicts(
    lists: LogprobsLists, decode: Callable[[int], str | None]
) -> list[dict[int, Logprob]]:
    """One ``{token_id: Logprob}`` dict per row: the row's token with its rank, and the top-N
    with ranks 1..N (as in vLLM, a top-N entry wins when the row's token is among them)."""
    out = []
    for ids, values, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.ranks):
        ranks = [rank, *range(1, len(ids))]
        out.append(
            {t: Logprob(lp, r, decode(t)) for t, lp, r in zip(ids, values, ranks)}
        )
    return out
