"""Turns engine-core outputs into ``RequestOutput``s: detokenizes, matches stop strings, turns
logprobs into ``Logprob`` objects, fans ``n > 1`` completions back into their parent request
and keeps the per-request metrics."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.logprobs import LogprobsLists, PromptLogprobs, SampleLogprobs, make_logprob_dicts
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput


class RequestOutputKind(Enum):
    """What the ``RequestOutput``s of a request carry (vLLM's names).

    CUMULATIVE: at every step, all text and tokens so far. DELTA: at every step, fresh
    ``CompletionOutput``s of only the completions that changed, holding only what is new.
    FINAL_ONLY: one output, when the request finishes. While a completion runs, its text
    holds back a tail that could still become a stop string.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    completion_metrics: list[RequestMetrics]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0
    wants_prompt_logprobs: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_unfinished: int = field(init=False)
    deltas: list[CompletionOutput] = field(default_factory=list)
    new_prompt_logprobs: PromptLogprobs | None = None
    """Prompt logprobs not yet reported in ``DELTA`` outputs."""
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.completions)

    def add_delta(
        self, index: int, text: str, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> None:
        completion = self.completions[index]
        self.deltas.append(
            CompletionOutput(
                index,
                text,
                list(token_ids),
                completion.finish_reason,
                completion.stop_reason,
                None if completion.logprobs is None else list(logprobs or []),
                completion.cumulative_logprob,
            )
        )

    def set_prompt_logprobs(self, prompt_logprobs: PromptLogprobs) -> None:
        """Keep the first child's prompt logprobs (every child computes the same)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs
            self.new_prompt_logprobs = prompt_logprobs

    def to_output(self) -> RequestOutput | None:
        """The output for this step in the request's ``output_kind``; None when there is none."""
        finished = self.num_unfinished == 0
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outputs = self.completions
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            outputs, self.deltas = self.deltas, []
            prompt_logprobs, self.new_prompt_logprobs = self.new_prompt_logprobs, None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            self.num_cached_tokens,
            self.metrics,
            self.completion_metrics,
            prompt_logprobs,
            self.kv_transfer_params if finished else None,
        )


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped_by_string: list[tuple[str, str]]
    """(child request id, stop string) pairs the engine core must finish."""
    inter_token_latencies: list[float]
    """Per completion that got tokens in this step after earlier ones: seconds since its
    previous tokens (vLLM's inter-token latency, one per step whatever the token count)."""


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, int]] = {}
        self.num_requests_finished = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._token_texts: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str | None:
        """The text of one token decoded on its own (``Logprob.decoded_token``); None
        without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def _logprob_dicts(self, lists: LogprobsLists) -> SampleLogprobs:
        return make_logprob_dicts(lists, self.decode_token)

    def add_request(
        self, request: ProcessedRequest, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> None:
        prompt_token_ids, params = request.prompt_token_ids, request.params
        child_ids = [c.request_id for c in request.core_requests]
        arrival_time = request.arrival_time
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            if self.tokenizer is not None
            else None
            for _ in child_ids
        ]
        wants_logprobs = params.logprobs is not None
        completions = [
            CompletionOutput(
                i,
                "",
                [],
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs else None,
            )
            for i in range(len(child_ids))
        ]
        state = RequestState(
            request.request_id,
            request.prompt,
            prompt_token_ids,
            child_ids,
            completions,
            detokenizers,
            RequestMetrics(arrival_time),
            [RequestMetrics(arrival_time) for _ in child_ids],
            output_kind,
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )
        self.requests[request.request_id] = state
        for i, child_id in enumerate(child_ids):
            self.child_to_parent[child_id] = (state, i)
        self.num_prompt_tokens += len(prompt_token_ids) * len(child_ids)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, str]] = []
        inter_token_latencies: list[float] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.req_id)
            if entry is None:
                continue
            state, index = entry
            completion = state.completions[index]
            for metrics in (state.metrics, state.completion_metrics[index]):
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
            if out.new_token_ids:
                previous = state.completion_metrics[index].last_token_time
                if previous is not None:
                    inter_token_latencies.append(now - previous)
                for metrics in (state.metrics, state.completion_metrics[index]):
                    metrics.last_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            new_token_ids, new_logprob_lists = out.new_token_ids, out.new_logprobs
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            detok = state.detokenizers[index]
            if detok is not None:
                match = detok.update(new_token_ids, finish_reason == "stop")
                if match is not None:
                    new_token_ids = new_token_ids[: match.num_tokens]
                    if new_logprob_lists is not None:
                        new_logprob_lists = new_logprob_lists.slice(0, match.num_tokens)
                    if finish_reason is None:
                        stopped.append((out.req_id, match.stop_str))
                    finish_reason, stop_reason = "stop", match.stop_str
                completion.text = detok.get_next_output_text(finish_reason is not None, delta=False)
            completion.token_ids.extend(new_token_ids)
            self.num_generated_tokens += len(new_token_ids)
            new_logprobs = None
            if completion.logprobs is not None and new_logprob_lists:
                new_logprobs = self._logprob_dicts(new_logprob_lists)
                completion.logprobs.extend(new_logprobs)
                assert completion.cumulative_logprob is not None  # set with the logprobs
                for row in new_logprob_lists.logprobs:
                    completion.cumulative_logprob += row[0]
            if state.wants_prompt_logprobs and out.new_prompt_logprobs is not None:
                state.set_prompt_logprobs([None, *self._logprob_dicts(out.new_prompt_logprobs)])
            if finish_reason is not None:
                self._finish_child(state, out.req_id, completion, finish_reason, stop_reason, now)
            if state.output_kind is RequestOutputKind.DELTA:
                finished = finish_reason is not None
                text = "" if detok is None else detok.get_next_output_text(finished, delta=True)
                state.add_delta(index, text, new_token_ids, new_logprobs)
            touched[state.request_id] = state
        return ProcessedOutputs(_outputs(touched.values()), stopped, inter_token_latencies)

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        """Note ``now`` as the first-scheduled time of these children and of their requests,
        where unset."""
        for child_id in child_ids:
            entry = self.child_to_parent.get(child_id)
            if entry is None:
                continue
            state, index = entry
            for metrics in (state.metrics, state.completion_metrics[index]):
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now

    def abort(self, child_ids: list[str]) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for child_id in child_ids:
            entry = self.child_to_parent.get(child_id)
            if entry is None:
                continue
            state, index = entry
            self._finish_child(state, child_id, state.completions[index], "abort", None, now)
            if state.output_kind is RequestOutputKind.DELTA:
                state.add_delta(index, "", [], [])
            touched[state.request_id] = state
        return _outputs(touched.values())

    def unfinished_children(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        return [c for c in state.child_ids if c in self.child_to_parent]

    def _finish_child(
        self,
        state: RequestState,
        child_id: str,
        completion: CompletionOutput,
        finish_reason: str,
        stop_reason: int | str | None,
        now: float,
    ) -> None:
        completion.finish_reason = finish_reason
        completion.stop_reason = stop_reason
        state.completion_metrics[completion.index].finished_time = now
        del self.child_to_parent[child_id]
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            state.metrics.finished_time = now
            del self.requests[state.request_id]
            self.num_requests_finished += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


def _outputs(states: Iterable[RequestState]) -> list[RequestOutput]:
    return [o for o in (s.to_output() for s in states) if o is not None]
