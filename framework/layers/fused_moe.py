"""Mixture-of-experts layer with stacked expert weights (after vLLM's ``FusedMoE``).

Routing (:func:`select_experts`) turns router logits into ``top_k`` experts and weights per
token: softmax or sigmoid scores, an optional score-correction bias that steers the choice but
not the weights (DeepSeek-V3), group-limited top-k (``num_expert_group`` groups, the best
``topk_group`` of them kept), renormalisation and a routed scaling factor. The experts' SwiGLU
weights are stacked at load time into ``w13_weight`` [E, 2I, H] (gate rows then up rows) and
``w2_weight`` [E, H, I] from per-expert checkpoint tensors.

The computation is the layer's ``moe_method``: the quantization method's (its
``get_moe_method``) when the model is quantized, else the platform's ``unquantized_fused_moe``
op (the CPU's packs each expert for oneDNN; CUDA's runs the Triton fused-MoE kernel, one launch
per GEMM), else :class:`UnquantizedFusedMoEMethod`: the (token, expert) pairs are sorted by
expert and each expert that received tokens runs one pair of GEMMs on contiguous rows.

With expert parallelism (``BuildContext.enable_expert_parallel``) the tensor-parallel ranks
hold whole experts instead of slices: rank ``r`` the ``num_experts / ep_size`` experts the
placement map ``expert_placement`` gives it (a contiguous run). Each rank takes its share of
the step's tokens, the device communicator's ``dispatch`` sends each (token, expert) pair to
its expert's rank, the rank runs its experts, and ``combine`` brings the weighted outputs home;
one all-reduce then assembles every rank's tokens with the shared experts' partial sums.
When the expert-parallel group spans several data-parallel engine cores (DP attention + EP
MoE), rank ``r`` of core ``d`` is expert-parallel rank ``d * tensor_parallel_size + r``; the
cores bring different token counts, so every rank pads its share to the largest in the group,
and a core with no tokens takes part through :meth:`FusedMoE.dummy_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    expert_parallel_spans_cores,
    get_ep_communicator,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.interfaces.quantization import FusedMoEMethod
from tokenmill.layers.build_context import current_build_context, current_ops

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)`` from ``router_logits``
    [T, E].

    With groups, each group scores by its best expert (no bias) or by the sum of its two best
    biased scores (with ``e_score_correction_bias``, as DeepSeek-V3); experts outside the
    ``topk_group`` best groups cannot be chosen. The bias only ranks experts: the weights are
    the unbiased scores.
    """
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unsupported scoring_func {scoring_func!r}; supported: {SCORING_FUNCS}")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(
            num_tokens, num_experts
        )
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]
"""``expert_mlp(expert, rows)``: expert ``expert``'s SwiGLU MLP on the [n, H] rows routed to it."""


def run_experts_sorted(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_mlp: ExpertMLP,
) -> torch.Tensor:
    """Routed experts over (token, expert) pairs sorted by expert: one gather, one
    ``expert_mlp`` call per expert that has tokens (on contiguous rows), then the weighted rows
    scattered back to pair order and summed over each token's ``top_k`` (several times faster
    on the CPU than ``index_add_``). [T, H] in, [T, H] out."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x = hidden_states.index_select(0, order // top_k)
    out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        out[start:end] = expert_mlp(expert, x[start:end])
        start = end
    out.mul_(topk_weights.flatten()[order].to(out.dtype).unsqueeze(1))
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1)


def stacked_expert_mlp(w13: torch.Tensor, w2: torch.Tensor) -> ExpertMLP:
    """The experts of stacked weights ``w13`` [E, 2I, H] and ``w2`` [E, H, I], each GEMM
    computed as ``W·xᵀ`` (the weight on the left): for the few rows a decode step gives an
    expert, MKL ran that 2-4x faster than ``x·Wᵀ`` on 2 cores (4 to 64 rows), and no slower
    for prefill-sized groups."""
    inter = w2.shape[2]

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.mm(w13[expert], x.t()).t()
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        return torch.mm(w2[expert], act.t()).t()

    return expert_mlp


class UnquantizedFusedMoEMethod:
    """How a :class:`FusedMoE` layer computes its routed experts from its float weights:
    :func:`run_experts_sorted` with :meth:`expert_mlp` (a
    :class:`~tokenmill.interfaces.quantization.FusedMoEMethod`). A platform's op table may name
    a subclass under ``"unquantized_fused_moe"`` (made with no arguments per layer), e.g. to
    repack the weights for its GEMM library or to run a fused kernel."""

    @staticmethod
    def for_platform() -> UnquantizedFusedMoEMethod:
        """The platform's ``unquantized_fused_moe`` method if its op table has one, else this."""
        return current_ops().get("unquantized_fused_moe", UnquantizedFusedMoEMethod)()

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Repack ``layer``'s stacked weights once the checkpoint is in (the model loader
        calls it)."""

    def expert_mlp(self, layer: FusedMoE, hidden_states: torch.Tensor) -> ExpertMLP:
        """The per-expert computation for ``hidden_states``: :func:`stacked_expert_mlp`."""
        return stacked_expert_mlp(layer.w13_weight, layer.w2_weight)

    def apply(
        self,
        layer: FusedMoE,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' weighted sum for each token: [T, H] in, [T, H] out."""
        return run_experts_sorted(
            hidden_states, topk_weights, topk_ids, layer.num_local_experts,
            self.expert_mlp(layer, hidden_states),
        )


class FusedMoE(nn.Module):
    """Routed SwiGLU experts (plus optional always-on ``shared_experts``) on flat [T, H] input.
    Under tensor parallelism every rank holds all experts, each with a slice of the
    intermediate dimension; the routed and shared partial sums are all-reduced once, so
    ``shared_experts`` must not reduce its own output.

    ``forward(hidden_states, router_logits)`` routes with :func:`select_experts` and returns
    the routed output plus the shared experts' output. ``e_score_correction_bias`` (a float32
    parameter) exists when ``use_correction_bias`` is set. Checkpoint tensors load through
    ``weight_loader(param, tensor, expert_id, shard_id)`` with ``shard_id`` ``"w1"`` (gate),
    ``"w3"`` (up) or ``"w2"`` (down); :meth:`make_expert_params_mapping` lists the names.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        scoring_func: str = "softmax",
        renormalize: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        use_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        shared_experts: nn.Module | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        ep_comm = get_ep_communicator() if current_build_context().enable_expert_parallel else None
        self.ep_size = 1 if ep_comm is None else ep_comm.world_size
        self.ep_rank = 0 if ep_comm is None else ep_comm.rank
        if num_experts % self.ep_size:
            raise ValueError(
                f"{prefix}: {num_experts} experts are not divisible by the expert-parallel size "
                f"{self.ep_size} (enable_expert_parallel with tensor_parallel_size={self.tp_size}"
                f" x {self.ep_size // self.tp_size} data-parallel engine cores)"
            )
        if self.ep_size > 1:
            self.tp_size, self.tp_rank = 1, 0  # whole experts: no slice of the intermediate
        self.num_local_experts = num_experts // self.ep_size
        self.expert_placement = torch.arange(num_experts) // self.num_local_experts
        """Which expert-parallel rank holds each expert."""
        self.expert_local_index = torch.arange(num_experts) % self.num_local_experts
        """Each expert's index among its rank's experts (the rows of ``w13_weight``)."""
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"{prefix}: intermediate size {intermediate_size} is not divisible by "
                f"tensor-parallel size {self.tp_size}"
            )
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"{prefix}: unsupported scoring_func {scoring_func!r}; supported: {SCORING_FUNCS}"
            )
        if num_expert_group and num_experts % num_expert_group:
            raise ValueError(
                f"{prefix}: {num_experts} experts do not split into {num_expert_group} groups"
            )
        if top_k > num_experts:
            raise ValueError(f"{prefix}: top_k {top_k} exceeds the {num_experts} experts")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.scoring_func = scoring_func
        self.renormalize = renormalize
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.shared_experts = shared_experts
        self.prefix = prefix
        self.moe_method = self._moe_method(prefix)
        inter = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, inter), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        if use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)

    def _moe_method(self, prefix: str) -> FusedMoEMethod:
        quant = current_build_context().quant_method
        if quant is None:
            return UnquantizedFusedMoEMethod.for_platform()
        method = quant.get_moe_method(self, prefix)
        if method is None:
            raise NotImplementedError(
                f"{prefix}: quantization method {type(quant).__name__} does not quantize MoE "
                f"experts (it has no get_moe_method)"
            )
        return method

    def process_weights_after_loading(self) -> None:
        """The model loader's post-load hook: the MoE method repacks or quantizes the experts."""
        self.moe_method.process_weights_after_loading(self)

    @staticmethod
    def make_expert_params_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
        """``(parameter prefix, checkpoint prefix, expert id, shard id)`` for every expert's
        gate/up/down projections, as vLLM's mapping."""
        return [
            ("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{e}.{name}.", e, shard)
            for e in range(num_experts)
            for shard, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        ]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard_id: str
    ) -> None:
        """Copy this rank's slice of expert ``expert_id``'s checkpoint projection: rows
        of the gate (``w1``) and up (``w3``) projections, columns of down (``w2``); under
        expert parallelism the whole projection of an expert this rank holds, nothing of the
        others."""
        if int(self.expert_placement[expert_id]) != self.ep_rank:
            return
        expert_id = int(self.expert_local_index[expert_id])
        inter = self.intermediate_size_per_partition
        if shard_id == "w2":
            dst = param.data[expert_id]
            if loaded_weight.shape[-1] == self.intermediate_size:
                loaded_weight = loaded_weight.narrow(1, self.tp_rank * inter, inter)
        elif shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else inter
            dst = param.data[expert_id, offset : offset + inter]
            if loaded_weight.shape[0] == self.intermediate_size:
                loaded_weight = loaded_weight.narrow(0, self.tp_rank * inter, inter)
        else:
            raise ValueError(f"{self.prefix}: unknown expert shard {shard_id!r}")
        if dst.shape != loaded_weight.shape:
            raise ValueError(
                f"{self.prefix}: expert {expert_id} {shard_id} has shape "
                f"{tuple(loaded_weight.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(loaded_weight)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's :func:`select_experts`."""
        return select_experts(
            router_logits,
            self.top_k,
            scoring_func=self.scoring_func,
            renormalize=self.renormalize,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(router_logits)
        if self.ep_size > 1:
            out = self._expert_parallel(hidden_states, topk_weights, topk_ids)
        else:
            out = self.moe_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return tensor_model_parallel_all_reduce(out)

    def dummy_forward(self, dtype: torch.dtype, device: torch.device) -> None:
        """Take part in this layer's expert-parallel collectives with no token of its own: a
        step of an engine core without tokens while another core's step runs (its other
        layers are local to the core and skipped)."""
        empty = torch.empty(0, self.hidden_size, dtype=dtype, device=device)
        ids = torch.empty(0, self.top_k, dtype=torch.int64, device=device)
        self._expert_parallel(empty, torch.empty(0, self.top_k, device=device), ids)

    def _expert_parallel(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output of this rank's share of the tokens (a run of
        ``ceil(T / tensor_parallel_size)``), zero elsewhere: every tensor-parallel rank holds
        all of its engine core's tokens, so the caller's all-reduce assembles them. The share
        is padded with zero-weight rows to the largest share in the expert-parallel group (at
        least one row when the group spans engine cores, so no collective is empty)."""
        comm = get_ep_communicator()
        assert comm is not None
        core_tp_size = get_tensor_model_parallel_world_size()
        num_tokens = hidden_states.shape[0]
        share = -(-num_tokens // core_tp_size)
        start = min(get_tensor_model_parallel_rank() * share, num_tokens)
        end = min(start + share, num_tokens)
        padded = share
        if expert_parallel_spans_cores():
            sizes = comm.all_gather(torch.tensor([share], device=hidden_states.device), dim=0)
            padded = max(1, int(sizes.max()))
        pad = padded - (end - start)
        mine = F.pad(hidden_states[start:end], (0, 0, 0, pad))
        ids = F.pad(topk_ids[start:end], (0, 0, 0, pad))
        weights = F.pad(topk_weights[start:end], (0, 0, 0, pad))
        dispatched = comm.dispatch(mine, weights, ids, self.expert_placement, self.expert_local_index)
        expert_out = dispatched.hidden_states
        if len(expert_out):
            expert_out = self.moe_method.apply(
                self,
                expert_out,
                dispatched.weights.unsqueeze(1),
                dispatched.local_expert_ids.unsqueeze(1),
            )
        routed = comm.combine(expert_out, dispatched)
        out = hidden_states.new_zeros(hidden_states.shape)
        out[start:end] = routed[: end - start]
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, scoring={self.scoring_func}, "
            f"groups={self.num_expert_group}/{self.topk_group}"
        )
