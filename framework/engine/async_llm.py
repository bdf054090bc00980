"""The asynchronous engine (vLLM's ``AsyncLLM``): any number of asyncio callers add, stream and
abort requests while the engine core steps without pause in its own process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_client import EngineDeadError, MPClient
from tokenmill.engine.dp_client import DPClient
from tokenmill.engine.engine_core import EngineCoreOutputs
from tokenmill.engine.kv_events import KVEventLog
from tokenmill.engine.input_processor import InputProcessor, PromptType
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputKind
from tokenmill.lora.request import LoRARequest
from tokenmill.model_loader.tokenizer import load_tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_REQUESTS = 1024

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The engine already holds ``max_pending_requests`` unfinished requests."""


class EngineStepError(RuntimeError):
    """An engine step running the request raised; the engine serves on."""


class EngineStalledError(RuntimeError):
    """The engine core holds work but has not reported a step for too long."""


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
    prefill_time: float | None = None
    """First scheduled to first token."""
    decode_time: float | None = None
    """First token to last token."""
    inference_time: float | None = None
    """First scheduled to last token (prefill and decode)."""
    n: int = 1
    """The request's ``n``."""
    max_tokens: int = 0
    """The request's ``max_tokens`` (its default filled in: what fits the context)."""


class StatLogger(Protocol):
    def record_finished(self, stats: RequestStats) -> None: ...

    def record_iteration(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        """One engine step ran ``num_tokens`` tokens (prompt and generated); each completion
        that got tokens after earlier ones waited ``inter_token_latencies`` seconds for them."""


class RequestStream:
    """The outputs of one request as an async iterator; it ends after the finished output and
    raises the request's error if the engine rejected or failed it."""

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        output_kind: RequestOutputKind,
        n: int = 1,
        max_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.output_kind = output_kind
        self.n = n
        self.max_tokens = max_tokens
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


class AsyncLLM:
    """Serves concurrent requests from one event loop.

    The engine core runs ``EngineCoreProc``'s busy loop in a child process (``MPClient``;
    with ``engine_process=False``, in a thread of this process; with
    ``data_parallel_size > 1``, one process per core behind a ``DPClient``): between steps it
    takes the requests and aborts sent to it, then steps while anything is unfinished, so new
    requests join the running batch. This process keeps the front end, on the event loop:
    prompts are validated and tokenized once (``InputProcessor``, in a worker thread: see
    ``run_off_loop``), so a bad request raises ``ValueError`` to its caller alone, and each
    step's outputs are detokenized, matched
    against stop strings and streamed (``OutputProcessor``) while the core computes the next
    step. An engine step that raises fails the requests it ran (their streams raise
    ``EngineStepError``); the core keeps serving the others, unless its executor died (a
    tensor-parallel worker was lost): then the core exits. If the core dies, every stream and
    every later request raises ``EngineDeadError``; if it stops making progress while it has
    work (hung or stopped), ``health`` says so.
    """

    def __init__(
        self,
        config: EngineConfig,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        stat_loggers: list[StatLogger] | None = None,
        engine_process: bool = True,
    ) -> None:
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.config = resolve_config(config)
        self.max_pending_requests = max_pending_requests
        self.stat_loggers = list(stat_loggers or [])
        self.tokenizer = load_tokenizer(config.tokenizer or config.model_path)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenmill-tokenizer"
        )
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self.engine_core: MPClient | DPClient
        if config.data_parallel_size > 1:
            if not engine_process:
                raise ValueError(
                    f"data_parallel_size={config.data_parallel_size} runs each engine core in "
                    f"its own process; it cannot run with engine_process=False"
                )
            self.engine_core = DPClient(config, self._on_core_output)
        else:
            self.engine_core = MPClient(config, self._on_core_output, in_thread=not engine_process)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.engine_core.max_model_len, self.engine_core.max_prompt_tokens
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.kv_event_log = KVEventLog()

    @classmethod
    def from_engine_args(
        cls,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        engine_process: bool = True,
        **kwargs: Any,
    ) -> AsyncLLM:
        """Build the engine from ``LLM``'s keyword arguments."""
        return cls(
            EngineConfig.from_kwargs(**kwargs), max_pending_requests, engine_process=engine_process
        )

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are below it)."""
        return self.input_processor.vocab_size

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, checked against the vocabulary and the context;
        raises ``ValueError``."""
        return self.input_processor.tokenize_prompt(prompt)

    async def run_off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the front end's worker thread, so the event loop keeps
        serving meanwhile: for tokenization, chat templates and request validation, whose cost
        grows with the client's input (HF tokenizers release the GIL while they work). One
        thread, as vLLM's ``AsyncMicrobatchTokenizer``: a fast tokenizer is not safe to share
        between threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_thread, functools.partial(fn, *args, **kwargs)
        )

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and queue a request; return the stream of its outputs.

        Raises ``ValueError`` for an invalid prompt, parameters (also ones the engine core
        cannot receive) or a request id in use, ``QueueFullError`` when
        ``max_pending_requests`` are unfinished, and ``EngineDeadError`` after ``shutdown`` or
        once the engine core died; a request that raises leaves nothing behind. ``output_kind``
        is DELTA (for streaming) or FINAL_ONLY. ``lora_request`` (with ``enable_lora``) is the
        adapter to generate with; one the engine cannot load raises ``ValueError``. ``priority``
        (lower first) matters with ``scheduling_policy="priority"``.
        """
        if output_kind is RequestOutputKind.CUMULATIVE:
            raise ValueError("AsyncLLM streams DELTA or FINAL_ONLY outputs")
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_admissible(request_id)
        request = await self.run_off_loop(
            self.input_processor.process, request_id, prompt, params, None, priority, lora_request
        )
        self._check_admissible(request_id)
        self._loop = asyncio.get_running_loop()
        self.output_processor.add_request(request, output_kind)
        stream = RequestStream(
            request_id,
            len(request.prompt_token_ids),
            output_kind,
            request.params.n,
            request.core_requests[0].max_tokens,
        )
        self._streams[request_id] = stream
        children = [c.request_id for c in request.core_requests]
        try:
            for child in request.core_requests:
                self.engine_core.add_request(child)
        except BaseException:
            if self._dead is None:
                with contextlib.suppress(EngineDeadError):
                    self.engine_core.abort_requests(children)
            self.output_processor.abort(children)
            del self._streams[request_id]
            raise
        return stream

    def _check_admissible(self, request_id: str) -> None:
        """Raise unless a request ``request_id`` may be added now (checked again once its
        processing, off the loop, is done: others may have been added meanwhile)."""
        if self._dead is not None:
            raise self._dead
        if len(self._streams) >= self.max_pending_requests:
            raise QueueFullError(
                f"the server is at capacity ({self.max_pending_requests} unfinished requests)"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs; a caller that stops early (breaks, is
        cancelled, or closes the generator) aborts the request, which frees its KV blocks."""
        stream = await self.add_request(prompt, params, request_id, output_kind, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a ``finish_reason="abort"`` output. Call it
        on the event loop's thread."""
        children = self.output_processor.unfinished_children(request_id)
        if not children:
            return
        if self._dead is None:
            self.engine_core.abort_requests(children)
        self._dispatch(self.output_processor.abort(children))

    def get_stats(self) -> dict[str, int]:
        """Front-end counters and the engine core's stats as of its latest message (with
        data parallelism, summed over the cores)."""
        out = self.output_processor
        return {
            "num_requests_finished": out.num_requests_finished,
            "num_generated_tokens": out.num_generated_tokens,
            "num_prompt_tokens": out.num_prompt_tokens,
            **self.engine_core.get_stats(),
        }

    def get_engine_stats(self) -> list[dict[str, int]]:
        """Each engine core's stats, by data-parallel rank."""
        return self.engine_core.get_engine_stats()

    def is_running(self) -> bool:
        return self._dead is None and self.engine_core.is_alive()

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine core is gone, ``EngineStalledError`` if it
        has held work without finishing a step for ``TOKENMILL_ENGINE_STALL_TIMEOUT_S``
        seconds (hung, or its process stopped)."""
        if not self.is_running():
            raise self._dead or EngineDeadError("the engine core is not running")
        waited = self.engine_core.seconds_without_progress()
        if waited > envs.TOKENMILL_ENGINE_STALL_TIMEOUT_S:
            raise EngineStalledError(
                f"the engine core has made no progress for {waited:.0f} s while holding requests"
            )

    def shutdown(self) -> None:
        """Stop the engine core; unfinished requests are aborted in the core, and their
        streams raise ``EngineDeadError``."""
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self.engine_core.shutdown()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        _hand_over(self._loop, self._fail_all, self._dead)

    def _on_core_output(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Runs on the client's receiving thread: hand each message to the event loop."""
        if isinstance(item, EngineDeadError):
            self._dead = EngineDeadError(f"{item}; the server must be restarted")
            _hand_over(self._loop, self._fail_all, self._dead)
        else:
            _hand_over(self._loop, self._process_outputs, item)

    def _process_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        out = self.output_processor
        if core_outputs.error is not None:
            logger.error("engine step failed: %s; failing its requests", core_outputs.error)
            error = EngineStepError(f"engine step failed: {core_outputs.error}")
            self._fail_all(error, set(core_outputs.failed_req_ids))
            return
        out.mark_scheduled(core_outputs.scheduled_req_ids, core_outputs.timestamp)
        self.kv_event_log.extend(core_outputs.kv_events)
        processed = out.process(core_outputs.outputs)
        if core_outputs.num_scheduled_tokens or processed.inter_token_latencies:
            for stat_logger in self.stat_loggers:
                stat_logger.record_iteration(
                    core_outputs.num_scheduled_tokens, processed.inter_token_latencies
                )
        for child_id, stop_str in processed.stopped_by_string:
            if self._dead is None:
                self.engine_core.finish_requests([child_id], RequestStatus.FINISHED_STOPPED, stop_str)
        self._dispatch(processed.request_outputs)

    def _fail_all(self, error: BaseException, failed: set[str] | None = None) -> None:
        """Fail the unfinished requests with ``error`` and drop them from the cores: every
        one, or (``failed``: the ids a core aborted) those with a child among them."""
        out = self.output_processor
        doomed = {
            r: out.unfinished_children(r)
            for r in self._streams
            if failed is None or not failed.isdisjoint(out.unfinished_children(r))
        }
        children = [c for r in doomed for c in doomed[r]]
        if children and self._dead is None:
            # A core that died since (its death notice not yet handled) holds nothing.
            with contextlib.suppress(EngineDeadError):
                self.engine_core.abort_requests(children)
        out.abort(children)
        for request_id in doomed:
            self._streams.pop(request_id).put(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
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
    timestamps, the phases as vLLM splits them: queued (arrival to first scheduled), prefill
    (to the first token), decode (first to last token); TPOT: decode time over the tokens
    after the first."""
    assert output.completion_metrics is not None
    stats = []
    for index, m in enumerate(output.completion_metrics):
        assert m.finished_time is not None
        num_tokens = stream.num_generation_tokens.get(index, 0)
        ttft = tpot = queue_time = prefill = decode = inference = None
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = m.last_token_time - m.first_token_time
            if num_tokens > 1:
                tpot = decode / (num_tokens - 1)
        if m.first_scheduled_time is not None:
            queue_time = m.first_scheduled_time - m.arrival_time
            if m.first_token_time is not None:
                prefill = m.first_token_time - m.first_scheduled_time
            if m.last_token_time is not None:
                inference = m.last_token_time - m.first_scheduled_time
        stats.append(
            RequestStats(
                finish_reason=stream.finish_reasons[index],
                num_prompt_tokens=stream.num_prompt_tokens,
                num_generation_tokens=num_tokens,
                e2e_latency=m.finished_time - m.arrival_time,
                queue_time=queue_time,
                time_to_first_token=ttft,
                time_per_output_token=tpot,
                prefill_time=prefill,
                decode_time=decode,
                inference_time=inference,
                n=stream.n,
                max_tokens=stream.max_tokens,
            )
        )
    return stats


def _hand_over(
    loop: asyncio.AbstractEventLoop | None, callback: Callable[..., object], *args: Any
) -> None:
    """Run ``callback(*args)`` on the event loop, unless it is gone."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        logger.debug("event loop closed; dropping a call of %s", callback.__name__)
