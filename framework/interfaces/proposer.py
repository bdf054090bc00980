"""The speculative-decoding proposer interface.

After each target step the model runner asks the proposer for draft tokens of the requests that
just sampled. Nothing is copied per step: a proposer reads the runner's persistent per-request
arrays through a :class:`TokenView` (``token_ids[row, :num_tokens[row]]`` holds a request's
prompt and accepted outputs, its new token included). Model-based proposers also get the step itself (``TargetStep``): the target's
hidden states of every scheduled token and where each request's verified tokens lie, and can
run their own model through ``TargetStep.prepare`` over the same block tables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.interfaces.attention import CommonAttentionMetadata
from tokenmill.interfaces.build_context import BuildContext

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.speculative_config import SpeculativeConfig


class TokenView(Protocol):
    """The runner's persistent per-request arrays, by row (read, never written)."""

    token_ids: np.ndarray
    """``[rows, max_model_len]`` int64: each request's prompt and accepted output tokens."""
    num_tokens: np.ndarray
    """``[rows]`` how many of a row's ``token_ids`` are set (its new token included)."""
    num_computed_tokens: np.ndarray
    """``[rows]`` how many of them the target has computed (are in its KV cache)."""
    num_prompt_tokens: np.ndarray
    """``[rows]`` how many of them are the prompt's."""
    temperature: np.ndarray
    """``[rows]`` float32 sampling temperature of each row's request (below 1e-5: greedy)."""
    top_p: np.ndarray
    """``[rows]`` float32 (1.0: off)."""
    top_k: np.ndarray
    """``[rows]`` int64 (0: off)."""
    min_p: np.ndarray
    """``[rows]`` float32 (0.0: off)."""
    seeds: dict[int, int]
    """row -> the ``seed`` of a row whose request has one."""


@dataclass
class FlatInputs:
    """One flattened forward pass: what ``TargetStep.prepare`` builds for a proposer's model.

    Attributes:
        input_ids: ``[T]`` int64 token ids, request by request.
        positions: ``[T]`` int64.
        common: the backend-independent attention metadata; the proposer builds its layers'
            metadata from it with its own builder.
        last_token_index: ``[R]`` int64 index of each request's last token in the ``T``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    common: CommonAttentionMetadata
    last_token_index: torch.Tensor


@dataclass
class TargetStep:
    """The target step a model-based proposer continues from.

    Attributes:
        rows: ``[S]`` ``TokenView`` rows of every request scheduled this step, in step order.
        start_positions: ``[S]`` position of each request's first scheduled token.
        cache_start_positions: ``[S]`` the first position of each request that the proposer's
            cache lacks: ``start_positions``, or earlier where steps the proposer was not
            called after (``Proposer.every_step`` False) left positions out. A proposer fills
            its cache from here up to the request's verified end, which the runner then takes
            as filled; the tokens before ``start_positions`` are in ``TokenView.token_ids``,
            their hidden states are gone.
        query_start_loc: ``[S + 1]`` where each request's tokens lie in ``hidden_states``.
        hidden_states: ``[T, hidden]`` the target's last-layer states of the step's tokens.
        prepare: ``prepare(rows, num_computed, num_new)`` flattens ``num_new`` tokens of each
            row read from ``TokenView.token_ids`` from position ``num_computed`` on, with the
            rows' block tables, into a ``FlatInputs``.
        aux_hidden_states: ``[T, n·hidden]`` the residual stream entering the layers a proposer
            asked the target for (``set_aux_hidden_state_layers``), else None.

    The verified tokens of row ``rows[s]`` are positions ``start_positions[s]`` up to
    ``TokenView.num_computed_tokens[rows[s]]`` (drafts the target rejected are excluded);
    a row that sampled has its new token, not yet in any cache, at ``num_tokens - 1``.
    """

    rows: np.ndarray
    start_positions: np.ndarray
    cache_start_positions: np.ndarray
    query_start_loc: np.ndarray
    hidden_states: torch.Tensor
    prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], FlatInputs]
    aux_hidden_states: torch.Tensor | None = None


@dataclass
class ProposalBatch:
    """What a proposer sees after a step.

    Attributes:
        req_ids: the requests to draft for (they sampled this step and may speculate); may be
            empty (a step of prompt chunks only, or a step that does not speculate, with
            ``Proposer.every_step``), so that a model-based proposer can keep its caches in
            step with the target.
        rows: ``[R]`` their ``TokenView`` rows.
        input_batch: the persistent per-request arrays (read, never written).
        num_speculative_tokens: the most draft tokens to propose per request (k).
        step: the target step, for model-based proposers (None for ``uses_target_step=False``).
    """

    req_ids: list[str]
    rows: np.ndarray
    input_batch: TokenView
    num_speculative_tokens: int
    step: TargetStep | None = None


@dataclass
class Proposal:
    """Draft tokens per request of the batch.

    Attributes:
        draft_token_ids: ``[R, k]`` int64; row ``r`` holds ``num_draft_tokens[r]`` drafts.
        num_draft_tokens: ``[R]`` int64 (0: no draft for that request).
        draft_probs: ``[R, k, V]`` the draft distributions the tokens were drawn from, or None
            for deterministic drafts (each is then accepted when the target's own sample at
            its position equals it; see ``tokenmill.sample.rejection_sampler``).
    """

    draft_token_ids: np.ndarray
    num_draft_tokens: np.ndarray
    draft_probs: torch.Tensor | None = None


class Proposer(ABC):
    """Drafts tokens for running requests; the target model verifies them in its next step.

    Built with the checked ``SpeculativeConfig``, the engine's config and the worker's device.
    """

    uses_target_step: bool = False
    """True for proposers that need ``ProposalBatch.step`` (their own model, hidden states)."""

    every_step: bool = False
    """How the proposer's cache keeps up over steps that do not speculate
    (``disable_by_batch_size``, or no request given a draft length). True: ``propose`` is
    called after those steps too, with no requests to draft for, to fill its cache from what
    only that step has (a head reading the target's hidden states), or to keep that for later
    (a head may fill its cache when it next drafts, or in ``release``). False: it is not called; ``TargetStep.cache_start_positions``
    hands it the positions those steps computed when it next runs, to catch up from their token
    ids (a draft model, for which one pass over the missed tokens costs less than one per step).
    """

    num_lookahead_tokens: int = 0
    """KV slots past the scheduled tokens each request needs for this proposer's own cache
    writes in the same step (a draft model writing its k - 1 draft positions)."""

    draft_cost: float = 0.0
    """What drafting one token costs, as a share of a target decode step of one request, as far
    as the proposer can tell once loaded, before any step is timed (a draft model: its weights'
    bytes over the target's); 0: too little to tell. The adaptive draft-length policy takes it
    as the break-even acceptance until it has timed drafts; at 1 or more no draft can pay, and
    none is drafted to find out (a draft model as large as the target)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, device: torch.device) -> None:
        self.spec = spec
        self.config = config
        self.device = device

    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:  # noqa: B027 (optional)
        """Load or attach the draft model (a no-op for model-free methods)."""

    def attention_layers(self) -> dict[str, nn.Module]:
        """The proposer's own attention layers (``tokenmill.layers.attention.Attention``,
        ``MLAAttention``), whose KV caches the runner allocates next to the target's (same
        blocks, same block tables); names must not clash with the target's."""
        return {}

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> Proposal: ...

    def release(  # noqa: B027 (optional)
        self,
        rows: np.ndarray,
        input_batch: TokenView,
        prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], FlatInputs],
    ) -> None:
        """``rows``' requests leave the batch (finished or preempted); their arrays and block
        tables are still theirs, and are reused after this returns. A proposer that deferred
        writing its cache for them (see ``every_step``) writes it now: their blocks may serve
        another request's prefix-cache hit. ``prepare`` is ``TargetStep.prepare``."""
