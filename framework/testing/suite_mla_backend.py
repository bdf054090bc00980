"""Contract points of an MLA attention backend (``is_mla()``): its configuration checks, its
latent cache layout, where it writes each token's latent and what it computes, against the
paged MLA reference backend (``torch_mla``) on paged mixed batches."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention_backends.torch_mla import TorchMLABackend
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.testing.backend_checks import (
    BLOCK_SIZES,
    SHAPES,
    Comparison,
    assert_cache_matches,
    assert_outputs,
    assert_reasons,
    dtype_for,
)
from tokenmill.testing.backend_checks import backend, device_type  # noqa: F401 (fixtures)
from tokenmill.testing.paged import layout_permutation
from tokenmill.testing.paged_mla import MLAShape, random_mla_batch, run_mla_steps

MLA_SHAPES = [MLAShape(1, 64, 16), MLAShape(4, 64, 64), MLAShape(16, 512, 64)]
"""One query head over a small latent, four over a latent with a wide rope part, and
DeepSeek-V3's latent (``kv_lora_rank`` 512 + rope 64) with sixteen."""


def _claimed(backend, device_type: str):
    """The kit's (shape, block_size) cases the backend accepts."""
    for shape in MLA_SHAPES:
        for block_size in BLOCK_SIZES:
            config = AttentionConfig(
                head_size=shape.latent_size,
                dtype=dtype_for(device_type),
                block_size=block_size,
                use_mla=True,
                device_type=device_type,
            )
            if not backend.validate_configuration(config):
                yield shape, block_size


@pytest.fixture(scope="module")
def comparison(backend, device_type) -> list[Comparison]:
    """Every claimed case and shape through the backend and the reference, run once."""
    results = []
    for shape, block_size in _claimed(backend, device_type):
        for query_lens, context_lens in SHAPES:
            batch = random_mla_batch(
                query_lens, context_lens, shape, block_size, dtype=dtype_for(device_type),
                device=device_type, seed=shape.num_heads + block_size,
            )
            outs, cache = run_mla_steps(backend, batch)
            ref_outs, ref_cache = run_mla_steps(TorchMLABackend, batch)
            label = f"{shape} block_size={block_size} query_lens={query_lens} context_lens={context_lens}"
            perm = layout_permutation(cache.shape, ref_cache.shape)
            results.append(Comparison(label, outs, ref_outs, cache, ref_cache, perm))
    return results


def test_validate_configuration(backend):
    """validate_configuration returns reasons as strings and refuses non-MLA models and unknown KV dtypes"""
    assert_reasons(backend)


def test_claims_kit_configurations(backend, device_type):
    """serves at least one of the kit's MLA head/latent/block-size cases on its device"""
    assert list(_claimed(backend, device_type)), (
        f"validate_configuration rejects every MLA case the kit tries on {device_type}: "
        f"{[str(s) for s in MLA_SHAPES]} x block sizes {BLOCK_SIZES}"
    )


def test_kv_cache_shape(backend):
    """get_kv_cache_shape holds exactly one latent (kv_lora_rank + rope) per token"""
    for num_blocks, block_size, latent_size in ((7, 16, 576), (3, 5, 80)):
        shape = backend.get_kv_cache_shape(num_blocks, block_size, 1, latent_size)
        assert all(isinstance(d, int) and d > 0 for d in shape), f"shape {shape} is not positive ints"
        assert torch.Size(shape).numel() == num_blocks * block_size * latent_size, (
            f"shape {tuple(shape)} for {num_blocks} blocks of {block_size} tokens with latents "
            f"of size {latent_size} does not hold exactly one latent per token"
        )


def test_writes_latent_where_slot_mapping_says(comparison):
    """writes each new token's latent [kv_c, k_pe] at its slot (block * block_size + offset) and nowhere else"""
    assert_cache_matches(comparison, "latent", "[block, offset, latent dim]")


def test_matches_reference_on_mixed_batches(comparison, device_type):
    """attends like the MLA reference on mixed prefill/decode batches with cached prefixes"""
    assert_outputs(comparison, device_type, TorchMLABackend.get_name())
