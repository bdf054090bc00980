"""The engine core's view of one request and its state machine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """WAITING -> RUNNING -> (PREEMPTED -> WAITING ->) ... -> one of the FINISHED states.
    A request whose KV a connector loads asynchronously waits in WAITING_FOR_REMOTE_KVS (in
    the waiting queue, holding its blocks) until the load finished, then is WAITING again."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """A request inside the engine core. ``num_computed_tokens`` counts tokens whose KV is in the
    cache (or scheduled to be this step); the scheduler drives it toward ``num_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify in the request's next step (speculative decoding)."""
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(default_factory=list)
    block_hasher: Callable[[Request], None] | None = None
    structured_output_request: StructuredOutputRequest | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """What the client sent for this request's KV connector (vLLM's ``kv_transfer_params``)."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.block_hasher is not None:
            self.block_hasher(self)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.block_hasher is not None:
            self.block_hasher(self)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
