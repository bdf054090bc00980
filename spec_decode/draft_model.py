"""The ``draft_model`` proposer: a smaller model of the same tokenizer drafts k tokens.

The draft model runs in the target's worker with its own layers' KV caches laid over the same
blocks and block tables. After each target step that speculates it first runs over the step's
verified tokens and each drafting request's new token (so its cache follows the target's,
prefill chunks, prefix-cache hits and recomputation after preemption included), then k - 1
more single-token steps. Steps that do not speculate (``disable_by_batch_size``) do not run it;
the first pass after them starts at each request's ``cache_start_positions``, catching up the
tokens they computed as one prefill chunk.

Drafts are sampled as the target samples (``tokenmill.sample.sampler.sample_draft``): the
argmax for greedy requests, else a draw from the draft model's distribution ``q`` after the
request's temperature, min-p, top-k and top-p, passed on as ``Proposal.draft_probs``; the
sampler accepts a draft ``d`` with probability ``min(1, p(d) / q(d))`` (vLLM's rule). A model
drafting for itself therefore has every draft accepted at any temperature; argmax drafts would
be accepted with probability ``p(argmax)`` only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmill.interfaces.proposer import FlatInputs, ProposalBatch
from tokenmill.interfaces.build_context import BuildContext
from tokenmill.model_loader.loader import decode_weight_bytes, load_model
from tokenmill.sample.sampler import sample_draft
from tokenmill.spec_decode.model_proposer import Draft, ModelProposer, step_indices


class DraftModelProposer(ModelProposer):
    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:
        assert self.spec.model is not None
        model = load_model(self.spec.model, self.config.draft_hf_config, build_ctx, self.device)
        self._attach(model)
        self.draft_cost = decode_weight_bytes(model) / decode_weight_bytes(target)

    def _first_pass(
        self, batch: ProposalBatch, rows: np.ndarray
    ) -> tuple[Draft | None, Any, np.ndarray]:
        step, ib = batch.step, batch.input_batch
        assert step is not None and self.model is not None
        drafting = np.isin(step.rows, rows)
        start = step.cache_start_positions
        num_new = ib.num_computed_tokens[step.rows] - start + drafting
        flat = step.prepare(step.rows, start, num_new)
        hidden = self._run(flat, flat.input_ids, flat.positions)
        at = torch.from_numpy(step_indices(step.rows, rows)).to(self.device)
        last = flat.last_token_index[at]
        if not len(rows):
            return None, None, ib.num_tokens[rows]
        draft = Draft(*sample_draft(self.model.compute_logits(hidden[last]), ib, rows, 0))
        return draft, (ib, rows), ib.num_tokens[rows]

    def _draft_step(
        self, flat: FlatInputs, tokens: torch.Tensor, state: Any, index: int
    ) -> tuple[Draft, Any]:
        assert self.model is not None
        hidden = self._run(flat, tokens, flat.positions)
        view, rows = state
        return Draft(*sample_draft(self.model.compute_logits(hidden), view, rows, index)), state

