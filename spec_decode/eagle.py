"""The ``eagle``, ``eagle3`` and ``mtp`` proposers: a draft head fed the target's hidden states.

All three continue from the target's features rather than from tokens alone, after vLLM's
``EagleProposer``. The head's cache entry at position ``p`` comes from the target's hidden state
at ``p`` (for ``eagle3`` the fused low/mid/high-layer states, for ``eagle`` and ``mtp`` the final
ones) and the embedding of the token at ``p + 1``. After each target step that speculates the
head first runs over every scheduled request's newly verified positions (so its cache follows
the target's through chunked prefill, prefix-cache hits and recomputation after preemption);
a drafting request's last verified position takes its just-sampled token and yields the
first draft. The target's hidden states exist only during their step, so after a step that
does not speculate (``disable_by_batch_size``, or no request given a draft length) the head
keeps the states it needs (``every_step``) and runs over them when drafting resumes, which it
does on a complete cache (:class:`HeadProposer`). Each
of the k - 1 further single-token steps feeds the head's own output state back with the previous
draft. Drafts are argmax tokens (deterministic proposals, which the rejection sampler verifies
exactly for greedy and random requests alike).

One class per method over :class:`HeadProposer`: :class:`EagleProposer` runs an EAGLE-1
checkpoint (``models/llama_eagle.py``), :class:`Eagle3Proposer` an EAGLE-3 one
(``models/llama_eagle3.py``) over a target that gives its intermediate states
(``SupportsEagle3``), both named by ``speculative_config["model"]``; :class:`MTPProposer` the
target's own multi-token-prediction layers (a ``SupportsMTP`` target: DeepSeek-V3), step ``i``
running layer ``i mod num_nextn_predict_layers`` as vLLM does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from tokenmill.interfaces.build_context import BuildContext
from tokenmill.interfaces.model import SupportsEagle3, SupportsMTP
from tokenmill.interfaces.proposer import FlatInputs, ProposalBatch, TargetStep, TokenView
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.model_loader.loader import load_hf_config, load_model
from tokenmill.speculative_config import SpeculativeConfig
from tokenmill.spec_decode.model_proposer import Draft, ModelProposer, step_indices

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

DEFAULT_MODEL_HEADS = {
    method: Path(__file__).resolve().parent / "heads" / f"SmolLM2-135M-Instruct-{method}"
    for method in ("eagle", "eagle3")
}
"""The EAGLE-1 and EAGLE-3 heads trained for the default model (``scripts/train_eagle.py``):
what ``{"method": "eagle"}`` / ``{"method": "eagle3"}`` run on the default model when
``model`` is not given."""


DEFER_MAX_POSITIONS = 2048
"""The most positions a head keeps its cache writes back for, over all requests, before it
writes them in the next step."""


@dataclass
class _Deferred:
    """A row's positions from ``start`` whose head cache entries are not written yet, with
    the target's states at them."""

    start: int
    states: list[torch.Tensor] = field(default_factory=list)
    count: int = 0
    """Positions kept: kept up to date by ``add`` (read every step, so not summed then)."""

    def add(self, states: torch.Tensor) -> None:
        self.states.append(states)
        self.count += len(states)


class HeadProposer(ModelProposer):
    """What the heads share: the first pass over the step's verified positions and the draft
    steps that feed the head's own state back. Subclasses load the head and say which target
    states it reads (:meth:`_features`), how it fuses them (:meth:`_fuse`), how one pass runs
    (:meth:`_step`) and how its states become draft tokens (:meth:`_draft_tokens`).

    After a step where no request drafts, the head keeps the target's states of the step's
    positions instead of running over them (its pass would cost every such step a few per
    cent), and runs over them with the next step's when a request drafts again, as one pass:
    so only steps that draft pay for the head. It also runs over a row's kept positions when
    the row's request leaves (``release``: its blocks may serve a prefix-cache hit), when more
    than ``DEFER_MAX_POSITIONS`` are kept, and every step with a KV connector (which saves the
    blocks after each step)."""

    every_step = True

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, device: torch.device) -> None:
        super().__init__(spec, config, device)
        self.defers = config.kv_transfer is None
        self.deferred: dict[int, _Deferred] = {}

    def _features(self, step: TargetStep, target_index: torch.Tensor) -> torch.Tensor:
        """The target's states the head continues from, at ``target_index`` of the step."""
        return step.hidden_states[target_index]

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input state from ``_features``' (the identity but for EAGLE-3)."""
        return features

    def _step(
        self, flat: FlatInputs, input_ids: torch.Tensor, hidden: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass: the states to take logits of and the states for the next step."""
        return self._run(flat, input_ids, flat.positions, hidden)

    def _draft_tokens(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        assert self.model is not None
        return self.model.draft_to_target(self.model.compute_logits(hidden).argmax(dim=-1))

    def _first_pass(
        self, batch: ProposalBatch, rows: np.ndarray
    ) -> tuple[Draft | None, Any, np.ndarray]:
        step, ib = batch.step, batch.input_batch
        assert step is not None and self.model is not None
        num_new = ib.num_computed_tokens[step.rows] - step.start_positions
        offsets = np.arange(num_new.sum()) - np.repeat(np.cumsum(num_new) - num_new, num_new)
        target_index = torch.from_numpy(np.repeat(step.query_start_loc[:-1], num_new) + offsets)
        features = self._features(step, target_index.to(self.device))
        per_row = torch.split(features, num_new.tolist())
        for row, start, states in zip(step.rows, step.start_positions, per_row):
            kept = self.deferred.get(row)
            if kept is None or kept.start + kept.count != start:
                kept = self.deferred[row] = _Deferred(int(start))
            kept.add(states)
        if self.defers and not len(rows) and sum(d.count for d in self.deferred.values()) <= DEFER_MAX_POSITIONS:
            return None, None, ib.num_computed_tokens[rows]
        hidden, cu = self._pass(step.rows, ib, step.prepare)
        last = torch.from_numpy(cu[step_indices(step.rows, rows)] - 1).to(self.device)
        draft = Draft(self._draft_tokens(hidden[0][last], 0)) if len(rows) else None
        return draft, hidden[1][last], ib.num_computed_tokens[rows]

    def release(
        self,
        rows: np.ndarray,
        input_batch: TokenView,
        prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], FlatInputs],
    ) -> None:
        kept = np.array([row for row in rows if row in self.deferred], dtype=np.int64)
        if len(kept):
            self._pass(kept, input_batch, prepare)

    def _pass(
        self,
        rows: np.ndarray,
        ib: TokenView,
        prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], FlatInputs],
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], np.ndarray]:
        """The head over every deferred position of ``rows`` (each with the token after it),
        writing its cache there: the pass's two outputs and the rows' cumulative counts."""
        kept = [self.deferred.pop(row) for row in rows]
        starts = np.array([d.start for d in kept], dtype=np.int64)
        counts = np.array([d.count for d in kept], dtype=np.int64)
        cu = np.cumsum(counts)
        positions = np.repeat(starts, counts) + np.arange(cu[-1]) - np.repeat(cu - counts, counts)
        next_ids = ib.token_ids[np.repeat(rows, counts), positions + 1]
        hidden = self._fuse(torch.cat([s for d in kept for s in d.states]))
        flat = prepare(rows, starts, counts)
        return self._step(flat, torch.from_numpy(next_ids).to(self.device), hidden, 0), cu

    def _draft_step(
        self, flat: FlatInputs, tokens: torch.Tensor, state: Any, index: int
    ) -> tuple[Draft, Any]:
        logits_states, hidden = self._step(flat, tokens, state, index)
        return Draft(self._draft_tokens(logits_states, index)), hidden


class EagleProposer(HeadProposer):
    """``eagle``: an EAGLE-1 head on the target's final hidden states."""

    head_architecture = "EagleLlamaForCausalLM"

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, device: torch.device) -> None:
        super().__init__(spec, config, device)
        self.head_dir = self._head_dir()

    def _head_dir(self) -> str:
        """``speculative_config["model"]``, else the shipped head for the default model."""
        if self.spec.model is not None:
            return self.spec.model
        if self.config.model is None:
            return str(DEFAULT_MODEL_HEADS[self.spec.method])
        raise ValueError(
            f"speculative_config['model'] is required for method {self.spec.method!r} "
            f"(heads are shipped only for the default model)"
        )

    def _check_target(self, target: nn.Module) -> None:
        if any(isinstance(m, MLAAttention) for m in target.modules()):
            raise ValueError(
                f"{self.spec.method} heads use standard attention; the target "
                f"{type(target).__name__} has MLA layers (use 'mtp')"
            )

    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:
        self._check_target(target)
        hf_config = copy.deepcopy(load_hf_config(self.head_dir))
        hf_config.architectures = [self.head_architecture]
        head = load_model(self.head_dir, hf_config, build_ctx, self.device)
        head.share_target(target)
        self._attach(head)


class Eagle3Proposer(EagleProposer):
    """``eagle3``: an EAGLE-3 head on the target's low, middle and high layers' states, fused
    by the head."""

    head_architecture = "Eagle3LlamaForCausalLM"

    def _check_target(self, target: nn.Module) -> None:
        super()._check_target(target)
        if not isinstance(target, SupportsEagle3):
            raise ValueError(
                f"eagle3 needs a target that gives its intermediate hidden states "
                f"(the Llama family); {type(target).__name__} does not"
            )

    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:
        super().load_model(target, build_ctx)
        target.set_aux_hidden_state_layers(target.get_eagle3_aux_hidden_state_layers())

    def _features(self, step: TargetStep, target_index: torch.Tensor) -> torch.Tensor:
        assert step.aux_hidden_states is not None
        return step.aux_hidden_states[target_index]

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model.combine_hidden_states(features)


class MTPProposer(HeadProposer):
    """``mtp``: the target checkpoint's own multi-token-prediction layers (DeepSeek-V3's)."""

    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:
        if not isinstance(target, SupportsMTP):
            raise ValueError(f"mtp needs a target with MTP layers; {type(target).__name__} has none")
        self._attach(load_model(self.config.model_path, target.mtp_config(), build_ctx, self.device))

    def _step(
        self, flat: FlatInputs, input_ids: torch.Tensor, hidden: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._run(flat, input_ids, flat.positions, hidden, index)
        return out, out

    def _draft_tokens(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(hidden, index).argmax(dim=-1)
