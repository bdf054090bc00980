"""``AsyncLLM``: concurrent streams join one running batch, aborts free their blocks, bad
requests fail alone, and the engine loop outlives a failing step."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenmill.engine.async_llm import AsyncLLM, EngineStepError, QueueFullError, RequestStream
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.output_processor import RequestOutputKind
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import InputBatch

MAX_PENDING = 6
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM.from_engine_args(
        max_pending_requests=MAX_PENDING, num_kv_blocks=256, max_model_len=1024
    )
    yield engine
    engine.shutdown()
    assert not engine.is_running()


def wait_all_blocks_free(llm: AsyncLLM, timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.get_stats()
        if (
            stats["kv_blocks_free"] == stats["kv_blocks_total"]
            and stats["num_running_requests"] == 0
        ):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


async def last(stream: RequestStream) -> RequestOutput:
    return [output async for output in stream][-1]


async def collect(
    llm: AsyncLLM, prompt: str, params: SamplingParams
) -> tuple[str, str | None, int]:
    text, finish, steps = "", None, 0
    async for output in llm.generate(prompt, params):
        steps += 1
        for c in output.outputs:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, steps


def test_concurrent_streams_and_abort(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, stop=["\n\n"])

    async def abort_after(n: int) -> int:
        seen = 0
        async for _ in llm.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True)):
            seen += 1
            if seen == n:
                break
        return seen

    async def main():
        streamed = await asyncio.gather(abort_after(3), *(collect(llm, p, greedy) for p in PROMPTS))
        finals = []
        for p in PROMPTS:
            stream = await llm.add_request(p, greedy, output_kind=RequestOutputKind.FINAL_ONLY)
            finals.append([o async for o in stream])
        return streamed, finals

    streamed, finals = asyncio.run(main())
    assert streamed[0] == 3
    for (text, finish, steps), final in zip(streamed[1:], finals):
        assert len(final) == 1 and final[0].finished
        assert text == final[0].outputs[0].text and finish == final[0].outputs[0].finish_reason
        assert steps > 1
    stats = wait_all_blocks_free(llm)
    assert stats["num_requests_finished"] == 1 + 2 * len(PROMPTS)


def test_invalid_requests_fail_alone(llm):
    async def main():
        good = asyncio.ensure_future(
            collect(llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))
        )
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await llm.add_request({"prompt_token_ids": [10**9]})
        with pytest.raises(ValueError, match="at most"):
            await llm.add_request({"prompt_token_ids": [5] * 2000})
        taken = await llm.add_request("hi", SamplingParams(max_tokens=2), request_id="same")
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("hi", request_id="same")
        assert [o async for o in taken][-1].finished
        return await good

    text, finish, _ = asyncio.run(main())
    assert text and finish in ("stop", "length")
    wait_all_blocks_free(llm)


def test_queue_full(llm):
    async def main():
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        streams = [await llm.add_request(PROMPTS[2], params) for _ in range(MAX_PENDING)]
        with pytest.raises(QueueFullError):
            await llm.add_request(PROMPTS[2], params)
        for stream in streams:
            llm.abort(stream.request_id)
        return [await last(s) for s in streams]

    lasts = asyncio.run(main())
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in lasts)
    assert llm.num_unfinished_requests == 0
    wait_all_blocks_free(llm)


def test_failing_step_fails_its_requests_and_loop_survives(monkeypatch):
    real_step = EngineCore.step
    calls = {"n": 0}

    def flaky_step(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", flaky_step)
    llm = AsyncLLM.from_engine_args(engine_process=False, num_kv_blocks=64, max_model_len=512)

    async def main():
        with pytest.raises(RuntimeError, match="boom"):
            await collect(llm, PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
        return await collect(llm, PROMPTS[3], SamplingParams(temperature=0, max_tokens=4))

    try:
        text, finish, _ = asyncio.run(main())
        assert text and finish in ("stop", "length") and llm.is_running()
        wait_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_failing_step_fails_only_its_requests(monkeypatch):
    """A step that raised used to abort every request the core held, and (raising while
    filling the request's input-batch row) to keep the row, so with one sequence slot no
    request could run again (issue 36, item 10). Now only the step's request fails: the
    running one and those queued behind it complete as they do alone."""

    def broken(self, row, token_ids, num_prompt_tokens):
        raise RuntimeError("penalty row failed")

    monkeypatch.setattr(InputBatch, "_init_penalty_row", broken)
    llm = AsyncLLM.from_engine_args(
        engine_process=False, max_num_seqs=1, num_kv_blocks=64, max_model_len=512
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def failing() -> None:
        with pytest.raises(EngineStepError, match="penalty row failed"):
            await collect(llm, PROMPTS[1], SamplingParams(presence_penalty=0.5, max_tokens=4))

    async def main():
        tasks = [
            asyncio.create_task(collect(llm, PROMPTS[0], greedy)),
            asyncio.create_task(failing()),
            asyncio.create_task(collect(llm, PROMPTS[2], greedy)),
            asyncio.create_task(failing()),
            asyncio.create_task(collect(llm, PROMPTS[3], greedy)),
        ]
        together = await asyncio.gather(*tasks)
        alone = [await collect(llm, p, greedy) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
        return [together[0], together[2], together[4]], alone

    try:
        together, alone = asyncio.run(main())
        assert [(text, finish) for text, finish, _ in together] == [
            (text, finish) for text, finish, _ in alone
        ]
        assert all(finish == "length" and text for text, finish, _ in together)
        assert llm.is_running() and llm.num_unfinished_requests == 0
        wait_all_blocks_free(llm)
    finally:
        llm.shutdown()
