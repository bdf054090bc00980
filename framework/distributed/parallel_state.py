"""The tensor-parallel group: rank, size and the two collectives sharded layers need.

Without an initialised ``torch.distributed`` (or with a group of one) everything is the
identity, so single-device runs pay nothing. The worker that sets up distributed execution
calls :func:`set_tensor_model_parallel_group`; until then the default (world) group is used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def set_tensor_model_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Use ``group`` for tensor parallelism (None: the default world group)."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_tensor_model_parallel_world_size() -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(_TP_GROUP)


def get_tensor_model_parallel_rank() -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(_TP_GROUP)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when distributed)."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
