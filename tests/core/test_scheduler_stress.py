"""Randomized stress test of the scheduler and the KV-cache manager.

Each case draws a configuration (tiny caches, block and chunk sizes, budgets, policies,
watermark, prefix caching on or off) and a workload (arrivals between steps, shared prefixes,
salts, priorities, aborts, steps whose execution fails) and drives the real ``Scheduler`` and
``KVCacheManager``. The forward pass is played by ``PagedStore``: it writes, for every scheduled
token, a digest of the token's whole prefix into the token's slot (what a layer's K/V depends on)
and reads the context back through the request's blocks, as an attention kernel does. So any
block that is shared, hit or resumed without holding exactly that prefix is caught at once.
After every step the pool's invariants are checked, and every request that finished normally
must equal the same request run alone with room to spare.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager, cdiv
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams

VOCAB = 40
EOS = 3
MAX_STEPS = 20_000


def digest(prefix: list[int] | tuple[int, ...]) -> int:
    """What a token's KV stands for: its whole prefix."""
    return hash(tuple(prefix))


def next_token(context: list[int]) -> int:
    """The 'model': a deterministic token from the context's KV digests."""
    return hash(tuple(context)) % VOCAB


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What a request must produce however it was scheduled."""
    tokens, out = list(prompt), []
    while True:
        tok = next_token([digest(tokens[: p + 1]) for p in range(len(tokens))])
        out.append(tok)
        tokens.append(tok)
        if tok == EOS or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class PagedStore:
    """Plays the forward pass over a paged cache of digests (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, block_size: int) -> None:
        self.s = scheduler
        self.bs = block_size
        self.slots: dict[int, int] = {}

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out) -> dict[str, list[int]]:
        # Every layer writes the step's new K/V before any request attends, as backends do.
        work = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.s.requests[req_id]
            block_ids = self.s.kv.get_block_ids(req_id)
            end = req.num_computed_tokens
            assert len(block_ids) >= cdiv(end, self.bs), "fewer blocks than scheduled tokens"
            for pos in range(end - n, end):
                self.slots[self._slot(block_ids, pos)] = digest(req.all_token_ids[: pos + 1])
            work.append((req, block_ids, end))
        sampled = {}
        for req, block_ids, end in work:
            context = [self.slots.get(self._slot(block_ids, p)) for p in range(end)]
            truth = [digest(req.all_token_ids[: p + 1]) for p in range(end)]
            bad = next((p for p in range(end) if context[p] != truth[p]), None)
            assert bad is None, f"request {req.request_id} read a wrong KV entry at position {bad}"
            if end == req.num_tokens:
                sampled[req.request_id] = [next_token(context)]
        return sampled

    def scribble(self, out, rng: random.Random) -> None:
        """A failed step may have written garbage to some of the slots it scheduled."""
        for req_id, n in out.num_scheduled_tokens.items():
            block_ids = self.s.kv.get_block_ids(req_id)
            end = self.s.requests[req_id].num_computed_tokens
            for pos in range(end - n, end):
                if rng.random() < 0.5:
                    self.slots[self._slot(block_ids, pos)] = -1


def check_invariants(s: Scheduler, store: PagedStore, block_contents: dict) -> None:
    kv, pool = s.kv, s.kv.pool
    refs = [0] * pool.num_blocks
    for blocks in kv.req_to_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in one request"
        for b in blocks:
            refs[b.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == refs, "ref counts differ from the block lists"

    free, node = [], pool.free_queue.head.next_free
    while node is not pool.free_queue.tail:
        assert node.next_free.prev_free is node
        free.append(node.block_id)
        node = node.next_free
    assert len(free) == pool.free_queue.num_free_blocks == len(set(free))
    assert set(free) == {i for i, r in enumerate(refs) if r == 0}, "free queue != unreferenced"

    for h, block in pool.cached.items():
        assert block.block_hash == h
    for block in pool.blocks:
        if block.block_hash is not None:
            stored = [store.slots.get(block.block_id * store.bs + j) for j in range(store.bs)]
            assert stored == block_contents[block.block_hash], (
                f"block {block.block_id} is in the prefix cache without its KV computed"
            )

    running, waiting = {r.request_id for r in s.running}, {r.request_id for r in s.waiting}
    assert not running & waiting and running | waiting == set(s.requests)
    assert len(s.running) <= s.config.max_num_seqs
    for req in s.running:
        assert req.status == RequestStatus.RUNNING
        assert len(kv.req_to_blocks[req.request_id]) >= cdiv(req.num_computed_tokens, kv.block_size)
    for req in s.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert not kv.req_to_blocks.get(req.request_id) and req.num_computed_tokens == 0
    assert set(kv.num_cached_blocks) <= set(kv.req_to_blocks)


@dataclass
class Case:
    block_size: int
    num_blocks: int
    max_model_len: int
    budget: int
    max_seqs: int
    chunked: bool
    threshold: int
    policy: str
    watermark: float
    caching: bool

    @classmethod
    def draw(cls, rng: random.Random) -> Case:
        bs = rng.choice([1, 2, 4, 8])
        num_blocks = rng.randint(max(2, 12 // bs), max(4, 160 // bs))
        max_model_len = min(num_blocks * bs, rng.choice([24, 64, 128]))
        chunked = rng.random() < 0.8
        budget = rng.choice([rng.randint(1, 96), 512])
        return cls(
            bs,
            num_blocks,
            max_model_len,
            budget if chunked else max(budget, max_model_len),
            rng.randint(1, 8),
            chunked,
            rng.choice([0, 0, rng.randint(1, 16)]) if chunked else 0,
            rng.choice(["fcfs", "priority"]),
            rng.choice([0.0, 0.05, 0.2]),
            rng.random() < 0.8,
        )

    def max_prompt_len(self, watermark_blocks: int) -> int:
        return min(self.max_model_len - 1, (self.num_blocks - watermark_blocks) * self.block_size - 1)


def run_case(seed: int) -> None:
    rng = random.Random(seed)
    case = Case.draw(rng)
    kv = KVCacheManager(case.num_blocks, case.block_size, case.max_model_len, case.caching, case.watermark)
    s = Scheduler(
        SchedulerConfig(
            case.max_seqs, case.budget, case.max_model_len, case.chunked, case.threshold, case.policy
        ),
        kv,
    )
    store = PagedStore(s, case.block_size)
    hasher = make_block_hasher(case.block_size)
    block_contents: dict = {}
    max_prompt = case.max_prompt_len(kv.watermark_blocks)
    if max_prompt < 1:
        return
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))] for _ in range(3)]

    def new_request(i: int) -> Request:
        tokens = list(rng.choice(prefixes))[: rng.randint(0, max_prompt)]
        tokens += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        tokens = tokens[-max_prompt:] if rng.random() < 0.3 else tokens[:max_prompt]
        max_tokens = rng.choice([rng.randint(1, 24), case.max_model_len])
        return Request(
            f"r{i}", tokens, SamplingParams(max_tokens=max_tokens), EOS, max_tokens,
            arrival_time=float(i), priority=rng.randint(0, 3),
            cache_salt=rng.choice([None, None, "tenant-b"]), block_hasher=hasher,
        )

    def remember_blocks(req: Request) -> None:
        for i, h in enumerate(req.block_hashes):
            block_contents[h] = [
                digest(req.all_token_ids[: i * case.block_size + j + 1]) for j in range(case.block_size)
            ]

    total = rng.randint(1, 24)
    requests: dict[str, Request] = {}
    p_fail, p_abort = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.05])
    for _ in range(MAX_STEPS):
        while len(requests) < total and rng.random() < 0.5:
            req = new_request(len(requests))
            requests[req.request_id] = req
            s.add_request(req)
        if p_abort and s.requests and rng.random() < p_abort:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        if not s.has_unfinished_requests():
            if len(requests) == total:
                break
            continue
        out = s.schedule()
        if rng.random() < p_fail:
            store.scribble(out, rng)
            failed = s.fail_step(out)
            assert all(requests[r].status == RequestStatus.FINISHED_ERROR for r in failed)
        else:
            s.update_from_output(out, store.execute(out))
        for req in requests.values():
            remember_blocks(req)
        check_invariants(s, store, block_contents)
    else:
        pytest.fail(f"seed {seed}: not finished after {MAX_STEPS} steps ({case})")

    assert kv.get_num_free_blocks() == case.num_blocks and not kv.req_to_blocks
    for req in requests.values():
        if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            want = expected_output(req.prompt_token_ids, req.max_tokens, case.max_model_len)
            assert req.output_token_ids == want, f"seed {seed}: {req.request_id} differs ({case})"
        else:
            assert req.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@pytest.mark.parametrize("seed", range(300))
def test_random_workloads(seed):
    run_case(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(300, 1500))
def test_random_workloads_long(seed):
    run_case(seed)
