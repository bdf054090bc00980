"""The scheduler: one token budget per step, shared by running and waiting requests.

There is no prefill phase or decode phase. Each request has ``num_computed_tokens`` and the
scheduler gives it new tokens toward ``num_tokens``: a chunk of prompt, one decode token, or the
rest of a prompt after a prefix-cache hit. Running requests go first; when the KV cache is full
the most recently arrived running request (or the lowest priority one) is preempted by
recompute. Waiting requests are admitted while budget, sequence slots and blocks (above the
watermark) remain.

With LoRA, the running requests use at most ``max_loras`` distinct adapters. A waiting request
whose adapter would be one too many waits; behind it only requests of the base model are
admitted (not even those of adapters already running), so the running adapters drain and the
waiting one is admitted in its turn: no adapter starves.

With speculative decoding a running request's target is ``num_tokens_with_spec``: its draft
tokens join the step's budget, and its blocks include ``num_lookahead_tokens`` more slots for
the proposer's own cache writes. Drafts the target rejects roll ``num_computed_tokens`` back.
Blocks are indexed in the prefix cache only over verified tokens (``block_hashes`` covers
``all_token_ids``, never drafts).

With a KV connector, a waiting request's tokens past its local prefix-cache hits may come from
the connector (``get_num_new_matched_tokens``): they count as computed, in blocks the connector
fills before the step's forward pass. They need not end on a block boundary (a decode instance
loads the prompt's partial last block too); a partially filled block is never indexed in the
prefix cache, only blocks full of computed or loaded tokens are. A connector that loads asynchronously leaves the request
in ``WAITING_FOR_REMOTE_KVS``, holding its blocks, until a worker reports the load finished;
the other requests are scheduled meanwhile. A finished request's blocks stay held while the
connector sends them (``request_finished`` returns ``delay_free``), until a worker reports them
sent; so do those of a request aborted while its load runs, until the load finished.

With a batch queue (pipeline parallelism) several steps are in flight at once: a request of a
step whose output is not in yet (``in_flight``) is neither scheduled again nor preempted, and
with ``send_token_ids`` the requests the workers hold carry the tokens they run (only the
last stage samples; the others learn the sampled tokens this way).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.core.block_pool import KVCacheBlock
from tokenmill.core.draft_length_policy import DraftLengthPolicy
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import make_queue
from tokenmill.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.core.spec_decode_stats import SpecDecodingStats
from tokenmill.interfaces.kv_connector import KVConnectorBase, KVConnectorOutput, KVLoadError
from tokenmill.logprobs import LogprobsLists


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    disable_by_batch_size: int = 0
    """Steps with at least this many running requests do not speculate; 0: never disabled."""
    adaptive_draft_length: bool = False
    """Each request's draft length follows its acceptance and the drafts' measured cost
    (``DraftLengthPolicy``)."""
    draft_cost: float = 0.0
    """The proposer's estimate of a draft token's cost before any is timed
    (``Proposer.draft_cost``)."""
    max_loras: int = 0
    """Most distinct LoRA adapters among the running requests; 0: LoRA is off."""
    send_token_ids: bool = False
    """Cached requests carry their scheduled token ids (``CachedRequestData.new_token_ids``)."""

    def __post_init__(self) -> None:
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} splits long "
                "prompts into chunks, which needs enable_chunked_prefill=True"
            )


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_prompt_logprobs: LogprobsLists | None = None
    """All the prompt's logprobs, with the request's first token."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector returned for the finished request (vLLM's ``kv_transfer_params``)."""


@dataclass
class ExternalPrefixStats:
    """Tokens of admitted requests looked up in the KV connector, and those it supplied."""

    queries: int = 0
    hits: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector
        """The KV connector's scheduler side, if the engine runs one."""
        self.external_stats = ExternalPrefixStats()
        self.loading: set[str] = set()
        """Requests in ``WAITING_FOR_REMOTE_KVS``."""
        self.finished_recving: set[str] = set()
        """Requests whose asynchronous load finished, not yet scheduled again."""
        self.loaded_in_step: dict[str, int] = {}
        """Requests admitted in the latest step with tokens a connector loads in it -> their
        computed tokens without those (a failed step must not leave the loads indexed)."""
        self.load_failures: list[EngineCoreOutput] = []
        """Requests the connector failed (``KVLoadError``) while scheduling, reported with the
        step's outputs."""
        self.held: dict[str, Request] = {}
        """Finished requests whose blocks stay held until the connector reports them sent
        (or, for one aborted while loading, loaded)."""
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.in_flight: set[str] = set()
        """Requests of the steps executing: not scheduled again before their output is in."""
        self.spec_stats = SpecDecodingStats(config.num_speculative_tokens)
        self.draft_policy = DraftLengthPolicy(
            config.num_speculative_tokens,
            config.adaptive_draft_length,
            config.disable_by_batch_size,
            draft_cost=config.draft_cost,
        )

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_held_blocks(self) -> bool:
        """Whether finished requests' blocks wait for the KV connector (steps must go on for
        the workers to report them)."""
        return bool(self.held)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        self.loaded_in_step = {}
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        lookahead = cfg.num_lookahead_tokens
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if num_new == 0 or req.request_id in self.in_flight:
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is None:
                    break
                if self.running.index(victim) < i:
                    i -= 1
                self.running.remove(victim)
                self._preempt(victim)
                preempted.add(victim.request_id)
                budget += num_scheduled.pop(victim.request_id, 0)
                new_block_ids.pop(victim.request_id, None)
                spec_tokens.pop(victim.request_id, None)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                break
            num_scheduled[req.request_id] = num_new
            new_block_ids[req.request_id] = [b.block_id for b in new_blocks]
            num_spec = req.num_computed_tokens + num_new - req.num_tokens
            if num_spec > 0:
                spec_tokens[req.request_id] = req.spec_token_ids[:num_spec]
            req.spec_token_ids = []
            budget -= num_new
            i += 1

        cached = CachedRequestData()
        for req_id, block_ids in new_block_ids.items():
            req = self.requests[req_id]
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            if cfg.send_token_ids:
                start = req.num_computed_tokens
                cached.new_token_ids.append(req.all_token_ids[start : start + num_scheduled[req_id]])
        new_reqs: list[NewRequestData] = []
        if not preempted:
            self._schedule_waiting(budget, num_scheduled, new_reqs, cached)

        rooms = {}
        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                rooms[req_id] = self._draft_room(req)
        self.in_flight.update(num_scheduled)
        draft_lengths = self.draft_policy.lengths(rooms, len(self.running)) if cfg.num_speculative_tokens else {}
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=preempted,
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
            draft_lengths=draft_lengths,
        )
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        return out

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        num_new = req.num_tokens_with_spec - num_computed
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return max(0, min(num_new, budget, self.config.max_model_len - num_computed))

    def _schedule_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
    ) -> None:
        """Admit waiting requests in queue order while budget, sequence slots and blocks last.

        The watermark keeps a few blocks back for running requests to grow into, so it only
        applies to a fresh request while others run: a preempted request may have grown past
        ``num_blocks - watermark_blocks``, and with nothing running any request that fits the
        empty cache is admitted, so the head of the queue can always make progress."""
        cfg = self.config
        active = {r.lora_int_id for r in self.running} - {0}
        lora_blocked = False
        skipped: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            lora_id = req.lora_int_id
            if lora_id and (lora_blocked or (lora_id not in active and len(active) >= cfg.max_loras)):
                lora_blocked = True
                skipped.append(self.waiting.pop())
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving:
                    skipped.append(self.waiting.pop())
                    continue
                self.finished_recving.discard(req.request_id)
                self.loading.discard(req.request_id)
                req.status = RequestStatus.WAITING
                hits: list[KVCacheBlock] = []
                num_local, num_external, load_async = req.num_computed_tokens, 0, False
                resumed_load = True
            else:
                hits, num_local = self.kv.get_computed_blocks(req)
                try:
                    num_external, load_async = self._external_tokens(req, num_local)
                except KVLoadError as e:
                    self.waiting.pop()
                    req.status = RequestStatus.FINISHED_ERROR
                    req.stop_reason = str(e)
                    self._finish(req)
                    self.load_failures.append(
                        EngineCoreOutput(req.request_id, [], finish_reason="error", stop_reason=str(e))
                    )
                    continue
                resumed_load = False
            num_hit_tokens = num_local + num_external
            num_new = 0 if load_async else self._num_new_tokens(req, num_hit_tokens, budget)
            full = req.num_tokens - num_hit_tokens
            if num_new < full and not cfg.enable_chunked_prefill and not load_async:
                break
            admit = req.status == RequestStatus.WAITING and bool(self.running) and not resumed_load
            new_blocks = self.kv.allocate_slots(
                req,
                num_external if load_async else num_new,
                num_local if load_async else (0 if resumed_load else num_hit_tokens),
                hits,
                num_lookahead_tokens=0 if load_async else cfg.num_lookahead_tokens,
                admit=admit,
                index=not load_async,
            )
            if new_blocks is None:
                if resumed_load:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.loading.add(req.request_id)
                    self.finished_recving.add(req.request_id)
                break
            if not resumed_load:
                self.kv.record_prefix_query(req, num_local)
                if self.connector is not None:
                    self.external_stats.queries += req.num_tokens - num_local
                    self.external_stats.hits += num_external
                    req.num_computed_tokens = num_local
                    self.connector.update_state_after_alloc(
                        req, self.kv.get_block_ids(req.request_id), num_external
                    )
                    if num_external and not load_async:
                        self.loaded_in_step[req.request_id] = num_local
            if load_async:
                req.num_computed_tokens = num_hit_tokens
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading.add(req.request_id)
                skipped.append(self.waiting.pop())
                continue
            self.waiting.pop()
            self.running.append(req)
            if lora_id:
                active.add(lora_id)
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            block_ids = self.kv.get_block_ids(req.request_id)
            if req.status == RequestStatus.PREEMPTED:
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(True)
                cached.new_block_ids.append(block_ids)
                cached.num_computed_tokens.append(num_hit_tokens)
                if cfg.send_token_ids:
                    cached.new_token_ids.append(req.all_token_ids[num_hit_tokens : num_hit_tokens + num_new])
            else:
                new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        req.sampling_params,
                        block_ids,
                        num_hit_tokens,
                        req.eos_token_id,
                        req.lora_request,
                    )
                )
            req.status = RequestStatus.RUNNING
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _external_tokens(self, req: Request, num_local: int) -> tuple[int, bool]:
        """The connector's ``(tokens, load_async)`` past ``num_local`` hit tokens; none for a
        request that wants prompt logprobs (every prompt position must run), nor an
        asynchronous load for a preempted request (its workers keep its state to resume)."""
        if self.connector is None or req.sampling_params.prompt_logprobs is not None:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
        limit = req.num_tokens - 1 - num_local
        if not 0 <= num_external <= limit:
            raise ValueError(
                f"KV connector {type(self.connector).__name__} offered {num_external} tokens "
                f"for request {req.request_id}: expected 0 to {limit}"
            )
        if load_async and req.status == RequestStatus.PREEMPTED:
            return 0, False
        return num_external, load_async and num_external > 0

    def lora_adapters(self) -> tuple[set[str], set[str]]:
        """The names of the adapters of the running requests and of the waiting ones."""
        def names(requests: Iterable[Request]) -> set[str]:
            return {r.lora_request.lora_name for r in requests if r.lora_request is not None}

        return names(self.running), names(self.waiting)

    def _pick_victim(self) -> Request | None:
        """The lowest-priority (highest value, latest) request, or the latest under FCFS, of
        those not in flight; None when all are."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, list[int]],
        logprobs: dict[str, LogprobsLists] | None = None,
        prompt_logprobs: dict[str, LogprobsLists] | None = None,
        spec_token_ids: dict[str, list[int]] | None = None,
        kv_connector_output: KVConnectorOutput | None = None,
    ) -> list[EngineCoreOutput]:
        """Append each request's sampled tokens (accepted drafts, then the target's token),
        roll rejected drafts back, check stop conditions (a stop inside an accepted run ends
        the request there), free what finished, and keep each request's new drafts. Then take
        in what the KV connector's workers finished sending and receiving."""
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        outputs, self.load_failures = self.load_failures, []
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            new_ids = sampled.get(req_id, [])
            verified = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if verified and new_ids:
                req.num_computed_tokens -= len(verified) + 1 - len(new_ids)
                self.spec_stats.observe(len(verified), len(new_ids) - 1)
                self.draft_policy.observe_acceptance(req_id, len(verified), len(new_ids) - 1)
            kept: list[int] = []
            for tok in new_ids:
                kept.append(tok)
                req.append_output_token_ids([tok])
                if self._check_stop(req, tok):
                    break
            if not kept:
                continue
            req_logprobs = logprobs.get(req_id) if logprobs else None
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    kept,
                    req_logprobs.slice(0, len(kept)) if req_logprobs else None,
                    req.get_finished_reason(),
                    req.stop_reason,
                    max(req.num_cached_tokens, 0),
                    prompt_logprobs.get(req_id) if prompt_logprobs else None,
                )
            )
            if req.is_finished():
                outputs[-1].kv_transfer_params = self._finish(req)
            elif spec_token_ids and req_id in spec_token_ids:
                # each draft kept leaves room for the token after it
                req.spec_token_ids = spec_token_ids[req_id][: max(self._tokens_left(req) - 1, 0)]
        if kv_connector_output is not None:
            self._update_from_kv_connector(kv_connector_output)
        return outputs

    def _tokens_left(self, req: Request) -> int:
        """The tokens ``req`` may still emit, by its ``max_tokens`` and the model length."""
        return min(req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens)

    def _draft_room(self, req: Request) -> int:
        """The most drafts a request that samples this step can use after it: the step emits
        at least one token, and ``update_from_output`` keeps only drafts that leave room for the
        token after them."""
        return self._tokens_left(req) - 2

    def observe_step_time(
        self, scheduler_output: SchedulerOutput, spec_token_ids: dict[str, list[int]], seconds: float
    ) -> None:
        """Give the draft-length policy the time of a step that only decoded (each request one
        token and its drafts), with the drafts it verified and proposed."""
        verified = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled or any(n != 1 + len(verified.get(r, ())) for r, n in scheduled.items()):
            return
        self.draft_policy.observe_step(
            len(scheduled),
            sum(map(len, verified.values())),
            sum(map(len, spec_token_ids.values())),
            seconds,
        )

    def _update_from_kv_connector(self, output: KVConnectorOutput) -> None:
        """Loads that finished make their requests schedulable; sends that finished (and loads
        of requests finished meanwhile) release the held blocks."""
        for req_id in output.finished_recving:
            if req_id in self.loading:
                self.finished_recving.add(req_id)
        for req_id in output.finished_sending | output.finished_recving:
            req = self.held.pop(req_id, None)
            if req is not None:
                self.kv.free(req)
        assert self.connector is not None
        self.connector.update_connector_output(output)

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in (params.stop_token_ids or ()):
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Undo a step that raised. Whatever it computed is not reported, so every request it
        scheduled or preempted finishes with ``FINISHED_ERROR`` (blocks it did not write, or a
        KV connector was to load in it, leave the prefix cache as they are freed), and the finished ids the workers may not have
        received go out again with the next step. Returns the failed request ids: all of the
        step's, those it finished before raising included, whose outputs were lost."""
        self.finished_req_ids |= scheduler_output.finished_req_ids
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        failed = [*scheduler_output.num_scheduled_tokens, *scheduler_output.preempted_req_ids]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= n
                if req_id in self.loaded_in_step:
                    req.num_computed_tokens = self.loaded_in_step[req_id]
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return failed

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish requests from outside the step (abort, stop string matched)."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req)

    def _finish(self, req: Request) -> dict[str, Any] | None:
        """Drop a finished request and release its blocks (unless the connector still needs
        them); returns the connector's ``kv_transfer_params`` for it."""
        if req in self.running:
            self.running.remove(req)
        del self.requests[req.request_id]
        self.draft_policy.finish(req.request_id)
        self.finished_req_ids.add(req.request_id)
        params = None
        delay_free = False
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(
                req, self.kv.get_block_ids(req.request_id)
            )
        if req.request_id in self.loading:
            self.loading.discard(req.request_id)
            if req.request_id in self.finished_recving:
                self.finished_recving.discard(req.request_id)
            else:
                delay_free = True
        if delay_free:
            self.held[req.request_id] = req
        else:
            self.kv.free(req)
        return params
