"""The parallel groups: the tensor-parallel group (rank, size and the two collectives sharded
layers need) and the pipeline stages (which stage this rank is, which layers it holds, and the
stage-to-stage send/recv of activations).

Without an initialised ``torch.distributed`` (or with a group of one) everything is the
identity, so single-device runs pay nothing. A worker of a multi-rank executor calls
:func:`init_distributed_environment` before it builds the model and
:func:`destroy_distributed_environment` when it stops. Every collective runs through the
platform's device communicator (``Platform.get_device_communicator_cls``, a
:class:`~tokenmill.distributed.device_communicator.DeviceCommunicator`): one for the stage's
tensor-parallel group, one for the world (the stage-to-stage sends). A caller that initialised
``torch.distributed`` itself gets the base communicator over its world group.

Ranks are laid out as vLLM's: ``rank = stage * tensor_parallel_size + tp_rank``; a stage's
ranks form its tensor-parallel group, and each sends its activations to the rank with the
same ``tp_rank`` in the next stage.

Expert parallelism runs over the expert-parallel group: the tensor-parallel group, or, when
the experts span ``data_parallel_size`` engine cores (DP attention + EP MoE), the ranks of
every core, core ``d``'s rank ``r`` being expert-parallel rank ``d * world_size + r``. The
process group then spans all cores' ranks; each core's ranks form its tensor-parallel group.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill import envs
from tokenmill.distributed.device_communicator import DeviceCommunicator

_TP_COMM: DeviceCommunicator | None = None
"""The tensor-parallel group's device communicator (None: not made here)."""
_WORLD_COMM: DeviceCommunicator | None = None
"""The communicator of this engine core's ranks (the stages' sends; None: not made here)."""
_EP_COMM: DeviceCommunicator | None = None
"""The expert-parallel group's communicator when it spans several engine cores' ranks (None:
it is the tensor-parallel group)."""
_EP_PIDS: list[int] = []
"""The process id of each expert-parallel rank spanning several engine cores."""
_PP_RANK = 0
_PP_SIZE = 1
_TP_SIZE = 1
_PENDING_SEND: list[tuple[dist.Work, torch.Tensor]] = []
"""The send of the previous step's activations, waited for before the next one."""

INIT_TIMEOUT = timedelta(minutes=5)
"""How long ranks wait for each other at rendezvous and in a collective."""


def init_distributed_environment(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    pipeline_parallel_size: int,
    communicator_cls: type[DeviceCommunicator],
    device: torch.device,
    all2all_backend: str = "naive",
    expert_parallel_cores: int = 1,
    core_index: int = 0,
) -> None:
    """Join the ``world_size`` ranks at ``init_method`` (``tcp://host:port``) over ``backend``
    (the platform's ``dist_backend``), split into ``pipeline_parallel_size`` stages whose
    ranks form the tensor-parallel groups (one stage: the world group is the TP group), each
    group with a ``communicator_cls(group, device, all2all_backend)``.

    ``expert_parallel_cores > 1`` (one stage only): the ranks of that many engine cores meet
    at ``init_method``, this one being core ``core_index``'s rank ``rank``, and all of them
    form the expert-parallel group."""
    global _PP_RANK, _PP_SIZE, _TP_SIZE, _TP_COMM, _WORLD_COMM, _EP_COMM, _EP_PIDS
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=core_index * world_size + rank,
        world_size=expert_parallel_cores * world_size,
        timeout=INIT_TIMEOUT,
    )
    _TP_SIZE = world_size // pipeline_parallel_size
    _PP_SIZE = pipeline_parallel_size
    _PP_RANK = rank // _TP_SIZE
    group = world_group = None
    if pipeline_parallel_size > 1:
        for stage in range(pipeline_parallel_size):
            ranks = list(range(stage * _TP_SIZE, (stage + 1) * _TP_SIZE))
            stage_group = dist.new_group(ranks, timeout=INIT_TIMEOUT)
            if stage == _PP_RANK:
                group = stage_group
    if expert_parallel_cores > 1:
        assert pipeline_parallel_size == 1
        for core in range(expert_parallel_cores):
            ranks = list(range(core * world_size, (core + 1) * world_size))
            core_group = dist.new_group(ranks, timeout=INIT_TIMEOUT)
            if core == core_index:
                group = world_group = core_group
        _EP_COMM = communicator_cls(None, device, all2all_backend)
        _EP_PIDS = _EP_COMM.all_gather(torch.tensor([os.getpid()], device=device), dim=0).tolist()
    _WORLD_COMM = communicator_cls(world_group, device, all2all_backend)
    _TP_COMM = communicator_cls(group, device, all2all_backend)


def destroy_distributed_environment() -> None:
    """Leave the process group after a barrier, so no rank closes its connections while
    another still uses them. Ranks of several engine cores leave without one: the cores
    stopped together with no collective in flight, and the other cores' ranks, which their own
    executors stop, would meet the barrier at other times (a rank that has passed it and exits
    resets the connections of one still in it)."""
    global _PP_RANK, _PP_SIZE, _TP_SIZE, _TP_COMM, _WORLD_COMM, _EP_COMM, _EP_PIDS
    if dist.is_available() and dist.is_initialized():
        _wait_for_send()
        if _EP_COMM is None:
            dist.barrier()
        dist.destroy_process_group()
    _PP_RANK, _PP_SIZE, _TP_SIZE, _TP_COMM, _WORLD_COMM, _EP_COMM, _EP_PIDS = 0, 1, 1, None, None, None, []


def get_tp_communicator() -> DeviceCommunicator | None:
    """The tensor-parallel group's device communicator: the one
    :func:`init_distributed_environment` made, else the base one over the world group of a
    caller that initialised ``torch.distributed`` itself; None without ``torch.distributed``."""
    if _TP_COMM is not None:
        return _TP_COMM
    if dist.is_available() and dist.is_initialized():
        return DeviceCommunicator(None, torch.device("cpu"))
    return None


def get_ep_communicator() -> DeviceCommunicator | None:
    """The expert-parallel group's device communicator: the one spanning several engine
    cores' ranks, else the tensor-parallel group's."""
    return _EP_COMM if _EP_COMM is not None else get_tp_communicator()


def expert_parallel_spans_cores() -> bool:
    """Whether the expert-parallel group holds other engine cores' ranks, so that every
    step's MoE collectives must be met by every core (an idle one with a dummy step)."""
    return _EP_COMM is not None


def dead_expert_parallel_ranks() -> list[tuple[int, int]]:
    """``(expert-parallel rank, pid)`` of the ranks (of any engine core, all on this
    machine) whose process has exited: what a failed collective is blamed on."""
    return [(rank, pid) for rank, pid in enumerate(_EP_PIDS) if not _process_running(pid)]


def expert_rank_names(dead: list[tuple[int, int]]) -> str:
    """How errors name the dead ranks of :func:`dead_expert_parallel_ranks`."""
    return ", ".join(f"expert-parallel rank {rank} (pid {pid})" for rank, pid in dead)


def _process_running(pid: int) -> bool:
    """Whether ``pid`` runs (not exited, not a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def get_tensor_model_parallel_world_size() -> int:
    comm = get_tp_communicator()
    return 1 if comm is None else comm.world_size


def get_tensor_model_parallel_rank() -> int:
    comm = get_tp_communicator()
    return 0 if comm is None else comm.rank


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when distributed)."""
    comm = get_tp_communicator()
    return x if comm is None or comm.world_size == 1 else comm.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    comm = get_tp_communicator()
    return x if comm is None or comm.world_size == 1 else comm.all_gather(x, dim)


def get_pipeline_model_parallel_world_size() -> int:
    """How many pipeline stages there are (1 without pipeline parallelism)."""
    return _PP_SIZE


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage, from 0."""
    return _PP_RANK


def is_first_pp_rank() -> bool:
    """Whether this stage embeds the tokens."""
    return _PP_RANK == 0


def is_last_pp_rank() -> bool:
    """Whether this stage holds the final norm and the LM head (and samples)."""
    return _PP_RANK == _PP_SIZE - 1


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The ``[start, end)`` layers of stage ``pp_rank``: ``TOKENMILL_PP_LAYER_PARTITION``
    (layers per stage, comma-separated, summing to ``num_layers``) when set, else an even
    split whose remainder goes to the stages before the last (which also runs the LM head),
    as vLLM's ``get_pp_indices``."""
    partition = envs.TOKENMILL_PP_LAYER_PARTITION
    if partition is not None:
        sizes = _parse_partition(partition, num_layers, pp_size)
    else:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def check_pp_partition(num_layers: int, pp_size: int) -> None:
    """Raise ``ValueError`` naming the setting when ``pp_size`` stages cannot each hold at
    least one of ``num_layers`` layers (or the explicit partition does not fit)."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers: "
            f"every stage needs at least one layer"
        )
    partition = envs.TOKENMILL_PP_LAYER_PARTITION
    if partition is not None:
        _parse_partition(partition, num_layers, pp_size)


def _parse_partition(partition: list[str], num_layers: int, pp_size: int) -> list[int]:
    try:
        sizes = [int(n) for n in partition]
    except ValueError:
        raise ValueError(
            f"TOKENMILL_PP_LAYER_PARTITION={','.join(partition)!r} must be integers"
        ) from None
    if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(
            f"TOKENMILL_PP_LAYER_PARTITION={','.join(partition)!r} must give each of the "
            f"pipeline_parallel_size={pp_size} stages at least one layer, {num_layers} in all"
        )
    return sizes


def pp_send(tensor: torch.Tensor) -> None:
    """Send ``tensor`` to this rank's peer in the next stage without waiting for it to be
    received (the previous step's send is waited for first, so at most one is in flight)."""
    _wait_for_send()
    tensor = tensor.contiguous()
    _PENDING_SEND.append((_WORLD_COMM.send(tensor, _WORLD_COMM.rank + _TP_SIZE), tensor))


def _wait_for_send() -> None:
    for work, _ in _PENDING_SEND:
        work.wait()
    _PENDING_SEND.clear()


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Receive a tensor of ``shape`` from this rank's peer in the previous stage."""
    return _WORLD_COMM.recv(shape, dtype, _WORLD_COMM.rank - _TP_SIZE)
