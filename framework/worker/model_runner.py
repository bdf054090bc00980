"""The model runner: turns one ``SchedulerOutput`` into one forward pass and samples.

All scheduled tokens of all requests are flattened into one batch (input ids, positions, slot
mapping, block table, query start locations, sequence lengths); the attention backend's metadata
is built once for the step; the model runs once; the rows whose scheduled chunk reaches the end
of their known tokens are sampled. Rows still in the middle of a chunked prefill sample nothing.

Every step samples through the one ``Sampler`` (``tokenmill.sample``). With speculative
decoding a request's scheduled tokens end with its ``k`` drafts: its last ``k + 1`` positions
are sampled (position ``j`` with the request's history plus its first ``j`` drafts), the drafts
are accepted while they equal the sampled tokens, the rejected ones roll
``num_computed_tokens`` back, and the proposer drafts the next ones (:meth:`ModelRunner._propose`).

Under pipeline parallelism a stage after the first receives the previous stage's residual
stream instead of embedding the tokens, a stage before the last sends its own to the next and
returns no tokens; only the last stage samples (and drafts, with speculative decoding), and
the others learn the sampled tokens from the scheduler (``CachedRequestData.new_token_ids``)
and the drafts from ``scheduled_spec_decode_tokens``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.config_resolver import quantization_method
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.distributed.parallel_state import (
    expert_parallel_spans_cores,
    is_first_pp_rank,
    is_last_pp_rank,
    pp_recv,
    pp_send,
)
from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.attention import CommonAttentionMetadata
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.interfaces.kv_connector import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from tokenmill.kv_connector_factory import create_kv_connector
from tokenmill.interfaces.proposer import FlatInputs, ProposalBatch, Proposer, TargetStep
from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.lora.manager import LoRAManager
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.layers.pipeline import IntermediateTensors
from tokenmill.logprobs import LogprobsLists
from tokenmill.model_loader.loader import load_model
from tokenmill.sample.rejection_sampler import Drafts, num_accepted
from tokenmill.sample.sampler import (
    Penalties,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    position_seed,
    row_settings,
)
from tokenmill.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams, num_top_logprobs
from tokenmill.selector import AttentionSelector
from tokenmill.structured_output.bitmask import apply_grammar_bitmask
from tokenmill.interfaces.decode_graph import DecodeGraphRunner
from tokenmill.layers.attention_groups import (
    LayerMetadataBuilder,
    make_metadata_builder,
    model_attention_layers,
)
from tokenmill.worker.input_batch import CachedRequestState, InputBatch
from tokenmill.worker.prompt_logprobs import PromptChunk, PromptLogprobs


STEP_INTERVALS_KEPT = 4096


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs when asked) of the requests that sampled this step, and
    the prompt logprobs of the requests whose prompt this step completed, and the drafts
    proposed for their next step."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    """What the KV connector finished sending and receiving (None without a connector)."""


@dataclass
class _PreemptedState:
    """What a preempted request keeps on the worker while its row is given back: its tokens
    and its state."""

    token_ids: list[int]
    state: CachedRequestState


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.kv_connector: KVConnectorBase | None = None
        """The KV connector's worker side, if the engine runs one (built with the cache)."""
        self.block_size = config.block_size
        self.attn_selector = AttentionSelector(
            config.platform_cls,
            config.torch_dtype,
            config.kv_cache_dtype,
            config.block_size,
            config.attention_backend,
        )
        self.sampler = Sampler(config.logprobs_mode)
        self.model: nn.Module | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.preempted: dict[str, _PreemptedState] = {}
        self.batch: InputBatch | None = None
        self.metadata_builder: LayerMetadataBuilder | None = None
        self.graphs: DecodeGraphRunner | None = None
        self.lora_manager: LoRAManager | None = None
        self.proposer: Proposer | None = None
        self._step_metadata: CommonAttentionMetadata | None = None
        """The latest step's backend-independent attention metadata (what a KV connector's
        ``save_kv_layer`` gets)."""
        self.step_intervals: deque[tuple[float, float]] = deque(maxlen=STEP_INTERVALS_KEPT)
        """``(start, end)`` (``time.monotonic``) of the latest steps that ran tokens, from
        after the previous stage's activations arrived to the end of the step: when this
        rank was busy."""
        self._busy_since = 0.0
        self.draft_probs: dict[str, torch.Tensor] = {}
        """``[k, V]`` draft distributions of the drafts proposed after the last step, per
        request, from a proposer that gives them; the next step's sampling consumes them."""
        if config.speculative is not None and is_last_pp_rank():
            from tokenmill import plugins

            proposer_cls = plugins.get_registry("proposers").choose(config.speculative.method)
            self.proposer = proposer_cls(config.speculative, config, device)

    def load_model(self) -> None:
        ctx = BuildContext(
            self.attn_selector,
            self.config.torch_dtype,
            quantization_method(self.config),
            self.config.platform_cls.get_ops(),
            self.config.calculate_kv_scales,
            self.config.enable_expert_parallel,
        )
        self.model = load_model(self.config.weights_path, self.config.hf_config, ctx, self.device)
        self.config.platform_cls.place_weights(self.model)
        if self.config.enable_lora:
            with model_build_context(ctx):
                self.lora_manager = LoRAManager(self.model, self.config, self.device)
        self.prompt_logprobs = PromptLogprobs(self.model.compute_logits)
        if self.proposer is not None:
            self.proposer.load_model(self.model, ctx)

    def attention_layers(self) -> dict[str, Attention | MLAAttention]:
        """The target's attention layers, then the proposer's (each owns a KV cache)."""
        assert self.model is not None
        layers = {m.layer_name: m for m in model_attention_layers(self.model)}
        if self.proposer is not None:
            layers.update(self.proposer.attention_layers())
        return layers

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {
            name: layer.get_kv_cache_spec(self.block_size, self.config.kv_cache_torch_dtype)
            for name, layer in self.attention_layers().items()
        }

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache in its backend's layout, bind it to the layer, group the
        target's layers by backend and spec for the metadata, and allocate the per-request
        buffers."""
        specs = self.get_kv_cache_specs()
        for name, layer in self.attention_layers().items():
            shape = layer.backend.get_kv_cache_shape(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_size
            )
            layer.kv_cache = torch.zeros(shape, dtype=specs[name].dtype, device=self.device)
        self.metadata_builder = make_metadata_builder(
            model_attention_layers(self.model),
            self.block_size,
            self.config.kv_cache_torch_dtype,
            self.device,
        )
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.batch = InputBatch(
            self.config.max_num_seqs,
            self.config.max_model_len,
            max_blocks,
            self.config.hf_config.vocab_size,
            self.device,
        )
        self.graphs = DecodeGraphRunner.create(
            self.config, self.model, self.metadata_builder, max_blocks, self.device
        )
        self.kv_connector = create_kv_connector(
            self.config,
            KVConnectorRole.WORKER,
            self.rank,
            {name: specs[name] for name in (m.layer_name for m in model_attention_layers(self.model))},
        )
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(
                {
                    layer.layer_name: _blocks_first(layer, num_blocks, self.block_size)
                    for layer in model_attention_layers(self.model)
                }
            )

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        assert batch is not None
        if self.proposer is not None:
            leaving = [
                batch.requests[r].row
                for r in (*out.finished_req_ids, *out.preempted_req_ids)
                if r in batch.requests
            ]
            if leaving:
                self.proposer.release(np.array(leaving, dtype=np.int64), batch, self.prepare_flat_inputs)
        for req_id in out.finished_req_ids:
            batch.remove(req_id)
            self.preempted.pop(req_id, None)
            self.prompt_logprobs.remove(req_id)
        for req_id in out.preempted_req_ids:
            state = batch.requests.get(req_id)
            if state is not None:
                self.preempted[req_id] = _PreemptedState(batch.token_list(state.row), state)
                batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            if new.lora_request is not None:
                self.lora_manager.add_adapter(new.lora_request)
            batch.add(
                new.req_id,
                new.prompt_token_ids,
                len(new.prompt_token_ids),
                new.block_ids,
                new.num_computed_tokens,
                params,
                _min_tokens_suppress(params, new.eos_token_id),
                new.lora_request.lora_int_id if new.lora_request is not None else 0,
            )
        cached = out.scheduled_cached_reqs
        for req_id, resumed, block_ids, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                saved = self.preempted.pop(req_id)
                old = saved.state
                batch.add(
                    req_id,
                    saved.token_ids,
                    old.num_prompt_tokens,
                    block_ids,
                    num_computed,
                    old.sampling_params,
                    old.min_tokens_suppress,
                    old.lora_int_id,
                )
                continue
            state = batch.requests[req_id]
            batch.append_blocks(state.row, block_ids)
            batch.num_computed_tokens[state.row] = num_computed
        for req_id, num_computed, token_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids
        ):
            row = batch.requests[req_id].row
            end = num_computed + len(token_ids)
            batch.token_ids[row, num_computed:end] = token_ids
            batch.num_tokens[row] = max(batch.num_tokens[row], end)
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            row = batch.requests[req_id].row
            start = batch.num_tokens[row]
            batch.token_ids[row, start : start + len(drafts)] = drafts

    def _flatten(
        self, rows: np.ndarray, num_computed: np.ndarray, num_sched: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata, np.ndarray]:
        """Input ids, positions and attention metadata of ``num_sched`` tokens of each row from
        position ``num_computed`` on, and the cumulative token counts."""
        batch = self.batch
        assert batch is not None
        cu = np.cumsum(num_sched)
        starts = cu - num_sched
        token_req = np.repeat(np.arange(len(rows)), num_sched)
        token_rows = rows[token_req]
        positions = num_computed[token_req] + np.arange(cu[-1]) - starts[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        seq_lens = num_computed + num_sched
        max_blocks = int(batch.num_blocks[rows].max())
        common = CommonAttentionMetadata(
            query_start_loc=self._tensor(np.concatenate(([0], cu)), torch.int32),
            query_start_loc_cpu=torch.from_numpy(np.concatenate(([0], cu)).astype(np.int32)),
            seq_lens=self._tensor(seq_lens, torch.int32),
            seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)),
            num_computed_tokens_cpu=torch.from_numpy(num_computed.astype(np.int32)),
            block_table=self._tensor(batch.block_table[rows, :max_blocks], torch.int32),
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            num_reqs=len(rows),
            num_actual_tokens=int(cu[-1]),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), common, cu

    def prepare_flat_inputs(
        self, rows: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray
    ) -> FlatInputs:
        """``TargetStep.prepare``: a forward pass over ``num_new`` tokens of each row."""
        input_ids, positions, common, cu = self._flatten(rows, num_computed, num_new)
        return FlatInputs(input_ids, positions, common, self._tensor(cu - 1, torch.int64))

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._busy_since = time.monotonic()
        result = self._execute_model(out)
        if out.total_num_scheduled_tokens:
            self.step_intervals.append((self._busy_since, time.monotonic()))
        return result

    @torch.inference_mode()
    def _execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step. With a KV connector, the step's loads land in the cache before the
        forward pass and its saves start after it (per step: every layer's
        ``wait_for_layer_load`` before the forward, every layer's ``save_kv_layer`` after it,
        in layer order, so attention backends need not know about connectors), and every
        step, also one that runs no token, reports what finished sending and receiving."""
        self._update_states(out)
        connector = self.kv_connector
        if connector is None:
            return self._execute(out)
        connector.bind_connector_metadata(out.kv_connector_metadata)
        try:
            connector.start_load_kv()
            for name in connector.kv_caches:
                connector.wait_for_layer_load(name)
            result = self._execute(out)
            if out.total_num_scheduled_tokens:
                for name, kv_layer in connector.kv_caches.items():
                    connector.save_kv_layer(name, kv_layer, self._step_metadata)
                connector.wait_for_save()
            sending, recving = connector.get_finished(out.finished_req_ids)
        finally:
            connector.clear_connector_metadata()
        result.kv_connector_output = KVConnectorOutput(sending or set(), recving or set())
        return result

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A step without tokens of an engine core whose experts span the data-parallel
        cores: every MoE layer's expert-parallel collectives, in model order, with a
        zero-weight padding row, so another core's step can run. Nothing else runs: no KV is
        written and nothing is sampled."""
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, FusedMoE) and module.ep_size > 1:
                module.dummy_forward(self.config.torch_dtype, self.device)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.total_num_scheduled_tokens == 0:
            if expert_parallel_spans_cores():
                self.execute_dummy_batch()
            return ModelRunnerOutput({})
        batch = self.batch
        assert batch is not None and self.model is not None
        req_ids = list(out.num_scheduled_tokens)
        rows = np.array([batch.requests[r].row for r in req_ids], dtype=np.int64)
        num_sched = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_computed = batch.num_computed_tokens[rows]
        input_ids_t, positions_t, common, cu = self._flatten(rows, num_computed, num_sched)
        self._step_metadata = common
        seq_lens = num_computed + num_sched
        batch.num_computed_tokens[rows] = seq_lens
        if self.lora_manager is not None:
            self.lora_manager.set_step(np.repeat(batch.lora_int_id[rows], num_sched))
        hidden = self.graphs.run(input_ids_t, positions_t, common) if self.graphs else None
        if hidden is None:
            attn_metadata = self.metadata_builder.build(common)
            kwargs = {}
            if not is_first_pp_rank():
                shape = (2, len(input_ids_t), self.config.hf_config.hidden_size)
                packed = pp_recv(shape, self.config.torch_dtype)
                self._busy_since = time.monotonic()
                kwargs["intermediate_tensors"] = IntermediateTensors.unpack(packed)
            with set_forward_context(attn_metadata):
                hidden = self.model(input_ids_t, positions_t, **kwargs)
        if isinstance(hidden, IntermediateTensors):
            pp_send(hidden.pack())
            return ModelRunnerOutput({})
        aux_hidden = None
        if isinstance(hidden, tuple):
            hidden, aux_hidden = hidden

        prompt_logprobs = self._prompt_logprobs(req_ids, cu - num_sched, num_computed, num_sched, hidden)
        sampling = np.nonzero(seq_lens >= batch.num_tokens[rows])[0]
        result = ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs)
        if len(sampling):
            result = self._sample(out, req_ids, sampling, rows[sampling], cu, hidden)
            result.prompt_logprobs = prompt_logprobs
        if self.proposer is not None and (out.draft_lengths or self.proposer.every_step):
            step = None
            if self.proposer.uses_target_step:
                step = TargetStep(
                    rows=rows,
                    start_positions=num_computed,
                    cache_start_positions=batch.proposer_num_computed[rows],
                    query_start_loc=np.concatenate(([0], cu)),
                    hidden_states=hidden,
                    prepare=self.prepare_flat_inputs,
                    aux_hidden_states=aux_hidden,
                )
            lengths = {
                r: out.draft_lengths[r] for r in result.sampled_token_ids if r in out.draft_lengths
            }
            result.spec_token_ids = self._propose(self.proposer, lengths, step)
            batch.proposer_num_computed[rows] = batch.num_computed_tokens[rows]
        return result

    def _propose(
        self, proposer: Proposer, lengths: dict[str, int], step: TargetStep | None
    ) -> dict[str, list[int]]:
        """Drafts for the requests that sampled, each up to its length in ``lengths`` (the
        scheduler's ``draft_lengths``), of those with room for it; the proposer drafts the
        longest of them for all, each request keeping its own length. Every sampling feature
        combines with drafts: each verified position's logits are processed with the drafts before it (penalties, bad words,
        ``min_tokens``, the grammar, which also cuts a constrained request's drafts in the
        engine core). A proposer's ``draft_probs`` are kept in ``self.draft_probs`` for the next
        step's verification."""
        batch = self.batch
        assert batch is not None
        max_len = self.config.max_model_len
        eligible = [r for r, k in lengths.items() if batch.num_tokens[batch.requests[r].row] + k < max_len]
        if not eligible and not proposer.uses_target_step:
            return {}
        k = max((lengths[r] for r in eligible), default=proposer.spec.num_speculative_tokens)
        rows = np.array([batch.requests[r].row for r in eligible], dtype=np.int64)
        proposal = proposer.propose(ProposalBatch(eligible, rows, batch, k, step))
        drafts = {}
        for j, req_id in enumerate(eligible):
            n = min(int(proposal.num_draft_tokens[j]), lengths[req_id])
            if n:
                drafts[req_id] = proposal.draft_token_ids[j, :n].tolist()
                if proposal.draft_probs is not None:
                    self.draft_probs[req_id] = proposal.draft_probs[j, :n]
        return drafts

    def _sample(
        self,
        out: SchedulerOutput,
        req_ids: list[str],
        sampling: np.ndarray,
        sample_rows: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> ModelRunnerOutput:
        """Sample every position of the requests that sample: the last ``k + 1`` scheduled
        tokens of a request with ``k`` drafts (position ``j`` after its first ``j`` drafts), the
        last one of the others; emit each request's accepted drafts and the token after them,
        and roll its rejected drafts back."""
        batch = self.batch
        assert batch is not None and self.model is not None
        drafts = [out.scheduled_spec_decode_tokens.get(req_ids[i], []) for i in sampling]
        positions = _SamplingPositions.build(drafts)
        logits = self.model.compute_logits(hidden[self._tensor(positions.token_index(cu[sampling]), torch.int64)])
        if out.grammar_bitmask is not None:
            self._apply_grammar(out, [req_ids[i] for i in sampling], positions, logits)
        metadata = self._sampling_metadata(req_ids, sampling, sample_rows, positions)
        draft_ids, draft_tensors = None, None
        if positions.has_drafts:
            draft_ids = np.full(len(positions.offsets), -1, dtype=np.int64)
            is_draft = positions.offsets < np.repeat(positions.num_drafts, positions.counts)
            draft_ids[is_draft] = [t for d in drafts for t in d]
            draft_tensors = Drafts(
                self._tensor(draft_ids, torch.int64),
                self._draft_probs([req_ids[i] for i in sampling], drafts, positions),
            )
        self.draft_probs = {}
        sampler_out = self.sampler(logits, metadata, draft_tensors)
        tokens = sampler_out.sampled_token_ids.cpu().numpy()
        if draft_ids is None:
            num_emitted = positions.counts
            batch.append_sampled(sample_rows, tokens)
        else:
            num_emitted = 1 + num_accepted(tokens, draft_ids, positions.counts)
            batch.num_computed_tokens[sample_rows] -= positions.counts - num_emitted
            for t in range(int(num_emitted.max())):
                alive = num_emitted > t
                batch.append_sampled(sample_rows[alive], tokens[positions.starts[alive] + t])
        emitted = list(zip(sampling.tolist(), positions.starts.tolist(), num_emitted.tolist()))
        token_list = tokens.tolist()
        sampled_ids = {req_ids[i]: token_list[s : s + n] for i, s, n in emitted}
        return ModelRunnerOutput(sampled_ids, self._logprobs(req_ids, emitted, sampler_out))

    def _draft_probs(
        self, sampled_req_ids: list[str], drafts: list[list[int]], positions: _SamplingPositions
    ) -> torch.Tensor | None:
        """``[P, V]`` the draft distribution at each draft position (one-hot at the draft for
        a request without one; bonus rows unused), or None when no request has one."""
        if not any(r in self.draft_probs for r in sampled_req_ids):
            return None
        vocab = self.config.hf_config.vocab_size
        probs = torch.zeros(len(positions.offsets), vocab, dtype=torch.float32, device=self.device)
        for req_id, request_drafts, start in zip(sampled_req_ids, drafts, positions.starts):
            k = len(request_drafts)
            if req_id in self.draft_probs:
                probs[start : start + k] = self.draft_probs[req_id][:k]
            elif k:
                index = torch.arange(start, start + k, device=self.device)
                probs[index, self._tensor(np.array(request_drafts), torch.int64)] = 1.0
        return probs

    def _apply_grammar(
        self, out: SchedulerOutput, sampled_req_ids: list[str], positions: _SamplingPositions, logits: torch.Tensor
    ) -> None:
        """Mask each constrained position's logits with its bitmask row (the scheduler's rows
        are request by request, ``k + 1`` per request, in ``structured_output_request_ids``
        order)."""
        bitmask_start, start = {}, 0
        for req_id in out.structured_output_request_ids:
            bitmask_start[req_id] = start
            start += len(out.scheduled_spec_decode_tokens.get(req_id, ())) + 1
        logit_rows: list[int] = []
        bitmask_rows: list[int] = []
        for req_id, s, n in zip(sampled_req_ids, positions.starts, positions.counts):
            if req_id in bitmask_start:
                logit_rows += range(s, s + n)
                bitmask_rows += range(bitmask_start[req_id], bitmask_start[req_id] + n)
        apply_grammar_bitmask(logits, logit_rows, out.grammar_bitmask[bitmask_rows])

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        starts: np.ndarray,
        num_computed: np.ndarray,
        num_sched: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, LogprobsLists]:
        batch, prompt_logprobs = self.batch, self.prompt_logprobs
        chunks = []
        for i, req_id in enumerate(req_ids):
            state = batch.requests[req_id]
            num = state.sampling_params.prompt_logprobs
            if num is None or not prompt_logprobs.wants(req_id):
                continue
            num = num_top_logprobs(num, self.config.hf_config.vocab_size)
            prompt = batch.token_ids[state.row, : state.num_prompt_tokens].tolist()
            chunks.append(
                PromptChunk(req_id, num, prompt, int(num_computed[i]), int(num_sched[i]), int(starts[i]))
            )
        return prompt_logprobs.process(chunks, hidden) if chunks else {}

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

    def _sampling_metadata(
        self, req_ids: list[str], sampling: np.ndarray, rows: np.ndarray, positions: _SamplingPositions
    ) -> SamplingMetadata:
        """The settings of every sampling position; position ``j`` of a request sees its
        tokens plus its first ``j`` drafts (``min_tokens``, bad words, penalties, seeds)."""
        batch = self.batch
        assert batch is not None
        counts, offsets = positions.counts, positions.offsets
        if positions.has_drafts:
            rows = np.repeat(rows, counts)
            sampling = np.repeat(sampling, counts)
        temperature = batch.temperature[rows]
        greedy = temperature < GREEDY_TEMPERATURE_EPS
        seeds: dict[int, int] = {}
        vocab = self.config.hf_config.vocab_size
        suppress: dict[int, list[int]] = {}
        max_logprobs: int | None = None
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        offset_list = offsets.tolist() if positions.has_drafts else [0] * len(sampling)
        for i, (idx, offset) in enumerate(zip(sampling, offset_list)):
            state = batch.requests[req_ids[idx]]
            params = state.sampling_params
            num_tokens = batch.num_tokens[state.row] + offset
            num_output = num_tokens - state.num_prompt_tokens
            seed = batch.seeds.get(state.row)
            if seed is not None and not greedy[i]:
                seeds[i] = position_seed(seed, int(num_output))
            if params.logprobs is not None:
                max_logprobs = max(max_logprobs or 0, num_top_logprobs(params.logprobs, vocab))
            banned = []
            if num_output < params.min_tokens and state.min_tokens_suppress:
                banned += state.min_tokens_suppress
            if params.bad_words_token_ids:
                output = batch.token_ids[state.row, state.num_prompt_tokens : num_tokens]
                banned += _bad_word_ends(params.bad_words_token_ids, output)
            if banned:
                suppress[i] = banned
            if params.logit_bias:
                bias_rows += [i] * len(params.logit_bias)
                bias_ids += params.logit_bias.keys()
                bias_values += params.logit_bias.values()
        logit_bias = None
        if bias_rows:
            logit_bias = (
                torch.tensor(bias_rows, dtype=torch.int64, device=self.device),
                torch.tensor(bias_ids, dtype=torch.int64, device=self.device),
                torch.tensor(bias_values, dtype=torch.float32, device=self.device),
            )
        settings = row_settings(
            temperature, batch.top_p[rows], batch.top_k[rows], batch.min_p[rows], vocab, self.device, seeds,
        )
        return replace(
            settings,
            max_num_logprobs=max_logprobs,
            suppress_token_ids=suppress,
            disallowed_mask=self._gather_disallowed(rows),
            logit_bias=logit_bias,
            penalties=self._penalties(rows, offsets),
        )

    def _gather_disallowed(self, rows: np.ndarray) -> torch.Tensor | None:
        batch = self.batch
        assert batch is not None
        uses = batch.uses_allowed[rows]
        if not uses.any():
            return None
        assert batch.disallowed_mask is not None
        mask = batch.disallowed_mask[self._tensor(rows, torch.int64)]
        return mask.logical_and_(self._tensor(uses, torch.bool).unsqueeze(1))

    def _penalties(self, rows: np.ndarray, offsets: np.ndarray) -> Penalties | None:
        """Penalty settings of each position (``rows[i]``'s), its output counts including
        the ``offsets[i]`` drafts before it."""
        batch = self.batch
        assert batch is not None
        penalised = batch.uses_penalties[rows]
        if not penalised.any():
            return None
        assert batch.output_token_counts is not None and batch.prompt_token_mask is not None
        # Other rows hold the off values, so stale counts in their rows change nothing.
        index = self._tensor(rows, torch.int64)
        output_counts = batch.output_token_counts[index]
        with_drafts = np.flatnonzero(penalised & (offsets > 0))
        if len(with_drafts):
            positions = np.repeat(with_drafts, offsets[with_drafts])
            starts = batch.num_tokens[rows[with_drafts]]
            columns = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, offsets[with_drafts])])
            drafts = batch.token_ids[rows[positions], columns]
            output_counts.index_put_(
                (self._tensor(positions, torch.int64), self._tensor(drafts, torch.int64)),
                torch.ones(len(positions), dtype=torch.int32, device=self.device),
                accumulate=True,
            )
        return Penalties(
            presence=self._tensor(batch.presence_penalty[rows], torch.float32),
            frequency=self._tensor(batch.frequency_penalty[rows], torch.float32),
            repetition=self._tensor(batch.repetition_penalty[rows], torch.float32),
            prompt_mask=batch.prompt_token_mask[index],
            output_counts=output_counts,
        )

    def _logprobs(
        self, req_ids: list[str], emitted: list[tuple[int, int, int]], sampler_out: SamplerOutput
    ) -> dict[str, LogprobsLists]:
        """The logprobs of each request's emitted positions: ``(index in req_ids, first
        position, number of positions)`` per sampling request."""
        if sampler_out.logprobs is None:
            return {}
        ids = sampler_out.logprob_token_ids.cpu().tolist()
        values = sampler_out.logprobs.cpu().tolist()
        ranks = sampler_out.sampled_token_ranks.cpu().tolist()
        result = {}
        for idx, start, num in emitted:
            params = self.batch.requests[req_ids[idx]].sampling_params
            if params.logprobs is None:
                continue
            vocab = self.config.hf_config.vocab_size
            n, end = 1 + num_top_logprobs(params.logprobs, vocab), start + num
            result[req_ids[idx]] = LogprobsLists(
                [row[:n] for row in ids[start:end]], [row[:n] for row in values[start:end]], ranks[start:end]
            )
        return result


@dataclass
class _SamplingPositions:
    """Where the sampling positions of one step's sampling requests lie, request by request.

    Attributes:
        num_drafts: ``[R]`` the drafts each request verifies.
        has_drafts: any request has drafts (else there is one position per request).
        counts: ``[R]`` its positions, ``num_drafts + 1``.
        starts: ``[R]`` its first position.
        offsets: ``[P]`` each position's index within its request (drafts before it).
    """

    num_drafts: np.ndarray
    has_drafts: bool
    counts: np.ndarray
    starts: np.ndarray
    offsets: np.ndarray

    @classmethod
    def build(cls, drafts: list[list[int]]) -> _SamplingPositions:
        n = len(drafts)
        num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=n)
        if not num_drafts.any():
            return cls(num_drafts, False, np.ones(n, dtype=np.int64), np.arange(n), np.zeros(n, dtype=np.int64))
        counts = num_drafts + 1
        starts = np.cumsum(counts) - counts
        return cls(num_drafts, True, counts, starts, np.arange(counts.sum()) - np.repeat(starts, counts))

    def token_index(self, ends: np.ndarray) -> np.ndarray:
        """``[P]`` each position's index among the step's tokens, given where each request's
        scheduled tokens end: its last ``counts`` tokens."""
        if not self.has_drafts:
            return ends - 1
        return np.repeat(ends - self.counts, self.counts) + self.offsets


def _blocks_first(layer: Attention | MLAAttention, num_blocks: int, block_size: int) -> torch.Tensor:
    """A view of ``layer``'s cache with the block as its first dimension: the dimension of the
    backend's cache shape that grows with the number of blocks."""
    def shape(n: int) -> tuple[int, ...]:
        return layer.backend.get_kv_cache_shape(n, block_size, layer.num_kv_heads, layer.head_size)

    [block_dim] = [i for i, (a, b) in enumerate(zip(shape(num_blocks), shape(num_blocks + 1))) if a != b]
    return layer.kv_cache.movedim(block_dim, 0)


def _bad_word_ends(bad_words: list[list[int]], output: np.ndarray) -> list[int]:
    """The last token of each bad word whose other tokens end ``output`` (vLLM's rule: only
    generated tokens count)."""
    ends = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :].tolist() == prefix):
            ends.append(word[-1])
    return ends


def _min_tokens_suppress(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """Tokens a request may not sample before it has ``min_tokens`` outputs."""
    if params.min_tokens == 0:
        return []
    ids = list(params.stop_token_ids)
    if not params.ignore_eos and eos_token_id is not None:
        ids.append(eos_token_id)
    return ids
