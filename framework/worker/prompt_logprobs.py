"""Prompt logprobs, computed chunk by chunk as prompts are prefilled (vLLM's in-progress
prompt logprobs).

The hidden state at prompt position ``p`` gives the logprobs of prompt token ``p + 1``. Each
step computes those of the positions its chunk covers and keeps them by position, so a
prefill that is preempted and recomputed overwrites rather than repeats them. They are
handed over once, in the step whose chunk completes the prompt (the one that samples the
first token), and never again for that request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.logprobs import LogprobsLists
from tokenmill.sample.sampler import gather_logprobs

MAX_ROWS_PER_PASS = 256
"""Most positions whose vocabulary-wide logits exist at once."""


@dataclass
class PromptChunk:
    """One scheduled chunk of a request that wants prompt logprobs.

    Attributes:
        req_id: the request.
        num_logprobs: its ``prompt_logprobs`` (top-N).
        token_ids: its prompt token ids.
        start: first position of the chunk.
        num_tokens: tokens in the chunk.
        hidden_start: row of the chunk's first token in the step's hidden states.
    """

    req_id: str
    num_logprobs: int
    token_ids: list[int]
    start: int
    num_tokens: int
    hidden_start: int


@dataclass
class _InProgress:
    rows: dict[int, tuple[list[int], list[float], int]] = field(default_factory=dict)


class PromptLogprobs:
    """The prompt logprobs of the requests being prefilled."""

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute_logits = compute_logits
        self.in_progress: dict[str, _InProgress] = {}
        self.done: set[str] = set()

    def wants(self, req_id: str) -> bool:
        """Whether the request's prompt logprobs are still to be handed over."""
        return req_id not in self.done

    def process(self, chunks: list[PromptChunk], hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Compute the prompt logprobs of ``chunks`` from the step's ``hidden`` states; return
        those of the requests whose prompt this step completes, one row per prompt position
        after the first."""
        hidden_rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[_InProgress, int, int]] = []
        for chunk in chunks:
            entry = self.in_progress.setdefault(chunk.req_id, _InProgress())
            end = min(chunk.start + chunk.num_tokens, len(chunk.token_ids) - 1)
            for position in range(chunk.start, end):
                hidden_rows.append(chunk.hidden_start + position - chunk.start)
                targets.append(chunk.token_ids[position + 1])
                owners.append((entry, position, chunk.num_logprobs))
        if owners:
            num_top = max(n for _, _, n in owners)
            for first in range(0, len(owners), MAX_ROWS_PER_PASS):
                last = first + MAX_ROWS_PER_PASS
                self._compute(hidden, hidden_rows[first:last], targets[first:last], owners[first:last], num_top)
        finished = {}
        for chunk in chunks:
            if chunk.start + chunk.num_tokens >= len(chunk.token_ids):
                rows = self.in_progress.pop(chunk.req_id).rows
                lists = LogprobsLists()
                for position in range(len(chunk.token_ids) - 1):
                    ids, values, rank = rows[position]
                    lists.logprob_token_ids.append(ids)
                    lists.logprobs.append(values)
                    lists.ranks.append(rank)
                finished[chunk.req_id] = lists
                self.done.add(chunk.req_id)
        return finished

    def _compute(
        self,
        hidden: torch.Tensor,
        hidden_rows: list[int],
        targets: list[int],
        owners: list[tuple[_InProgress, int, int]],
        num_top: int,
    ) -> None:
        device = hidden.device
        index = torch.tensor(hidden_rows, dtype=torch.int64, device=device)
        logprobs = self.compute_logits(hidden[index]).to(torch.float32).log_softmax(dim=-1)
        target_ids = torch.tensor(targets, dtype=torch.int64, device=device)
        ids, values, ranks = gather_logprobs(logprobs, target_ids, num_top)
        for (entry, position, n), row_ids, row_values, rank in zip(
            owners, ids.cpu().tolist(), values.cpu().tolist(), ranks.cpu().tolist()
        ):
            entry.rows[position] = (row_ids[: 1 + n], row_values[: 1 + n], rank)

    def remove(self, req_id: str) -> None:
        """Forget a finished request."""
        self.in_progress.pop(req_id, None)
        self.done.discard(req_id)
