"""Contract points of a speculative-decoding proposer: greedy output unchanged by speculation
(plain, chunked prefill, preemption), and drafts within ``num_speculative_tokens``."""

from __future__ import annotations

import pytest

from tokenmill.testing.checkpoints import engine_greedy, save_tiny_checkpoint

K = 3
MAX_TOKENS = 24
VARIANTS = {
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 12},
}


@pytest.fixture(scope="module")
def target(tokenmill_proposer: str, tmp_path_factory, request):
    """The author's target (hook ``pytest_tokenmill_proposer_target``), else a tiny Llama."""
    path = tmp_path_factory.mktemp("proposer_target")
    custom = request.config.hook.pytest_tokenmill_proposer_target(method=tokenmill_proposer, path=path)
    return custom or save_tiny_checkpoint("LlamaForCausalLM", path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that lookup proposers find something to draft."""
    return [[(7 * i + j % 5) % 256 for j in range(n)] for i, n in enumerate((12, 25, 31, 40))]


@pytest.fixture(scope="module")
def speculative_config(tokenmill_proposer: str, target, prompts, request) -> dict:
    """The author's config (hook ``pytest_tokenmill_speculative_config``), else the method with
    ``num_speculative_tokens`` (and the target as its own draft for ``draft_model``)."""
    config = request.config.hook.pytest_tokenmill_speculative_config(
        method=tokenmill_proposer, model_path=target, prompts=prompts
    )
    if config is None:
        config = {"method": tokenmill_proposer}
        if tokenmill_proposer == "draft_model":
            config["model"] = str(target)
    return {"num_speculative_tokens": K, "disable_by_batch_size": 0, **config}


@pytest.fixture(scope="module")
def baseline(target, prompts):
    return engine_greedy(target, prompts, MAX_TOKENS)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_unchanged(target, prompts, baseline, speculative_config, variant):
    """leaves greedy outputs as they are without speculation, blocks all freed"""
    tokens, stats = engine_greedy(
        target, prompts, MAX_TOKENS, speculative_config=speculative_config, **VARIANTS[variant]
    )
    for i, (ours, ref) in enumerate(zip(tokens, baseline)):
        assert ours == ref, (
            f"{variant}: speculation with {speculative_config} changed the greedy tokens of "
            f"prompt {i}: {ours} instead of {ref}"
        )
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    if variant == "preemption":
        assert stats["num_preemptions"] > 0, "the small cache did not preempt; the check did not run"


def test_drafts_within_k(target, prompts, speculative_config):
    """proposes at most num_speculative_tokens drafts per request and step"""
    _, stats = engine_greedy(target, prompts, MAX_TOKENS, speculative_config=speculative_config)
    k = speculative_config["num_speculative_tokens"]
    drafts, tokens = stats["spec_num_drafts"], stats["spec_num_draft_tokens"]
    assert tokens <= k * drafts, f"{tokens} draft tokens in {drafts} drafts exceed k = {k}"
    assert stats["spec_num_accepted_tokens"] <= tokens
    positions = [key for key in stats if key.startswith("spec_num_accepted_tokens_pos_")]
    assert all(int(key.rsplit("_", 1)[1]) < k for key in positions), positions
