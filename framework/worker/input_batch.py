"""Persistent per-request buffers on the worker side.

Each running request owns a row of preallocated numpy arrays (token ids, block table, counters,
sampling parameters). Steps only write what changed, then the model runner gathers the rows it
needs with vectorised indexing instead of rebuilding Python lists every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    min_tokens_suppress: list[int]
    """Token ids forbidden until ``min_tokens`` outputs exist: EOS and ``stop_token_ids``."""


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        block_ids: list[int],
        num_computed_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        min_tokens_suppress: list[int],
    ) -> CachedRequestState:
        row = self._free_rows.pop()
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.set_blocks(row, block_ids)
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        state = CachedRequestState(
            req_id, row, num_prompt_tokens, params, generator, min_tokens_suppress
        )
        self.requests[req_id] = state
        return state

    def remove(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
        return state

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def token_list(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_tokens[row]].tolist()
