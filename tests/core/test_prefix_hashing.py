"""Prefix-cache block hashes: SHA-256 by default, so a crafted ``hash()`` collision cannot make
one request read another's KV blocks; ``cache_salt`` keeps tenants apart; digests are the
same in every process. The fast ``builtin`` algorithm is only chosen by the flag."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser, engine_kwargs
from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_utils import (
    builtin_block_hash,
    make_block_hasher,
    sha256_block_hash,
)
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.output_processor import RequestOutputKind

BS = 16
PAD = [7] * 8
COLLIDING_BLOCKS = (
    [232, 0, 40, 50, 158, 84, 203, 130] + PAD,
    [242, 205, 102, 3, 217, 95, 162, 27] + PAD,
)
"""Two different blocks with one CPython tuple ``hash()`` (found offline with a rho search on
the tuple hash's state after the first 8 tokens; any equal suffix keeps the collision)."""
TAIL = [1, 2, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, num_kv_blocks=64, max_model_len=256, block_size=BS, **kwargs)


def run(llm: LLM, prompt: dict) -> tuple[list[int], int]:
    """The greedy output's token ids and the prompt tokens that came from the prefix cache."""
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_blocks_collide_under_builtin_hash_only():
    a, b = (tuple(block) for block in COLLIDING_BLOCKS)
    assert a != b and hash(a) == hash(b)
    assert builtin_block_hash(None, a) == builtin_block_hash(None, b)
    assert sha256_block_hash(None, a) != sha256_block_hash(None, b)
    assert len(sha256_block_hash(None, a)) == 32


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_colliding_block_is_a_cache_hit_only_under_builtin(tiny_model, algo):
    """Under the default a request whose first block collides (by ``hash()``) with a cached one
    computes its own KV; the ``builtin`` flag shows what the collision would do."""
    victim, attacker = ({"prompt_token_ids": block + TAIL} for block in COLLIDING_BLOCKS)
    kwargs = {} if algo == "sha256" else {"prefix_caching_hash_algo": algo}
    llm = tiny_llm(tiny_model, **kwargs)
    run(llm, victim)
    tokens, num_cached = run(llm, attacker)
    if algo == "sha256":
        assert num_cached == 0
        assert tokens == run(tiny_llm(tiny_model, enable_prefix_caching=False), attacker)[0]
    else:
        assert num_cached == BS


def test_unknown_hash_algo_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig(prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        make_block_hasher(BS, "md5")


def test_cli_passes_hash_algo():
    args = build_parser().parse_args(["generate", "hi", "--prefix-caching-hash-algo", "builtin"])
    assert engine_kwargs(args)["prefix_caching_hash_algo"] == "builtin"
    assert engine_kwargs(build_parser().parse_args(["generate", "hi"]))[
        "prefix_caching_hash_algo"
    ] == "sha256"


HASH_IN_SUBPROCESS = """
from tokenmill.core.kv_cache_utils import get_hash_function
h = get_hash_function({algo!r})
salt = (("cache_salt", "tenant-a"),)
print(h(h(None, list(range(16)), salt), list(range(16, 32)), None).hex())
"""


def _hash_in_subprocess(algo: str, seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    code = HASH_IN_SUBPROCESS.format(algo=algo)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_sha256_hashes_are_the_same_in_every_process():
    salt = (("cache_salt", "tenant-a"),)
    here = sha256_block_hash(sha256_block_hash(None, list(range(16)), salt), list(range(16, 32)))
    assert {_hash_in_subprocess("sha256", seed) for seed in ("0", "4321")} == {here.hex()}
    builtin = {_hash_in_subprocess("builtin", seed) for seed in ("0", "4321")}
    assert len(builtin) == 2, "builtin hashes depend on PYTHONHASHSEED"


def test_cache_salt_isolates_tenants(tiny_model):
    llm = tiny_llm(tiny_model)
    ids = list(range(40, 73))

    def prompt(salt: str | None) -> dict:
        return {"prompt_token_ids": ids, **({} if salt is None else {"cache_salt": salt})}

    first = [run(llm, prompt(salt)) for salt in ("tenant-a", "tenant-b", None)]
    again = [run(llm, prompt(salt)) for salt in ("tenant-a", "tenant-b", None)]
    assert [cached for _, cached in first] == [0, 0, 0]
    assert [cached for _, cached in again] == [32, 32, 32]
    assert len({tuple(tokens) for tokens, _ in first + again}) == 1
    assert llm.get_stats()["prefix_cache_hit_tokens"] == 3 * 32


@pytest.mark.parametrize("salt", ["", 5, b"tenant"])
def test_invalid_cache_salt_is_refused_before_anything_runs(tiny_model, salt):
    llm = tiny_llm(tiny_model)
    good = {"prompt_token_ids": [1, 2, 3]}
    bad = {"prompt_token_ids": [1, 2, 3], "cache_salt": salt}
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([good, bad], GREEDY, use_tqdm=False)
    assert llm.get_stats()["num_requests_finished"] == 0
    assert not llm.llm_engine.has_unfinished_requests()


def test_async_llm_text_prompts_with_cache_salt():
    engine = AsyncLLM.from_engine_args(num_kv_blocks=64, max_model_len=512)
    text = "Tenants of one server must never read each other's cached prefixes. " * 3

    async def cached(salt: str) -> int:
        prompt = {"prompt": text, "cache_salt": salt}
        stream = engine.generate(prompt, GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
        return [output async for output in stream][-1].num_cached_tokens

    async def main() -> list[int]:
        with pytest.raises(ValueError, match="cache_salt"):
            await engine.add_request({"prompt": text, "cache_salt": ""})
        return [await cached(salt) for salt in ("a", "b", "a")]

    try:
        num_cached = asyncio.run(main())
    finally:
        engine.shutdown()
    assert num_cached[:2] == [0, 0] and num_cached[2] > 0
