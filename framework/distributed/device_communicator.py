"""The collectives of one process group on one platform's devices (vLLM's
``DeviceCommunicatorBase``): what tensor parallelism (``all_reduce``, ``all_gather``,
``reduce_scatter``), pipeline parallelism (``send``/``recv``) and expert parallelism
(``dispatch``/``combine``, over a pluggable all-to-all backend) call. A platform names its
class with ``Platform.get_device_communicator_cls``; this base runs every collective through
``torch.distributed`` on the group's backend (gloo on the CPU, NCCL on GPUs). It lives with the
parallel state, a base module, so that every layer and plugin may use and subclass it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist


@dataclass
class DispatchedTokens:
    """The (token, expert) pairs a rank runs after ``dispatch``: each pair's hidden state
    ``[N, H]``, its expert as an index into the rank's local experts ``[N]`` and its routing
    weight ``[N]``; ``handle`` is what ``combine`` needs to bring the outputs home."""

    hidden_states: torch.Tensor
    local_expert_ids: torch.Tensor
    weights: torch.Tensor
    handle: Any


class All2AllBackend:
    """How expert parallelism moves tokens to their experts' ranks and back (vLLM's
    ``All2AllManagerBase``). Each rank brings its own ``[T, H]`` tokens (``T`` the same on
    every rank) with their ``topk_ids``/``topk_weights`` ``[T, k]``; ``placement[e]`` is the
    rank holding expert ``e`` and ``local_index[e]`` its index there."""

    name: ClassVar[str] = ""

    def dispatch(
        self,
        comm: DeviceCommunicator,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        placement: torch.Tensor,
        local_index: torch.Tensor,
    ) -> DispatchedTokens:
        raise NotImplementedError

    def combine(self, comm: DeviceCommunicator, expert_out: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        """``[T, H]``: each token's weighted expert outputs (``expert_out`` ``[N, H]``, one row
        per dispatched pair) summed over its ``k`` experts in routing order."""
        raise NotImplementedError


class NaiveAll2All(All2AllBackend):
    """All-gather every rank's tokens, run the pairs whose expert is local, reduce-scatter the
    per-pair outputs back (vLLM's ``naive`` backend): simple, and moves every token to every
    rank."""

    name = "naive"

    def dispatch(self, comm, hidden_states, topk_weights, topk_ids, placement, local_index):
        k = topk_ids.shape[1]
        all_ids = comm.all_gather(topk_ids, dim=0).flatten()
        all_weights = comm.all_gather(topk_weights, dim=0).flatten()
        all_hidden = comm.all_gather(hidden_states, dim=0)
        pairs = (placement[all_ids] == comm.rank).nonzero().squeeze(1)
        return DispatchedTokens(
            all_hidden.index_select(0, pairs // k),
            local_index[all_ids[pairs]],
            all_weights[pairs],
            (pairs, len(all_ids), k),
        )

    def combine(self, comm, expert_out, dispatched):
        pairs, num_pairs, k = dispatched.handle
        per_pair = expert_out.new_zeros(num_pairs, expert_out.shape[1])
        per_pair[pairs] = expert_out
        mine = comm.reduce_scatter(per_pair.view(num_pairs // k, -1), dim=0)
        return mine.view(mine.shape[0], k, -1).sum(dim=1)


class AllToAll(All2AllBackend):
    """Each pair goes only to its expert's rank and back, over two ``all_to_all`` exchanges
    (sizes first): the traffic of a true all-to-all (vLLM's ``pplx``/``deepep`` role)."""

    name = "all_to_all"

    def dispatch(self, comm, hidden_states, topk_weights, topk_ids, placement, local_index):
        k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        dest = placement[flat_ids]
        order = dest.argsort(stable=True)
        send_counts = torch.bincount(dest, minlength=comm.world_size)
        recv_counts = comm.all_to_all(send_counts, [1] * comm.world_size, [1] * comm.world_size)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = comm.all_to_all(hidden_states.index_select(0, order // k), send, recv)
        ids = comm.all_to_all(flat_ids[order], send, recv)
        weights = comm.all_to_all(topk_weights.flatten()[order].contiguous(), send, recv)
        return DispatchedTokens(rows, local_index[ids], weights, (order, send, recv, k))

    def combine(self, comm, expert_out, dispatched):
        order, send, recv, k = dispatched.handle
        back = comm.all_to_all(expert_out, recv, send)
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        return per_pair.view(-1, k, per_pair.shape[1]).sum(dim=1)


ALL2ALL_BACKENDS: dict[str, type[All2AllBackend]] = {b.name: b for b in (NaiveAll2All, AllToAll)}
"""The ``all2all_backend`` values and their classes."""


class DeviceCommunicator:
    """The collectives of ``group`` (None: the world group) for tensors on ``device``;
    ``all2all_backend`` (a key of :data:`ALL2ALL_BACKENDS`) carries expert parallelism's
    dispatch and combine. Ranks in ``send``/``recv`` are ranks of the group."""

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, all2all_backend: str = "naive"
    ) -> None:
        if all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {all2all_backend!r}"
            )
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.all2all = ALL2ALL_BACKENDS[all2all_backend]()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum of every rank's ``x``, split along ``dim`` into equal parts: this rank's."""
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty(x.shape[0] // self.world_size, *x.shape[1:])
        dist.reduce_scatter_single(out, x, group=self.group)
        return out.movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sent to each rank in turn (``send_counts[r]`` to rank ``r``); the rows
        received, ``recv_counts[r]`` from rank ``r``, in rank order."""
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def send(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Start sending ``x`` to rank ``dst``; the returned work completes when it is sent
        (``x`` must live until then)."""
        return dist.isend(x, dist.get_global_rank(self.group, dst) if self.group else dst, group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """A tensor of ``shape`` received from rank ``src``."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return x

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        placement: torch.Tensor,
        local_index: torch.Tensor,
    ) -> DispatchedTokens:
        """Expert parallelism: send each (token, expert) pair to its expert's rank."""
        return self.all2all.dispatch(self, hidden_states, topk_weights, topk_ids, placement, local_index)

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        """Expert parallelism: bring the pairs' outputs home, summed per token."""
        return self.all2all.combine(self, expert_out, dispatched)
