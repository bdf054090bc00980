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
OpenMP region, as llama.cpp computes a graph. A size that fails any of these ends the capture (larger ones would fail alike) and runs
eagerly. In practice: the quantization methods with C kernels (gguf, int8, int4, fp8) are
captured at every size; float32 weights up to ``STREAM_MAX_ROWS`` rows (64, 4 with AVX-512),
where their products are C calls (``platforms/cpu_linear.py``), not oneDNN. Graphs stop at
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
from tokenmill.interfaces.decode_graph import DecodeGraphRunner

logger = logging.getLogger(__name__)

MAX_SIZE = 64

_aten = torch.ops.aten
ALLOWED_OPS = {
    _aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided, _aten.new_empty_strided,
    _aten.view, _aten._unsafe_view, _aten._reshape_alias, _aten.as_strided, _aten.alias,
    _aten.detach, _aten.split, _aten.split_with_sizes, _aten.unbind, _aten.slice, _aten.select,
    _aten.transpose, _aten.t, _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.expand,
}
"""Torch ops a captured forward may run: they allocate or view, and compute nothing."""
VIEW_OR_COPY_OPS = {_aten.reshape, _aten.flatten, _aten.contiguous}
"""Ops a captured forward may run when they return a view of their input (no copy)."""


class NotCapturable(Exception):
    """Why a forward cannot be replayed from its kernel calls."""


class _Recorder(TorchDispatchMode):
    """While active: every C kernel call of ``tokenmill.ops.cpu`` is run and recorded, every
    tensor a torch op returns is kept, and torch ops outside ``ALLOWED_OPS`` are noted."""

    def __init__(self) -> None:
        super().__init__()
        self.lib = cpu_ops.load()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        self.kept: list[Any] = []
        self.refused: set[str] = set()
        self.thread = threading.get_ident()
        """The capturing thread: another engine's kernel calls in another thread run unrecorded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket
        if op not in ALLOWED_OPS and not (op in VIEW_OR_COPY_OPS and _same_storage(out, args[0])):
            self.refused.add(str(op))
        self.kept.append(out)
        return out

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
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        for size in self.sizes:
            try:
                self.graphs[size] = self._capture(size)
            except NotCapturable as e:
                if not self.graphs:
                    logger.info("CPU decode graphs off: %s", e)
                    return
                logger.info("CPU decode graphs stop at %d tokens (%d: %s)", max(self.graphs), size, e)
                break
        logger.info(
            "CPU decode graphs for steps of %s tokens (%d kernel calls per step of 1)",
            ", ".join(map(str, self.graphs)),
            len(self.graphs[min(self.graphs)].plan),
        )

    def _capture(self, size: int) -> CpuGraph:
        common = self._common(size, torch.ones(size, dtype=torch.int32))
        metadata = self.builder.build_for_graph(common)
        ids, positions = self.input_ids[:size], self.positions[:size]
        with set_forward_context(metadata):
            expected = [t.clone() for t in _tensors(self.model(ids, positions))]
            with _Recorder() as recorder:
                output = self.model(ids, positions)
        if recorder.refused:
            raise NotCapturable(f"the forward runs torch op(s) {', '.join(sorted(recorder.refused))}")
        try:
            plan = cpu_ops.pack_plan([(kernel.__name__, args) for kernel, args in recorder.calls])
        except ValueError as e:
            raise NotCapturable(str(e)) from e
        graph = CpuGraph(plan, recorder.kept, metadata, output)
        for t in _tensors(output):
            t.fill_(float("nan"))
        self.replay(graph)
        if not all(map(torch.equal, _tensors(output), expected)):
            raise NotCapturable("a replay differs from the eager forward")
        return graph

    def replay(self, graph: CpuGraph) -> None:
        cpu_ops.run_plan(graph.plan)
