"""Contract points of an attention backend: its configuration checks, its cache layout, where
it writes K/V and what it computes, against the reference backend on paged mixed batches."""

from __future__ import annotations

import pytest
import torch

from tokenmill import plugins
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces.attention import AttentionBackend, AttentionConfig
from tokenmill.testing.paged import (
    MIXED_SHAPES,
    context_fill,
    random_batch,
    reference_permutation,
    run_steps,
)

HEADS = [(4, 4, 64), (12, 4, 128), (6, 1, 80)]
"""(query heads, KV heads, head size): MHA, GQA 3:1, and MQA with an odd head size. KV heads
avoid 2 so that every dimension of the reference layout has its own size."""
BLOCK_SIZES = [16, 5]
SHAPES = [*MIXED_SHAPES, ([1] * 6, [3, 16, 17, 40, 1, 70])]
"""(query lengths, context lengths): mixed steps (fresh prefills, chunks on cached prefixes,
decodes), and decodes only."""
WINDOW = 7


@pytest.fixture(scope="module")
def backend(tokenmill_backend: str) -> type[AttentionBackend]:
    return plugins.get_registry("attention_backends").load(tokenmill_backend)


@pytest.fixture(scope="module")
def device_type(backend) -> str:
    """The device the backend is checked on: the CPU when it serves the CPU, else a GPU."""
    for device_type in ("cpu", "cuda"):
        config = AttentionConfig(head_size=64, dtype=_dtype(device_type), device_type=device_type)
        if not backend.validate_configuration(config):
            if device_type == "cuda" and not torch.cuda.is_available():
                break
            return device_type
    pytest.skip("needs a GPU: the backend serves no CPU configuration")


def _dtype(device_type: str) -> torch.dtype:
    return torch.float32 if device_type == "cpu" else torch.float16


def _claimed(backend, device_type: str, sliding_window: int | None = None):
    """The kit's (heads, kv_heads, head_size, block_size) cases the backend accepts (with a
    window, in the first block size only)."""
    for heads, kv_heads, head_size in HEADS:
        for block_size in BLOCK_SIZES[: 1 if sliding_window else None]:
            config = AttentionConfig(
                head_size=head_size,
                dtype=_dtype(device_type),
                block_size=block_size,
                device_type=device_type,
                sliding_window=sliding_window,
            )
            if not backend.validate_configuration(config):
                yield heads, kv_heads, head_size, block_size


@pytest.fixture(scope="module")
def comparison(backend, device_type) -> list[tuple]:
    """Every claimed case and shape without a window, run once for the tests that read it."""
    return list(_compare(backend, device_type))


def _compare(backend, device_type, sliding_window=None):
    """Each claimed case and shape: (label, outputs, reference outputs, cache, reference cache,
    permutation to the reference layout)."""
    dtype = _dtype(device_type)
    for heads, kv_heads, head_size, block_size in _claimed(backend, device_type, sliding_window):
        for query_lens, context_lens in SHAPES:
            batch = random_batch(
                query_lens, context_lens, heads, kv_heads, head_size, block_size,
                dtype=dtype, device=device_type, seed=heads + block_size,
            )
            steps = [context_fill(batch), batch] if any(context_lens) else [batch]
            outs, cache = run_steps(backend, steps, sliding_window=sliding_window)
            ref_outs, ref_cache = run_steps(TorchRefBackend, steps, sliding_window=sliding_window)
            label = (
                f"heads={heads} kv_heads={kv_heads} head_size={head_size} "
                f"block_size={block_size} query_lens={query_lens} context_lens={context_lens}"
            )
            num_blocks = batch.kv_cache.shape[1]
            perm = reference_permutation(backend, num_blocks, block_size, kv_heads, head_size)
            yield label, outs, ref_outs, cache, ref_cache, perm


def _assert_outputs(results, device_type, sliding_window=None) -> None:
    tol = 1e-4 if device_type == "cpu" else 2e-2
    for label, outs, ref_outs, *_ in results:
        for step, (out, ref) in enumerate(zip(outs, ref_outs)):
            err = (out.float() - ref.float()).abs().max().item()
            assert out.shape == ref.shape and err <= tol * (1 + ref.abs().max().item()), (
                f"attention output differs from the reference backend by {err:.3g} "
                f"(step {step + 1} of {len(outs)}, {label}, sliding_window={sliding_window})"
            )


def test_validate_configuration(backend):
    """validate_configuration returns reasons as strings and refuses MLA and unknown KV dtypes"""
    for use_mla in (False, True):
        for kv_dtype in ("auto", "fp8_e5m2"):
            for device_type in ("cpu", "cuda"):
                config = AttentionConfig(
                    head_size=64, dtype=_dtype(device_type), kv_cache_dtype=kv_dtype,
                    use_mla=use_mla, device_type=device_type,
                )
                reasons = backend.validate_configuration(config)
                assert isinstance(reasons, list) and all(
                    isinstance(r, str) and r for r in reasons
                ), f"validate_configuration({config}) must return a list of non-empty strings, got {reasons!r}"
                if use_mla != backend.is_mla():
                    assert reasons, f"accepts {config} although is_mla() is {backend.is_mla()}"
                if kv_dtype not in backend.supported_kv_cache_dtypes:
                    assert reasons, f"accepts KV-cache dtype {kv_dtype!r} not in supported_kv_cache_dtypes"


def test_claims_kit_configurations(backend, device_type):
    """serves at least one of the kit's head/GQA/block-size cases on its device"""
    assert list(_claimed(backend, device_type)), (
        f"validate_configuration rejects every case the kit tries on {device_type}: "
        f"{HEADS} x block sizes {BLOCK_SIZES}"
    )


def test_kv_cache_shape(backend):
    """get_kv_cache_shape holds exactly one block's K and V per block"""
    for num_blocks, block_size, kv_heads, head_size in ((7, 16, 4, 64), (3, 5, 1, 80)):
        shape = backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
        assert all(isinstance(d, int) and d > 0 for d in shape), f"shape {shape} is not positive ints"
        assert torch.Size(shape).numel() == 2 * num_blocks * block_size * kv_heads * head_size, (
            f"shape {tuple(shape)} for {num_blocks} blocks of {block_size} tokens, {kv_heads} KV "
            f"heads of size {head_size} does not hold exactly their keys and values"
        )


def test_writes_kv_where_slot_mapping_says(comparison):
    """writes each new token's K/V at its slot (block * block_size + offset) and nowhere else"""
    checked = False
    for label, _, _, cache, ref_cache, perm in comparison:
        if perm is None:
            continue
        checked = True
        got = cache.permute(perm).float()
        wrong = (got != ref_cache.float()).nonzero()
        assert wrong.numel() == 0, (
            f"the cache differs from the reference after the K/V writes ({label}): first wrong "
            f"element [k/v, block, offset, kv_head, dim] = {wrong[0].tolist()}"
        )
    if not checked:
        pytest.skip("the layout is not a permutation of the reference layout; writes are checked through reads only")


def test_matches_reference_on_mixed_batches(comparison, device_type):
    """attends like the reference on mixed prefill/decode batches with cached prefixes, GQA and MQA"""
    _assert_outputs(comparison, device_type)


def test_sliding_window(backend, device_type):
    """serves sliding windows like the reference, or refuses them"""
    if not backend.supports_sliding_window:
        config = AttentionConfig(head_size=64, dtype=_dtype(device_type), device_type=device_type, sliding_window=WINDOW)
        assert backend.validate_configuration(config), "accepts a sliding window without supports_sliding_window"
        return
    _assert_outputs(list(_compare(backend, device_type, WINDOW)), device_type, WINDOW)
