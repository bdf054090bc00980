"""Persistent per-request buffers on the worker side.

Each running request owns a row of preallocated numpy arrays (token ids, block table, counters,
sampling parameters). Steps only write what changed, then the model runner gathers the rows it
needs with vectorised indexing instead of rebuilding Python lists every step.

Rows of requests using penalties or ``allowed_token_ids`` also own a row of ``[max_reqs, V]``
device tensors (allocated when the first such request arrives): their output token counts,
updated as tokens are appended, their prompt tokens as a mask, and their allowed tokens.
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
    min_tokens_suppress: list[int]
    """Token ids forbidden until ``min_tokens`` outputs exist: EOS and ``stop_token_ids``."""
    lora_int_id: int = 0
    """The request's LoRA adapter, 0 for the base model."""


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.proposer_num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        """Positions ``[0, n)`` of each row are in the speculative proposer's cache (prefix-cache
        hits are taken as in it); ``TargetStep.cache_start_positions``."""
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds: dict[int, int] = {}
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.uses_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.uses_allowed = np.zeros(max_num_reqs, dtype=bool)
        self.lora_int_id = np.zeros(max_num_reqs, dtype=np.int64)
        self.output_token_counts: torch.Tensor | None = None
        """``[max_reqs, V]`` int32 counts of each row's output tokens (penalty rows only)."""
        self.prompt_token_mask: torch.Tensor | None = None
        """``[max_reqs, V]`` bool: the token occurs in the row's prompt (penalty rows only)."""
        self.disallowed_mask: torch.Tensor | None = None
        """``[max_reqs, V]`` bool: the token is not in the row's ``allowed_token_ids``."""
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
        min_tokens_suppress: list[int],
        lora_int_id: int = 0,
    ) -> CachedRequestState:
        """Fill a free row for the request; the row is taken only once that succeeded."""
        row = self._free_rows[-1]
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.proposer_num_computed[row] = num_computed_tokens
        self.set_blocks(row, block_ids)
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k < self.vocab_size else 0
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.uses_penalties[row] = params.uses_penalties
        if params.uses_penalties:
            self._init_penalty_row(row, token_ids, num_prompt_tokens)
        self.uses_allowed[row] = params.allowed_token_ids is not None
        if params.allowed_token_ids is not None:
            if self.disallowed_mask is None:
                self.disallowed_mask = self._vocab_tensor(torch.bool)
            self.disallowed_mask[row] = True
            self.disallowed_mask[row, self._ids(params.allowed_token_ids)] = False
        self.lora_int_id[row] = lora_int_id
        state = CachedRequestState(
            req_id, row, num_prompt_tokens, params, min_tokens_suppress, lora_int_id
        )
        self._free_rows.pop()
        if params.seed is not None:
            self.seeds[row] = params.seed
        self.requests[req_id] = state
        return state

    def _vocab_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.max_num_reqs, self.vocab_size, dtype=dtype, device=self.device)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _init_penalty_row(self, row: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        if self.output_token_counts is None:
            self.output_token_counts = self._vocab_tensor(torch.int32)
            self.prompt_token_mask = self._vocab_tensor(torch.bool)
        assert self.prompt_token_mask is not None
        self.prompt_token_mask[row] = False
        self.prompt_token_mask[row, self._ids(token_ids[:num_prompt_tokens])] = True
        counts = self.output_token_counts[row]
        counts.zero_()
        output = self._ids(token_ids[num_prompt_tokens:])
        counts.index_add_(0, output, torch.ones_like(output, dtype=torch.int32))

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows``, counting it for penalty rows."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        penalised = self.uses_penalties[rows]
        if penalised.any():
            assert self.output_token_counts is not None
            index = torch.from_numpy(np.stack([rows[penalised], token_ids[penalised]])).to(self.device)
            self.output_token_counts.index_put_(
                (index[0], index[1]),
                torch.ones(index.shape[1], dtype=torch.int32, device=self.device),
                accumulate=True,
            )

    def remove(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.seeds.pop(state.row, None)
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
