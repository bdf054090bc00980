"""The tensor-parallel group: rank, size and the two collectives sharded layers need.

Without an initialised ``torch.distributed`` (or with a group of one) everything is the
identity, so single-device runs pay nothing. A worker of a multi-rank executor calls
:func:`init_distributed_environment` before it builds the model and
:func:`destroy_distributed_environment` when it stops; a caller that manages its own process
group may point the layers at it with :func:`set_tensor_model_parallel_group`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None

INIT_TIMEOUT = timedelta(minutes=5)
"""How long ranks wait for each other at rendezvous and in a collective."""


def init_distributed_environment(
    backend: str, init_method: str, rank: int, world_size: int
) -> None:
    """Join the ``world_size`` ranks at ``init_method`` (``tcp://host:port``) over ``backend``
    (the platform's ``dist_backend``); the world group is the tensor-parallel group."""
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=INIT_TIMEOUT
    )
    set_tensor_model_parallel_group(None)


def destroy_distributed_environment() -> None:
    """Leave the process group after a barrier, so no rank closes its connections while
    another still uses them."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def set_tensor_model_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Use ``group`` for tensor parallelism (None: the default world group)."""
    global _TP_GROUP
    _TP_GROUP = group


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
