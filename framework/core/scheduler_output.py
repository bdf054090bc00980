"""What the scheduler sends to the workers each step: only what changed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything needed to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    """Requests the workers already hold, in parallel lists. A request resumed from preemption
    gets its whole block list in ``new_block_ids``; others get only blocks added this step."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """The token ids each runs this step (its ``num_scheduled_tokens`` from
    ``num_computed_tokens`` on), with ``SchedulerConfig.send_token_ids``; else empty."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens scheduled for verification, per request; they are the last of the
    request's ``num_scheduled_tokens``."""
    draft_lengths: dict[str, int] = field(default_factory=dict)
    """The most drafts each request may get after this step (``DraftLengthPolicy``); a
    request left out gets none."""
    structured_output_request_ids: list[str] = field(default_factory=list)
    """Requests that sample this step under a structured-output constraint."""
    grammar_bitmask: np.ndarray | None = None
    """int32 ``[len(structured_output_request_ids), ceil(V / 32)]``: the tokens each may sample."""
    kv_connector_metadata: Any = None
    """The KV connector's ``KVConnectorMetadata`` of this step (None without a connector)."""
