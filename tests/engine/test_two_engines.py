"""Two engines in one process share no build or scratch state: built and stepped at the same time
in two threads, with different quantization methods, each gives exactly the tokens it gives
alone."""

from __future__ import annotations

import threading

from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import random_prompts, save_tiny_checkpoint

ENGINE = dict(block_size=8, max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=512, enforce_eager=True)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
METHODS = ("int8", "int4")
ROUNDS = 2
"""The later rounds hit the prefix cache: each engine's own blocks, not the other's."""


def run(path, method: str, prompts, rounds: int) -> list[list[tuple]]:
    """Each round's outputs (ids, logprobs) for ``prompts``: prefills of 4 x 64 tokens, so the
    methods dequantize their weights into the scratch workspace (``gemm_rows``)."""
    llm = LLM(model=str(path), quantization=method, **ENGINE)
    results = []
    for _ in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    return results


def test_two_quantized_engines_in_threads_get_their_own_tokens(tmp_path):
    path = save_tiny_checkpoint("LlamaForCausalLM", tmp_path / "tiny", hidden_size=256, intermediate_size=512)
    prompts = random_prompts(256, lengths=(64, 64, 64, 64))
    alone = {method: run(path, method, prompts, ROUNDS) for method in METHODS}
    assert alone["int8"][0] != alone["int4"][0]

    together: dict[str, list] = {}
    errors: list[BaseException] = []

    def worker(method: str) -> None:
        try:
            together[method] = run(path, method, prompts, ROUNDS)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(m,)) for m in METHODS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for method in METHODS:
        assert together[method] == alone[method], method
