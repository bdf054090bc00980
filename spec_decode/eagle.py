"""The ``eagle``, ``eagle3`` and ``mtp`` proposers: a draft head fed the target's hidden states.

All three continue from the target's features rather than from tokens alone, after vLLM's
``EagleProposer``. The head's cache entry at position ``p`` comes from the target's hidden state
at ``p`` (for ``eagle3`` the fused low/mid/high-layer states, for ``eagle`` and ``mtp`` the final
ones) and the embedding of the token at ``p + 1``. After each target step that speculates the
head first runs over every scheduled request's newly verified positions (so its cache follows
the target's through chunked prefill, prefix-cache hits and recomputation after preemption);
a drafting request's last verified position takes its just-sampled token and yields the
first draft. The target's hidden states exist only during their step, so a step that does not
speculate (``disable_by_batch_size``) runs this first pass too (``every_step``: one head layer
over the step's tokens, no LM head, no drafts), and drafting resumes on a complete cache. Each
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from tokenmill.interfaces.build_context import BuildContext
from tokenmill.interfaces.model import SupportsEagle3, SupportsMTP
from tokenmill.interfaces.proposer import FlatInputs, ProposalBatch, TargetStep
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


class HeadProposer(ModelProposer):
    """What the heads share: the first pass over the step's verified positions and the draft
    steps that feed the head's own state back. Subclasses load the head and say which target
    states it reads (:meth:`_features`), how one pass runs (:meth:`_step`) and how its states
    become draft tokens (:meth:`_draft_tokens`)."""

    every_step = True

    def _features(self, step: TargetStep, target_index: torch.Tensor) -> torch.Tensor:
        """The target's states the head continues from, at ``target_index`` of the step."""
        return step.hidden_states[target_index]

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
        # The verified positions of every scheduled row, each with the token after it.
        num_new = ib.num_computed_tokens[step.rows] - step.start_positions
        cu = np.cumsum(num_new)
        offsets = np.arange(cu[-1]) - np.repeat(cu - num_new, num_new)
        positions = np.repeat(step.start_positions, num_new) + offsets
        next_ids = ib.token_ids[np.repeat(step.rows, num_new), positions + 1]
        target_index = torch.from_numpy(np.repeat(step.query_start_loc[:-1], num_new) + offsets)
        hidden = self._features(step, target_index.to(self.device))
        flat = step.prepare(step.rows, step.start_positions, num_new)
        input_ids = torch.from_numpy(next_ids).to(self.device)
        logits_states, hidden = self._step(flat, input_ids, hidden, 0)
        last = torch.from_numpy(cu[step_indices(step.rows, rows)] - 1).to(self.device)
        draft = Draft(self._draft_tokens(logits_states[last], 0)) if len(rows) else None
        return draft, hidden[last], ib.num_computed_tokens[rows]

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
        assert step.aux_hidden_states is not None and self.model is not None
        return self.model.combine_hidden_states(step.aux_hidden_states[target_index])


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
