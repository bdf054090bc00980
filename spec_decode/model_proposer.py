"""What the proposers that run a model of their own (``draft_model``, ``eagle``, ``eagle3``,
``mtp``) share: the model's KV caches laid over the target's blocks, its attention metadata,
and the loop of single-token draft steps after a first pass over the target step.

With ``prompt_lookup_min``/``_max`` in the config, a request whose tokens end in a suffix that
occurred before takes the ``ngram`` proposer's drafts instead of the model's: the model's first
pass still runs over every scheduled request (keeping its cache in step), but it drafts (LM
head, further draft steps) only for the requests the lookup found nothing for. Where the output
quotes its context (answers about a given text, rewrites, code edits) the lookup's drafts are
accepted far more often than a small head's."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn

from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.proposer import FlatInputs, Proposal, ProposalBatch, Proposer
from tokenmill.layers.attention import Attention
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.spec_decode.ngram import prompt_lookup
from tokenmill.speculative_config import SpeculativeConfig
from tokenmill.layers.attention_groups import make_metadata_builder, model_attention_layers

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

LAYER_PREFIX = "draft."
"""Prefix of the proposer model's attention layers among the runner's KV caches."""


class Draft(NamedTuple):
    """One draft position of the rows a model drafts for: the tokens ``[R]`` and the
    distributions ``[R, V]`` they were drawn from, or None for deterministic drafts."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class ModelProposer(Proposer):
    """A proposer with a model of its own. Subclasses load it in ``load_model`` (then call
    ``_attach``), run it over the target step's tokens in ``_first_pass`` and one draft
    position further in ``_draft_step``; ``propose`` chains them k times."""

    uses_target_step = True

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, device: torch.device) -> None:
        super().__init__(spec, config, device)
        self.num_lookahead_tokens = spec.num_speculative_tokens
        self.model: nn.Module | None = None
        self.builder = None

    def _attach(self, model: nn.Module) -> None:
        self.config.platform_cls.place_weights(model)
        self.model = model
        self.builder = make_metadata_builder(
            model_attention_layers(model),
            self.config.block_size,
            self.config.kv_cache_torch_dtype,
            self.device,
        )

    def attention_layers(self) -> dict[str, Attention | MLAAttention]:
        assert self.model is not None
        return {
            LAYER_PREFIX + m.layer_name: m
            for m in self.model.modules()
            if isinstance(m, (Attention, MLAAttention))
        }

    def _run(self, flat: FlatInputs, *inputs: Any) -> Any:
        """The model over ``flat``'s tokens: ``model(*inputs)`` with their attention metadata."""
        assert self.model is not None and self.builder is not None
        with set_forward_context(self.builder.build(flat.common)):
            return self.model(*inputs)

    @abstractmethod
    def _first_pass(
        self, batch: ProposalBatch, rows: np.ndarray
    ) -> tuple[Draft | None, Any, np.ndarray]:
        """Run over every scheduled row's new tokens (keeping the model's cache in step);
        return the first drafts of ``rows``, those of ``batch.rows`` the model drafts for
        (None when there are none), the state ``_draft_step`` continues from, and the
        position ``[R]`` the first draft is fed at."""

    @abstractmethod
    def _draft_step(
        self, flat: FlatInputs, tokens: torch.Tensor, state: Any, index: int
    ) -> tuple[Draft, Any]:
        """Draft ``index`` (from 1) from draft ``index - 1`` (``tokens``) at ``flat``'s
        positions; returns the drafts and the next state."""

    def propose(self, batch: ProposalBatch) -> Proposal:
        assert batch.step is not None and self.model is not None
        k = batch.num_speculative_tokens
        if self.spec.prompt_lookup_max is None:
            num_reqs = len(batch.rows)
            proposal = Proposal(np.zeros((num_reqs, k), dtype=np.int64), np.zeros(num_reqs, dtype=np.int64))
        else:
            assert self.spec.prompt_lookup_min is not None
            proposal = prompt_lookup(
                batch.input_batch, batch.rows, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
            )
        drafting = proposal.num_draft_tokens == 0
        rows = batch.rows[drafting]
        draft, state, positions = self._first_pass(batch, rows)
        if draft is None:
            return proposal
        drafts = [draft]
        ones = np.ones(len(rows), dtype=np.int64)
        for i in range(1, k):
            flat = batch.step.prepare(rows, positions + i - 1, ones)
            draft, state = self._draft_step(flat, draft.tokens, state, i)
            drafts.append(draft)
        tokens = torch.stack([d.tokens for d in drafts], dim=1)
        proposal.draft_token_ids[drafting] = tokens.cpu().numpy()
        proposal.num_draft_tokens[drafting] = k
        if any(d.probs is not None for d in drafts):
            proposal.draft_probs = _draft_probs(proposal, drafting, drafts, tokens)
        return proposal


def _draft_probs(proposal: Proposal, drafting: np.ndarray, drafts: list[Draft], tokens: torch.Tensor) -> torch.Tensor:
    """``[R, k, V]``: the model's draft distributions for the rows it drafted for, one-hot at
    the drafts elsewhere (the prompt lookup's, and positions the model drew greedily)."""
    vocab = next(d.probs for d in drafts if d.probs is not None).shape[-1]
    num_rows, k = proposal.draft_token_ids.shape
    probs = torch.zeros(num_rows, k, vocab, dtype=torch.float32, device=tokens.device)
    ids = torch.from_numpy(proposal.draft_token_ids).to(tokens.device)
    probs.scatter_(2, ids.unsqueeze(2), 1.0)
    at = torch.from_numpy(np.flatnonzero(drafting)).to(tokens.device)
    for i, draft in enumerate(drafts):
        if draft.probs is not None:
            probs[at, i] = draft.probs
    return probs


def step_indices(step_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where each of ``rows`` lies among the step's ``step_rows``."""
    order = {row: s for s, row in enumerate(step_rows)}
    return np.array([order[row] for row in rows], dtype=np.int64)
