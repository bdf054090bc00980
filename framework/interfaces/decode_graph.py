"""Decode graphs: a decode step's forward captured once per size and replayed (vLLM's FULL
CUDA-graph mode, generalised so that each platform says what a capture is).

At start-up the whole model forward is captured once per batch size in ``capture_sizes`` over
static input and attention-metadata buffers. A decode-only step (every request schedules one
token) of ``n`` requests is copied into those buffers, padded to the nearest captured size
(padding requests have no context and slot ``-1``, so they write nothing and read nothing), and
the graph is replayed.

A speculative verification step (up to ``k + 1`` tokens per request, ``n`` in all) replays the
graph of ``n`` rows too: each token becomes a decode row of its own, with its request's block
table and the context up to itself. Every row writes its key and value before any row attends,
so a token sees the earlier tokens of its step as it does in the eager forward. Each row reads
its request's context again, so steps with longer queries (prefill chunks) run eagerly, as do
steps above the largest size.

A backend takes part when its metadata builder implements :class:`GraphCapturableBuilder`.
:class:`DecodeGraphRunner` holds what every kind of graph shares (static buffers, padding, the
step's copy-in); a platform subclasses it and names its subclass
(``Platform.decode_graph_runner``): CUDA graphs on the CUDA platform
(``tokenmill.platforms.cuda_graph``), recorded C kernel calls on the CPU
(``tokenmill.platforms.cpu_graph``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from tokenmill.interfaces.attention import CommonAttentionMetadata

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


@runtime_checkable
class GraphCapturableBuilder(Protocol):
    """What a metadata builder provides to have decode steps captured."""

    def build_for_graph(self, common: CommonAttentionMetadata) -> Any:
        """Metadata for a graph over ``common``'s device tensors, which are static buffers: it
        must read them in place (and may own further persistent buffers)."""

    def update_for_graph(self, metadata: Any, common: CommonAttentionMetadata) -> None:
        """Refresh ``metadata`` after the runner wrote a new step into the static buffers
        (``common``'s CPU tensors describe that step, padded); runs before each replay."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (at most
    ``MAX_CAPTURE_SIZE``), which is always included."""
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= largest} | set(range(8, largest + 1, 8)) | {largest}
    return sorted(sizes)


class DecodeGraphRunner:
    """Captures the model forward for decode-only batches over static buffers and replays it;
    subclasses (one per platform) say what a capture and a replay are.

    ``max_blocks_per_req`` is the block-table width of the runner's input batch;
    ``max_model_len`` bounds every sequence a replay may see; ``tokens_per_request`` is the
    longest query a replayed step may have (``1 + k`` with speculative decoding)."""

    def __init__(
        self,
        model: nn.Module,
        builder: GraphCapturableBuilder,
        sizes: list[int],
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        tokens_per_request: int = 1,
    ) -> None:
        self.model = model
        self.tokens_per_request = tokens_per_request
        self.builder = builder
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            largest, max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[int, Any] = {}
        """Size -> its captured graph (with ``metadata`` and ``output`` attributes)."""

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        model: nn.Module,
        builder: Any,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> DecodeGraphRunner | None:
        """The platform's runner (``Platform.decode_graph_runner``) with its sizes captured, or
        None where graphs don't apply: no runner on this platform, ``enforce_eager``,
        ``enable_lora`` (the slot mapping is set outside the recorded calls), pipeline parallelism,
        experts spanning data-parallel engine cores,
        ``calculate_kv_scales`` (a capture's dummy batch would be the step the scales come
        from), a backend whose builder cannot be captured, or a runner that captured nothing."""
        if config.max_model_len is None:
            raise ValueError("decode graphs need a resolved config: max_model_len is None")
        runner_cls = config.platform_cls.decode_graph_runner(config)
        if runner_cls is None or config.enforce_eager:
            return None
        if config.enable_lora:
            logger.info("decode graphs off: LoRA layers change their inputs every step")
            return None
        if config.pipeline_parallel_size > 1:
            logger.info("decode graphs off: pipeline stages exchange activations between steps")
            return None
        if config.expert_parallel_across_data_parallel:
            logger.info("decode graphs off: the MoE layers pad to the engine cores' largest step")
            return None
        if config.calculate_kv_scales:
            logger.info("decode graphs off: calculate_kv_scales takes the scales from the first real step")
            return None
        if not isinstance(builder, GraphCapturableBuilder):
            return None
        per_request = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
        sizes = runner_cls.sizes_for(config.max_num_seqs * per_request)
        runner = runner_cls(
            model, builder, sizes, max_blocks_per_req, config.max_model_len, device, per_request
        )
        runner.capture()
        return runner if runner.graphs else None

    @staticmethod
    def sizes_for(max_rows: int) -> list[int]:
        """The batch sizes to capture, for steps of up to ``max_rows`` decode rows."""
        return capture_sizes(max_rows)

    def capture(self) -> None:
        """Capture every size (``self.graphs``). The dummy batch gives every request one token
        of context in block 0 and writes no KV."""
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        """Run a captured graph over the static buffers."""
        raise NotImplementedError

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> Any:
        """The model's output for the step's tokens by graph replay (hidden states [n, hidden],
        or the model's tuple of such), or None when the step has more tokens than the largest
        graph or a query longer than ``tokens_per_request`` (run it eagerly). The result lives
        in the graphs' memory: use it before the next call."""
        n = common.num_actual_tokens
        if n > max(self.graphs) or common.max_query_len > self.tokens_per_request:
            return None
        size = min(s for s in self.graphs if s >= n)
        graph = self.graphs[size]
        if common.max_query_len == 1:
            seq_lens_cpu, seq_lens, block_table = common.seq_lens_cpu, common.seq_lens, common.block_table
        else:
            starts = common.query_start_loc_cpu
            request = torch.repeat_interleave(torch.arange(common.num_reqs), starts[1:] - starts[:-1])
            seq_lens_cpu = (
                common.num_computed_tokens_cpu[request] + torch.arange(n, dtype=torch.int32) - starts[request] + 1
            ).to(torch.int32)
            seq_lens = seq_lens_cpu.to(self.seq_lens.device)
            block_table = common.block_table[request.to(common.block_table.device)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_table[:n, : block_table.shape[1]].copy_(block_table)
        self.slot_mapping[:n].copy_(common.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        padded = torch.zeros(size, dtype=torch.int32)
        padded[:n] = seq_lens_cpu
        self.builder.update_for_graph(graph.metadata, self._common(size, padded))
        self.replay(graph)
        if isinstance(graph.output, tuple):
            return tuple(t[:n] for t in graph.output)
        return graph.output[:n]

    def _common(self, size: int, seq_lens_cpu: torch.Tensor) -> CommonAttentionMetadata:
        """The static buffers' first ``size`` rows as a decode batch of ``size`` requests."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=(seq_lens_cpu - 1).clamp(min=0),
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
