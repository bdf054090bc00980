"""The speculative-decoding proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ProposalBatch:
    """What a proposer sees of the running batch after a step."""

    req_ids: list[str]
    token_ids: list[list[int]]  # each request's prompt + accepted output so far
    num_speculative_tokens: int
    hidden_states: torch.Tensor | None = None  # last-layer states of the sampled positions


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None  # [num_reqs, k, vocab] where the method has them


class Proposer(ABC):
    """Drafts tokens for each running request; the target model verifies them in one step."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def load_model(self, target: nn.Module) -> None:
        """Load or attach the draft model (a no-op for model-free methods)."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> Proposal: ...
