"""The asynchronous engine: a background thread steps an ``LLMEngine`` without pause while any
number of asyncio callers add, stream and abort requests (vLLM's ``AsyncLLM``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    PromptType,
    load_tokenizer,
)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import RequestOutputKind
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_REQUESTS = 1024


class QueueFullError(RuntimeError):
    """The engine already holds ``max_pending_requests`` unfinished requests."""


class EngineDeadError(RuntimeError):
    """The engine was shut down."""


@dataclass
class RequestStats:
    """Sizes and timings (seconds) of one finished request, as handed to stat loggers.

    As in vLLM, where ``n > 1`` fans out into ``n`` engine requests, each completion of a
    request is a request of its own here: an ``n = 2`` request is recorded twice, each time
    with its completion's finish reason, tokens and times, and the prompt counted once each.
    """

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    time_to_first_token: float | None
    time_per_output_token: float | None


class StatLogger(Protocol):
    def record_finished(self, stats: RequestStats) -> None: ...


class RequestStream:
    """The outputs of one request as an async iterator; it ends after the finished output and
    raises the request's error if the engine rejected or failed it."""

    def __init__(
        self, request_id: str, num_prompt_tokens: int, output_kind: RequestOutputKind
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.output_kind = output_kind
        self.finished = False
        self.num_generation_tokens: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            for c in item.outputs:
                previous = self.num_generation_tokens.get(c.index, 0)
                delta = self.output_kind is RequestOutputKind.DELTA
                self.num_generation_tokens[c.index] = len(c.token_ids) + (previous if delta else 0)
                if c.finish_reason is not None:
                    self.finish_reasons[c.index] = c.finish_reason
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request: ProcessedRequest
    output_kind: RequestOutputKind
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


_SHUTDOWN = object()


class AsyncLLM:
    """Serves concurrent requests from one event loop.

    A daemon thread owns the ``LLMEngine`` (which is not thread-safe): between steps it applies
    the adds and aborts queued by callers, then steps while anything is unfinished, so new
    requests join the running batch. Outputs go back to the event loop, one hand-off per step.
    Prompts are tokenized and validated in the caller with a tokenizer of its own, so a bad
    request raises ``ValueError`` to its caller alone. An engine step that raises fails the
    requests in flight (their streams raise) and aborts them; the loop keeps serving.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.stat_loggers = list(stat_loggers or [])
        config = engine.config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model_path)
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            engine.input_processor.max_model_len,
            engine.input_processor.max_prompt_tokens,
        )
        self._commands: queue.SimpleQueue[_Add | _Abort | object] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stats = engine.get_stats()
        self._dead = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS, **kwargs: Any
    ) -> AsyncLLM:
        """Build the engine from ``LLM``'s keyword arguments."""
        return cls(LLMEngine.from_engine_args(**kwargs), max_pending_requests)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, checked against the vocabulary and the context;
        raises ``ValueError``. Uses this object's tokenizer, never the engine thread's."""
        return self.input_processor.tokenize_prompt(prompt)

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> RequestStream:
        """Validate and queue a request; return the stream of its outputs.

        Raises ``ValueError`` for an invalid prompt, parameters or a request id in use,
        ``QueueFullError`` when ``max_pending_requests`` are unfinished, and
        ``EngineDeadError`` after ``shutdown``. ``output_kind`` is DELTA (for streaming) or
        FINAL_ONLY; cumulative outputs would be shared with the engine thread.
        """
        if self._dead:
            raise EngineDeadError("the engine was shut down")
        if output_kind is RequestOutputKind.CUMULATIVE:
            raise ValueError("AsyncLLM streams DELTA or FINAL_ONLY outputs")
        if len(self._streams) >= self.max_pending_requests:
            raise QueueFullError(
                f"the server is at capacity ({self.max_pending_requests} unfinished requests)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(request_id, prompt, params)
        stream = RequestStream(request_id, len(request.prompt_token_ids), output_kind)
        self._streams[request_id] = stream
        self._commands.put(_Add(request, output_kind, asyncio.get_running_loop()))
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs; a caller that stops early (breaks, is
        cancelled, or closes the generator) aborts the request, which frees its KV blocks."""
        stream = await self.add_request(prompt, params, request_id, output_kind)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a ``finish_reason="abort"`` output."""
        self._commands.put(_Abort(request_id))

    def get_stats(self) -> dict[str, int]:
        """The engine's ``get_stats()`` as of the end of its latest step."""
        return dict(self._stats)

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests are aborted."""
        self._dead = True
        self._commands.put(_SHUTDOWN)
        self._thread.join(timeout)

    def _run(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        active: set[str] = set()
        while True:
            commands = [self._commands.get()] if not active else []
            commands += _drain(self._commands)
            outputs: list[RequestOutput] = []
            failures: list[tuple[str, BaseException]] = []
            for command in commands:
                if command is _SHUTDOWN:
                    self.engine.abort_request(list(active))
                    if active:
                        dead = EngineDeadError("the engine was shut down")
                        _hand_over(loop, self._dispatch, [], [(r, dead) for r in active])
                    return
                if isinstance(command, _Add):
                    loop = command.loop
                    request_id = command.request.request_id
                    try:
                        self.engine.add_processed_request(command.request, command.output_kind)
                        active.add(request_id)
                    except Exception as e:
                        failures.append((request_id, e))
                elif isinstance(command, _Abort) and command.request_id in active:
                    outputs += self.engine.abort_request(command.request_id)
            if active:
                try:
                    outputs += self.engine.step()
                except Exception as e:
                    logger.exception("engine step failed; failing its %d requests", len(active))
                    failures += [(r, RuntimeError(f"engine step failed: {e!r}")) for r in active]
                    outputs += self.engine.abort_request(list(active))
            active.difference_update(o.request_id for o in outputs if o.finished)
            active.difference_update(r for r, _ in failures)
            self._stats = self.engine.get_stats()
            if outputs or failures:
                _hand_over(loop, self._dispatch, outputs, failures)

    def _dispatch(
        self, outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]
    ) -> None:
        for request_id, error in failures:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
                self._record(stream, output)

    def _record(self, stream: RequestStream, output: RequestOutput) -> None:
        if not self.stat_loggers:
            return
        for stats in request_stats(output, stream):
            for stat_logger in self.stat_loggers:
                stat_logger.record_finished(stats)


def request_stats(output: RequestOutput, stream: RequestStream) -> list[RequestStats]:
    """One ``RequestStats`` per completion of a finished request, from its monotonic
    timestamps; TPOT as in vLLM: decode time over the tokens after the first."""
    assert output.completion_metrics is not None
    stats = []
    for index, m in enumerate(output.completion_metrics):
        assert m.finished_time is not None
        num_tokens = stream.num_generation_tokens.get(index, 0)
        ttft = tpot = queue_time = None
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            if num_tokens > 1:
                tpot = (m.finished_time - m.first_token_time) / (num_tokens - 1)
        if m.first_scheduled_time is not None:
            queue_time = m.first_scheduled_time - m.arrival_time
        stats.append(
            RequestStats(
                finish_reason=stream.finish_reasons[index],
                num_prompt_tokens=stream.num_prompt_tokens,
                num_generation_tokens=num_tokens,
                e2e_latency=m.finished_time - m.arrival_time,
                queue_time=queue_time,
                time_to_first_token=ttft,
                time_per_output_token=tpot,
            )
        )
    return stats


def _hand_over(loop: asyncio.AbstractEventLoop | None, callback, *args: Any) -> None:
    """Run ``callback(*args)`` on the event loop, unless it is gone."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        logger.warning("event loop closed; dropping outputs of %s", callback.__name__)


def _drain(commands: queue.SimpleQueue) -> list[Any]:
    out = []
    while True:
        try:
            out.append(commands.get_nowait())
        except queue.Empty:
            return out
