"""Contract points of an attention backend: its configuration checks, its cache layout, where
it writes K/V and what it computes, against the reference backend on paged mixed batches.
MLA backends (``is_mla()``) are checked by ``suite_mla_backend`` instead."""

from __future__ import annotations

import pytest

from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.testing import backend_checks as checks
from tokenmill.testing.backend_checks import backend, device_type  # noqa: F401 (fixtures)
from tokenmill.testing.paged import context_fill, random_batch, run_steps

HEADS = [(4, 4, 64), (12, 4, 128), (6, 1, 80)]
"""(query heads, KV heads, head size): MHA, GQA 3:1, and MQA with an odd head size. KV heads
avoid 2 so that every dimension of the reference layout has its own size."""
WINDOW = 7


def _claimed(backend, device_type: str, sliding_window: int | None = None):
    """The kit's (heads, kv_heads, head_size, block_size) cases the backend accepts (with a
    window, in the first block size only)."""
    for heads, kv_heads, head_size in HEADS:
        for block_size in checks.BLOCK_SIZES[: 1 if sliding_window else None]:
            config = AttentionConfig(
                head_size=head_size,
                dtype=checks.dtype_for(device_type),
                block_size=block_size,
                device_type=device_type,
                sliding_window=sliding_window,
            )
            if not backend.validate_configuration(config):
                yield heads, kv_heads, head_size, block_size


@pytest.fixture(scope="module")
def comparison(backend, device_type) -> list[checks.Comparison]:
    """Every claimed case and shape without a window, run once for the tests that read it."""
    return list(_compare(backend, device_type))


def _compare(backend, device_type, sliding_window=None):
    """Each claimed case and shape through the backend and the reference."""
    dtype = checks.dtype_for(device_type)
    for heads, kv_heads, head_size, block_size in _claimed(backend, device_type, sliding_window):
        for query_lens, context_lens in checks.SHAPES:
            batch = random_batch(
                query_lens, context_lens, heads, kv_heads, head_size, block_size,
                dtype=dtype, device=device_type, seed=heads + block_size,
            )
            steps = [context_fill(batch), batch] if any(context_lens) else [batch]
            label = (
                f"heads={heads} kv_heads={kv_heads} head_size={head_size} "
                f"block_size={block_size} query_lens={query_lens} context_lens={context_lens} "
                f"sliding_window={sliding_window}"
            )
            yield checks.Comparison(
                label,
                *run_steps(backend, steps, sliding_window=sliding_window),
                *run_steps(TorchRefBackend, steps, sliding_window=sliding_window),
            )


def test_validate_configuration(backend):
    """validate_configuration returns reasons as strings and refuses MLA and unknown KV dtypes"""
    checks.assert_reasons(backend)


def test_claims_kit_configurations(backend, device_type):
    """serves at least one of the kit's head/GQA/block-size cases on its device"""
    tried = f"{HEADS} x block sizes {checks.BLOCK_SIZES}"
    checks.assert_claims(_claimed(backend, device_type), device_type, tried)


def test_kv_cache_shape(backend):
    """get_kv_cache_shape holds exactly one block's K and V per block"""
    for num_blocks, block_size, kv_heads, head_size in ((7, 16, 4, 64), (3, 5, 1, 80)):
        checks.assert_cache_shape(
            backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size),
            2 * num_blocks * block_size * kv_heads * head_size,
            f"the keys and values of {num_blocks} blocks of {block_size} tokens, {kv_heads} KV "
            f"heads of size {head_size}",
        )


def test_writes_kv_where_slot_mapping_says(comparison):
    """writes each new token's K/V at its slot (block * block_size + offset) and nowhere else"""
    checks.assert_cache_matches(comparison, "K/V", "[k/v, block, offset, kv_head, dim]")


def test_matches_reference_on_mixed_batches(comparison, device_type):
    """attends like the reference on mixed prefill/decode batches with cached prefixes, GQA and MQA"""
    checks.assert_outputs(comparison, device_type, TorchRefBackend.get_name())


def test_sliding_window(backend, device_type):
    """serves sliding windows like the reference, or refuses them"""
    if not backend.supports_sliding_window:
        config = AttentionConfig(head_size=64, dtype=checks.dtype_for(device_type), device_type=device_type, sliding_window=WINDOW)
        assert backend.validate_configuration(config), "accepts a sliding window without supports_sliding_window"
        return
    checks.assert_outputs(list(_compare(backend, device_type, WINDOW)), device_type, TorchRefBackend.get_name())
