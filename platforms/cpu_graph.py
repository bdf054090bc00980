"""Decode graphs on the CPU: a decode step's C kernel calls, recorded once and replayed.

A small batch's decode step on the CPU is mostly Python: each layer walks a dozen modules to
issue a handful of C kernel calls (``tokenmill.ops.cpu``), most only microseconds of work. Like a
CUDA graph, a CPU graph records those calls once per number of rows over the static input and
metadata buffers of :class:`~tokenmill.interfaces.decode_graph.DecodeGraphRunner`, and a step of that
many tokens (decode rows, or a speculative verification's k + 1 tokens per request) replays them
with no module, dispatcher or allocator between them.

A capture is kept only when the forward is nothing but C kernel calls on memory that stays put:
it runs under a torch dispatch mode that refuses every torch op other than allocating and
viewing (a oneDNN product, an ``index_copy_``, an add); the tensors it allocates are held by the
graph, so the recorded pointers stay valid; and a replay must reproduce the eager forward bit for
bit. A replay is one C call (``cpu_ops.run_plan``): the recorded calls, packed, run in one
OpenMP region, as llama.cpp computes a graph. A size that fails any of these runs eagerly, and
so do the sizes above it (they would fail alike). In practice: int8, int4 and fp8 weights are
captured at every size, gguf up to ``GEMV_MAX_ROWS`` (8) and float32 up to ``STREAM_MAX_ROWS``
rows (64, 4 with AVX-512), where their products are C calls (``platforms/cpu_linear.py``), not
a float GEMM or oneDNN.

As CUDA graphs share one memory pool, the graphs share the largest one's intermediate tensors:
it is captured first, and each smaller one's n-th allocation lies on the largest's n-th
(``_Recorder.pool``). Graphs replay one at a time and a replay's output is used before the
next, so they never need those tensors at once. The default model in float32 or int8 keeps
0.33 GB less resident for it (``VmRSS`` right after ``LLM(kv_cache_memory_bytes=2**28)`` on 2
AVX2 cores: 2.16 → 1.83 GB, 1.35 → 1.02 GB).
Graphs stop at
``MAX_SIZE`` rows; beyond 16, a step pads to the next captured size (``sizes_for``). Up to
there a step's Python still shows: the default model in float32, 2 AVX2 cores of an AMD EPYC,
graphs up to 16 rows against up to 64 (``python benchmarks/spec_decode.py --workload chat,short
--concurrencies 20,28,40,64 --configs none --output-len 64 --repeats 2``, the two checkouts
alternated twice, best output tokens/s of each run): chat prompts at 20, 28, 40, 64 requests
372-374 / 391-411 / 431-450 / 466-475 against 415-432 / 453-479 / 489-510 / 521-544, short
ones 409-422 / 460-481 / 516-532 / 562-569 against 498-518 / 556-579 / 604-608 / 639-647. The
eight more captures cost the engine's start about a second.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.forward_context import set_forward_context
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu_memory import return_freed_heap
from tokenmill.interfaces.decode_graph import DecodeGraphRunner

logger = logging.getLogger(__name__)

MAX_SIZE = 64

_aten = torch.ops.aten
ALLOCATING_OPS = {_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided, _aten.new_empty_strided}
"""Torch ops that allocate a tensor (its values unset), which a captured forward may run."""
ALLOWED_OPS = {
    _aten.view, _aten._unsafe_view, _aten._reshape_alias, _aten.as_strided, _aten.alias,
    _aten.detach, _aten.chunk, _aten.split, _aten.split_with_sizes, _aten.unbind, _aten.slice, _aten.select,
    _aten.transpose, _aten.t, _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.expand,
}
"""Torch ops a captured forward may run besides allocating: they view, and compute nothing."""
VIEW_OR_COPY_OPS = {_aten.reshape, _aten.flatten, _aten.contiguous}
"""Ops a captured forward may run when they return a view of their input (no copy)."""


class NotCapturable(Exception):
    """Why a forward cannot be replayed from its kernel calls."""


class _Recorder(TorchDispatchMode):
    """While active: every C kernel call of ``tokenmill.ops.cpu`` is run and recorded, every
    tensor a torch op returns is kept, and the first torch op outside ``ALLOCATING_OPS`` and
    ``ALLOWED_OPS`` ends the forward (``NotCapturable``) before the tensors it keeps add up to
    a whole forward's. Given a ``pool`` (the largest graph's allocations), the n-th
    allocation lies on the pool's n-th where it fits."""

    def __init__(self, pool: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.lib = cpu_ops.load()
        self.pool = pool or []
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        self.kept: list[Any] = []
        self.allocations: list[torch.Tensor] = []
        """The tensors the forward allocated, in order."""
        self.thread = threading.get_ident()
        """The capturing thread: another engine's kernel calls in another thread run unrecorded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket
        if op in ALLOCATING_OPS:
            out = self._from_pool(out)
            self.allocations.append(out)
        elif op not in ALLOWED_OPS and not (op in VIEW_OR_COPY_OPS and _same_storage(out, args[0])):
            raise NotCapturable(f"the forward runs torch op {op}")
        self.kept.append(out)
        return out

    def _from_pool(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` moved onto the storage of the pool's allocation at the same place in the order
        of allocation, where that one has its dtype and room for it; else ``out`` itself."""
        slot = self.pool[len(self.allocations)] if len(self.allocations) < len(self.pool) else None
        if slot is None or slot.dtype != out.dtype or slot.untyped_storage().nbytes() < out.untyped_storage().nbytes():
            return out
        return out.new_empty(0).set_(slot.untyped_storage(), 0, out.shape, out.stride())

    def __enter__(self) -> _Recorder:
        self.kernels = {name: getattr(self.lib, name) for name in cpu_ops.SIGNATURES}
        for name, kernel in self.kernels.items():

            def record(*args: Any, _kernel: Any = kernel) -> None:
                _kernel(*args)
                if threading.get_ident() == self.thread:
                    self.calls.append((_kernel, args))

            setattr(self.lib, name, record)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, kernel in self.kernels.items():
            setattr(self.lib, name, kernel)
        super().__exit__(*exc)


def _tensors(output: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


def _same_storage(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


@dataclass
class CpuGraph:
    plan: Any
    """The recorded kernel calls, packed (``cpu_ops.pack_plan``)."""
    kept: list[Any]
    allocations: list[torch.Tensor]
    """The tensors the forward allocated, in order (the largest graph's are the others' pool)."""
    metadata: Any
    output: torch.Tensor | tuple[torch.Tensor, ...]


class CpuGraphRunner(DecodeGraphRunner):
    """Recorded C kernel calls, one list per size, smallest size first."""

    @staticmethod
    def sizes_for(max_rows: int) -> list[int]:
        """Every size up to 16, then every 4th up to 32 and every 8th up to ``MAX_SIZE``, and
        ``max_rows`` where it is smaller: a padding row costs a CPU step as much as a real one,
        so the steps between stay close (at most 3 rows padded to 32, 7 beyond), while each
        size costs a capture at start-up."""
        largest = min(max_rows, MAX_SIZE)
        sizes = {*range(1, 17), *range(20, 33, 4), *range(40, MAX_SIZE + 1, 8)}
        return sorted({s for s in sizes if s < largest} | {largest})

    @torch.inference_mode()
    def capture(self) -> None:
        """The largest size first, then the others from the smallest up, on the largest's
        memory. Where the largest cannot be captured, the others are captured with memory of
        their own, from the smallest up to the first that cannot, and the heap the failed
        capture freed goes back to the OS."""
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        *smaller, largest = self.sizes
        failure = None
        try:
            pooled = self._capture(largest)
        except NotCapturable as e:
            pooled, failure = None, (largest, e)
        for size in smaller:
            try:
                self.graphs[size] = self._capture(size, pooled.allocations if pooled else None)
            except NotCapturable as e:
                failure = (size, e)
                break
        if pooled:
            self.graphs[largest] = pooled
        else:
            return_freed_heap()
        if failure and not self.graphs:
            logger.info("CPU decode graphs off: %s", failure[1])
            return
        if failure:
            logger.info("CPU decode graphs stop below %d tokens (%s)", *failure)
        logger.info(
            "CPU decode graphs for steps of %s tokens (%d kernel calls per step of 1)",
            ", ".join(map(str, self.graphs)),
            len(self.graphs[min(self.graphs)].plan),
        )

    def _capture(self, size: int, pool: list[torch.Tensor] | None = None) -> CpuGraph:
        common = self._common(size, torch.ones(size, dtype=torch.int32))
        metadata = self.builder.build_for_graph(common)
        ids, positions = self.input_ids[:size], self.positions[:size]
        with set_forward_context(metadata):
            expected = [t.clone() for t in _tensors(self.model(ids, positions))]
            with _Recorder(pool) as recorder:
                output = self.model(ids, positions)
        try:
            plan = cpu_ops.pack_plan([(kernel.__name__, args) for kernel, args in recorder.calls])
        except ValueError as e:
            raise NotCapturable(str(e)) from e
        graph = CpuGraph(plan, recorder.kept, recorder.allocations, metadata, output)
        for t in _tensors(output):
            t.fill_(float("nan"))
        self.replay(graph)
        if not all(map(torch.equal, _tensors(output), expected)):
            raise NotCapturable("a replay differs from the eager forward")
        return graph

    def replay(self, graph: CpuGraph) -> None:
        cpu_ops.run_plan(graph.plan)
