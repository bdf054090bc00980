"""The engine core: KV-cache sizing, then ``step()`` = schedule, execute, update.

Under pipeline parallelism the core keeps up to ``executor.max_concurrent_batches`` steps in
flight (vLLM V1's batch queue): it schedules and sends steps while the queue has room and
there is work, and otherwise waits for the oldest step and updates from it, so every stage
works on some step at once. The scheduler never puts a request into two steps in flight."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.block_pool import KVCacheEvent
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.engine.input_processor import EngineCoreRequest
from tokenmill.interfaces.kv_connector import KVConnectorRole
from tokenmill.kv_connector_factory import create_kv_connector
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.structured_output.request import StructuredOutputRequest
from tokenmill.worker.executor import Executor
from tokenmill.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05
"""How long a step with nothing else to run waits for a grammar to compile."""

KV_TRANSFER_POLL_S = 0.005
"""How long a step that ran no token waits before the next asks the KV connector again."""


def _has_work(out: SchedulerOutput) -> bool:
    """Whether a step has anything for the workers: tokens to run or requests to drop."""
    return bool(out.total_num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids)


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB, or in MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class EngineCoreOutputs:
    """What the engine core reports after one step: the step's outputs, the requests it
    scheduled (at ``timestamp``, monotonic) and, from a busy loop, its stats and errors."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduled_req_ids: list[str] = field(default_factory=list)
    timestamp: float = 0.0
    stats: dict[str, int] | None = None
    error: str | None = None
    """Set when a step raised: the core then failed the step's requests, the ids in
    ``failed_req_ids``."""
    failed_req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    """Tokens the step ran (prompt and generated; 0: no step ran)."""
    kv_events: list[KVCacheEvent] = field(default_factory=list)
    """The prefix-cache index's changes in the step."""


class EngineCore:
    """Owns the scheduler, the KV-cache manager and the executor; everything outside reaches
    them through these methods."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor.get_class(config)(config)
        try:
            self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.block_hasher = make_block_hasher(config.block_size, config.prefix_caching_hash_algo)
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.max_model_len,
            config.enable_prefix_caching,
            config.watermark,
        )
        spec = config.speculative
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                policy=config.scheduling_policy,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                num_lookahead_tokens=self.executor.worker_info.num_lookahead_tokens,
                disable_by_batch_size=spec.disable_by_batch_size if spec else 0,
                adaptive_draft_length=spec.adaptive_draft_length if spec else False,
                draft_cost=self.executor.worker_info.draft_cost,
                max_loras=config.max_loras if config.enable_lora else 0,
                send_token_ids=config.pipeline_parallel_size > 1,
            ),
            self.kv_cache_manager,
            create_kv_connector(
                config, KVConnectorRole.SCHEDULER, 0, self.executor.get_kv_cache_specs()
            ),
        )
        self.structured_output_manager = StructuredOutputManager(config)
        self.waiting_for_fsm: dict[str, Request] = {}
        """Requests whose structured-output constraint is still compiling."""
        self.failed_req_ids: list[str] | None = []
        """The requests the latest step that raised finished with an error; None when it
        raised before it had scheduled, so which requests it concerned is unknown."""
        self.num_requests_received = 0
        self.num_executed_steps = 0
        """Steps sent to the executor one at a time, dummy ones included (a step with nothing
        to schedule sends none)."""
        self.num_dummy_steps = 0
        self.batch_queue: deque[tuple[concurrent.futures.Future[ModelRunnerOutput], SchedulerOutput, float]] | None = None
        """Steps sent and not yet updated from (future, output, start), oldest first; None
        when the executor runs one step at a time."""
        if self.executor.max_concurrent_batches > 1:
            self.batch_queue = deque()

    def _init_kv_cache(self) -> None:
        """Size the KV cache by the smallest rank's budget (lowering ``max_model_len`` when
        it holds less) and allocate it on every rank."""
        config = self.config
        specs = self.executor.get_kv_cache_specs()
        num_blocks = self.executor.determine_num_blocks()
        capacity = num_blocks * config.block_size
        assert config.max_model_len is not None
        if capacity < config.max_model_len:
            logger.warning(
                "KV cache holds %d tokens; lowering max_model_len from %d", capacity, config.max_model_len
            )
            config.max_model_len = capacity
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        kv_bytes = num_blocks * sum(spec.page_size_bytes for spec in specs.values())
        info = self.executor.worker_info
        logger.info(
            "model %s from %s, dtype %s, max_model_len %d; platform %s; %s; %s executor, "
            "%d rank(s); KV cache %d blocks of %d tokens (%s per rank)",
            info.model_cls,
            config.model_path,
            str(config.torch_dtype).removeprefix("torch."),
            config.max_model_len,
            config.platform_cls.name,
            info.attention,
            config.executor_backend,
            config.world_size,
            num_blocks,
            config.block_size,
            format_bytes(kv_bytes),
        )

    def max_prompt_tokens(self) -> int:
        """Longest prompt the cache can admit with room for one output token."""
        kv = self.kv_cache_manager
        admissible = (kv.num_blocks - kv.watermark_blocks) * self.config.block_size - 1
        assert self.config.max_model_len is not None
        return min(self.config.max_model_len - 1, admissible)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one with a structured-output constraint waits until it compiled."""
        self.num_requests_received += 1
        req = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.max_tokens,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            block_hasher=self.block_hasher,
            kv_transfer_params=request.kv_transfer_params,
        )
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req)
            return
        self.structured_output_manager.grammar_init(req)
        self.waiting_for_fsm[req.request_id] = req

    def abort_requests(self, req_ids: list[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_requests(self) -> list[str]:
        """Abort every request the core holds; their ids."""
        req_ids = [*self.scheduler.requests, *self.waiting_for_fsm]
        self.abort_requests(req_ids)
        return req_ids

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish unfinished requests from outside a step (aborts, matched stop strings) and
        free their blocks; unknown or finished ids are ignored."""
        for req_id in req_ids:
            req = self.waiting_for_fsm.pop(req_id, None)
            if req is not None:
                _constraint(req).future.cancel()
        self.scheduler.finish_requests(req_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or blocks of finished ones the KV connector still sends."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.waiting_for_fsm)
            or self.scheduler.has_held_blocks()
            or bool(self.batch_queue)
        )

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update. If anything after scheduling raises, the step's
        requests are failed (see ``Scheduler.fail_step``; their ids in ``failed_req_ids``)
        before the exception propagates; the caller reports them. The other requests the core
        holds are untouched. If scheduling itself raised, ``failed_req_ids`` is None."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        self.failed_req_ids = None
        failed = self._admit_compiled()
        if not (self.scheduler.has_unfinished_requests() or self.scheduler.has_held_blocks()):
            return EngineCoreOutputs(failed, timestamp=time.monotonic())
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        try:
            self._add_grammar_bitmask(scheduler_output)
            self.num_executed_steps += 1
            model_output = self.executor.execute_model(scheduler_output)
            outputs = self.scheduler.update_from_output(
                scheduler_output,
                model_output.sampled_token_ids,
                model_output.logprobs,
                model_output.prompt_logprobs,
                model_output.spec_token_ids,
                model_output.kv_connector_output,
            )
            self._advance_grammars(outputs)
            self._validate_drafts(model_output.spec_token_ids)
            self.scheduler.observe_step_time(
                scheduler_output, model_output.spec_token_ids, time.monotonic() - start
            )
        except Exception:
            self.failed_req_ids = [o.req_id for o in failed] + self.scheduler.fail_step(
                scheduler_output
            )
            raise
        if scheduler_output.total_num_scheduled_tokens == 0 and self.scheduler.connector is not None:
            time.sleep(KV_TRANSFER_POLL_S)
        return EngineCoreOutputs(
            failed + outputs,
            list(scheduler_output.num_scheduled_tokens),
            start,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            kv_events=self.kv_cache_manager.pool.take_events(),
        )

    def execute_dummy_batch(self) -> None:
        """A step without requests that meets the other data-parallel engine cores' MoE
        collectives (experts spanning the cores), so their step can run."""
        self.num_executed_steps += 1
        self.num_dummy_steps += 1
        self.executor.execute_dummy_batch()

    def _step_with_batch_queue(
        self, queue: deque[tuple[concurrent.futures.Future[ModelRunnerOutput], SchedulerOutput, float]]
    ) -> EngineCoreOutputs:
        """vLLM's ``step_with_batch_queue``: schedule a step and send it without waiting while
        the queue has room; when it is full, or nothing more can be scheduled, wait for the
        oldest step and update from it. A step that raises fails its requests and those of
        every step still in flight (the ranks no longer agree)."""
        self.failed_req_ids = None
        failed = self._admit_compiled()
        scheduled: SchedulerOutput | None = None
        start = time.monotonic()
        if len(queue) < self.executor.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if _has_work(scheduler_output):
                try:
                    self._add_grammar_bitmask(scheduler_output)
                    future = self.executor.execute_model(scheduler_output, non_block=True)
                except Exception:
                    self.failed_req_ids = [o.req_id for o in failed] + self._fail_queue(queue, scheduler_output)
                    raise
                queue.append((future, scheduler_output, start))
                scheduled = scheduler_output
        result = EngineCoreOutputs(failed, timestamp=start)
        if scheduled is not None:
            result.scheduled_req_ids = list(scheduled.num_scheduled_tokens)
            result.num_scheduled_tokens = scheduled.total_num_scheduled_tokens
            if len(queue) < self.executor.max_concurrent_batches:
                return result
        if not queue:
            result.kv_events = self.kv_cache_manager.pool.take_events()
            return result
        future, scheduler_output, _ = queue.popleft()
        try:
            model_output = future.result()
            outputs = self.scheduler.update_from_output(
                scheduler_output,
                model_output.sampled_token_ids,
                model_output.logprobs,
                model_output.prompt_logprobs,
                model_output.spec_token_ids,
                model_output.kv_connector_output,
            )
            self._advance_grammars(outputs)
            self._validate_drafts(model_output.spec_token_ids)
        except Exception:
            self.failed_req_ids = [o.req_id for o in failed] + self._fail_queue(queue, scheduler_output)
            raise
        result.outputs += outputs
        result.kv_events = self.kv_cache_manager.pool.take_events()
        return result

    def _fail_queue(
        self,
        queue: deque[tuple[concurrent.futures.Future[ModelRunnerOutput], SchedulerOutput, float]],
        scheduler_output: SchedulerOutput,
    ) -> list[str]:
        """Fail ``scheduler_output``'s step and every step still queued; their request ids."""
        failed = self.scheduler.fail_step(scheduler_output)
        while queue:
            failed += self.scheduler.fail_step(queue.popleft()[1])
        return failed

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose constraint compiled to the scheduler (waiting a moment when
        nothing else could run); finish those whose compilation failed or has been running
        longer than ``TOKENMILL_GRAMMAR_COMPILE_TIMEOUT``."""
        if not self.waiting_for_fsm:
            return []
        if not self.scheduler.has_unfinished_requests():
            concurrent.futures.wait(
                [_constraint(r).future for r in self.waiting_for_fsm.values()],
                timeout=GRAMMAR_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        failed = []
        timeout = envs.TOKENMILL_GRAMMAR_COMPILE_TIMEOUT
        now = time.monotonic()
        for req_id, req in list(self.waiting_for_fsm.items()):
            so_request = _constraint(req)
            if so_request.compiling_longer_than(timeout, now):
                del self.waiting_for_fsm[req_id]
                logger.error(
                    "request %s: structured output did not compile within %gs", req_id, timeout
                )
                failed.append(EngineCoreOutput(req_id, [], finish_reason="error"))
                continue
            if not so_request.is_ready:
                continue
            del self.waiting_for_fsm[req_id]
            error = so_request.future.exception()
            if error is None:
                self.scheduler.add_request(req)
                continue
            logger.error("request %s: structured output did not compile: %s", req_id, error)
            failed.append(EngineCoreOutput(req_id, [], finish_reason="error"))
        return failed

    def _add_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        requests = self.scheduler.requests
        sampling = (
            requests[req_id]
            for req_id in scheduler_output.num_scheduled_tokens
            if requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
        )
        result = self.structured_output_manager.grammar_bitmask(
            sampling, scheduler_output.scheduled_spec_decode_tokens
        )
        if result is not None:
            scheduler_output.structured_output_request_ids, scheduler_output.grammar_bitmask = result

    def _advance_grammars(self, outputs: list[EngineCoreOutput]) -> None:
        """Advance the matchers over the sampled tokens; finish requests whose constraint
        terminated (with its stop token, even under ``ignore_eos``)."""
        for output in outputs:
            req = self.scheduler.requests.get(output.req_id)
            if req is None or req.structured_output_request is None:
                continue
            if self.structured_output_manager.accept_tokens(req, output.new_token_ids):
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                output.finish_reason = req.get_finished_reason()

    def _validate_drafts(self, spec_token_ids: dict[str, list[int]]) -> None:
        """Cut a constrained request's new drafts at the first token its grammar rejects."""
        for req_id in spec_token_ids:
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.structured_output_request is not None and req.spec_token_ids:
                req.spec_token_ids = self.structured_output_manager.validate_drafts(req, req.spec_token_ids)

    def shutdown(self) -> None:
        """Stop the executor's workers; the core is unusable afterwards."""
        self.executor.shutdown()

    def get_stats(self) -> dict[str, int]:
        """Scheduler and KV-cache counters, the dummy steps of a core whose experts span the
        data-parallel cores, and speculative decoding's, LoRA's and the KV
        connector's when they are on (the connector's hits are counted apart from the local
        prefix cache's)."""
        kv = self.kv_cache_manager
        spec = {}
        if self.config.speculative:
            spec = {**self.scheduler.spec_stats.as_dict(), **self.scheduler.draft_policy.as_dict()}
        lora = {}
        external = {}
        if self.scheduler.connector is not None:
            stats = self.scheduler.external_stats
            external = {
                "external_prefix_cache_query_tokens": stats.queries,
                "external_prefix_cache_hit_tokens": stats.hits,
                "num_requests_waiting_for_remote_kvs": len(self.scheduler.loading),
                "kv_blocks_held_for_transfer": sum(
                    len(kv.get_block_ids(r)) for r in self.scheduler.held
                ),
                **self.scheduler.connector.get_stats(),
            }
        if self.config.enable_lora:
            running, waiting = self.scheduler.lora_adapters()
            lora = {"num_running_loras": len(running), "num_waiting_loras": len(waiting)}
        dummy = {}
        if self.config.expert_parallel_across_data_parallel:
            dummy = {"num_dummy_steps": self.num_dummy_steps}
        return {
            **spec,
            **lora,
            **dummy,
            **external,
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting) + len(self.waiting_for_fsm),
            "num_requests_received": self.num_requests_received,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": kv.stats.queries,
            "prefix_cache_hit_tokens": kv.stats.hits,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.get_num_free_blocks(),
        }


def _constraint(req: Request) -> StructuredOutputRequest:
    """The structured-output constraint of a request in ``waiting_for_fsm``, which holds only
    constrained requests."""
    assert req.structured_output_request is not None
    return req.structured_output_request
