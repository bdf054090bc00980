"""CUDA graphs for decode steps: the CUDA platform's :class:`DecodeGraphRunner`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.decode_graph import DecodeGraphRunner


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    metadata: Any
    output: torch.Tensor | tuple[torch.Tensor, ...]


class CudaGraphRunner(DecodeGraphRunner):
    """CUDA graphs, one per size, sharing one memory pool."""

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first so the smaller graphs reuse its memory pool. Each size first runs
        once eagerly (kernel compilation, backend planning)."""
        pool = torch.cuda.graph_pool_handle()
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        for size in reversed(self.sizes):
            common = self._common(size, torch.ones(size, dtype=torch.int32))
            metadata = self.builder.build_for_graph(common)
            with set_forward_context(metadata):
                self.model(self.input_ids[:size], self.positions[:size])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = _Graph(graph, metadata, output)
        torch.cuda.synchronize()

    def replay(self, graph: _Graph) -> None:
        graph.graph.replay()
