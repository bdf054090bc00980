"""What ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One completion of a prompt. ``logprobs`` holds, per generated token, a dict of
    ``{token_id: logprob}`` for the sampled token and the top-N tokens, when asked."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic-clock times of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The outputs of one prompt. ``metrics`` times the request as a whole (from its first
    completion scheduled to its last finished); ``completion_metrics`` times each of its
    ``n`` completions, by index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    completion_metrics: list[RequestMetrics] | None = None
