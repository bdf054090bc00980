"""What ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One completion of a prompt. When ``SamplingParams.logprobs`` asks for them,
    ``logprobs`` holds, per generated token, ``{token_id: Logprob}`` for the sampled token
    (with its rank) and the top-N tokens, and ``cumulative_logprob`` the sum of the sampled
    tokens' logprobs; otherwise both are None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic-clock times of one request's life; ``last_token_time``: when its latest
    generated tokens arrived."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The outputs of one prompt. ``metrics`` times the request as a whole (from its first
    completion scheduled to its last finished); ``completion_metrics`` times each of its
    ``n`` completions, by index. ``prompt_logprobs``, when ``SamplingParams.prompt_logprobs``
    asks for them: per prompt position ``{token_id: Logprob}`` for the prompt token and the
    top-N, None at the first position (in ``DELTA`` outputs, only in the output that
    brings them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    completion_metrics: list[RequestMetrics] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """With the finished output: what the KV connector returned for the client (vLLM's
    ``kv_transfer_params``, e.g. where a decode instance can pull the prompt's KV)."""
