"""The ``draft_model`` proposer: a smaller model of the same tokenizer drafts k tokens.

The draft model runs in the target's worker with its own layers' KV caches laid over the same
blocks and block tables. After each target step it first runs over the step's verified tokens
and each drafting request's new token (so its cache follows the target's, prefill chunks,
prefix-cache hits and recomputation after preemption included), then k - 1 more single-token
steps. Drafts are the draft model's argmax: deterministic proposals, which the rejection
sampler verifies exactly for greedy and random requests alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.proposer import FlatInputs, Proposal, ProposalBatch, Proposer
from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import BuildContext
from tokenmill.model_loader.loader import load_model
from tokenmill.speculative_config import SpeculativeConfig
from tokenmill.worker.attention_groups import make_metadata_builder, model_attention_layers

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

LAYER_PREFIX = "draft."


class DraftModelProposer(Proposer):
    uses_target_step = True

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, device: torch.device) -> None:
        super().__init__(spec, config, device)
        self.num_lookahead_tokens = spec.num_speculative_tokens
        self.model: nn.Module | None = None
        self.builder = None

    def load_model(self, target: nn.Module, build_ctx: BuildContext) -> None:
        assert self.spec.model is not None
        self.model = load_model(self.spec.model, self.config.draft_hf_config, build_ctx, self.device)
        self.builder = make_metadata_builder(
            model_attention_layers(self.model),
            self.config.block_size,
            self.config.kv_cache_torch_dtype,
            self.device,
        )

    def attention_layers(self) -> dict[str, Attention]:
        assert self.model is not None
        return {
            LAYER_PREFIX + m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }

    def _forward(self, flat: FlatInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.model is not None and self.builder is not None
        with set_forward_context(self.builder.build(flat.common)):
            return self.model(flat.input_ids if input_ids is None else input_ids, flat.positions)

    def propose(self, batch: ProposalBatch) -> Proposal:
        step = batch.step
        assert step is not None and self.model is not None
        k = batch.num_speculative_tokens
        ib = batch.input_batch
        drafts = np.zeros((len(batch.rows), k), dtype=np.int64)
        drafting = np.isin(step.rows, batch.rows)
        num_new = ib.num_computed_tokens[step.rows] - step.start_positions + drafting
        flat = step.prepare(step.rows, step.start_positions, num_new)
        hidden = self._forward(flat)
        if not len(batch.rows):
            return Proposal(drafts, np.zeros(0, dtype=np.int64))
        order = {row: s for s, row in enumerate(step.rows)}
        at = torch.as_tensor([order[row] for row in batch.rows], device=self.device)
        tokens = self.model.compute_logits(hidden[flat.last_token_index[at]]).argmax(dim=-1)
        drafts_t = [tokens]
        positions = ib.num_tokens[batch.rows] - 1
        ones = np.ones(len(batch.rows), dtype=np.int64)
        for i in range(1, k):
            flat = step.prepare(batch.rows, positions + i, ones)
            hidden = self._forward(flat, tokens)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts_t.append(tokens)
        drafts[:] = torch.stack(drafts_t, dim=1).cpu().numpy()
        return Proposal(drafts, np.full(len(batch.rows), k, dtype=np.int64))
