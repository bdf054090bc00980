"""Contract points of an MLA attention backend (``is_mla()``): its configuration checks, its
latent cache layout, where it writes each token's latent and what it computes, against the
paged MLA reference backend (``torch_mla``) on paged mixed batches."""

from __future__ import annotations

import pytest

from tokenmill.attention_backends.torch_mla import TorchMLABackend
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.testing import backend_checks as checks
from tokenmill.testing.backend_checks import backend, device_type  # noqa: F401 (fixtures)
from tokenmill.testing.paged_mla import MLAShape, random_mla_batch, run_mla_steps

MLA_SHAPES = [MLAShape(1, 64, 16), MLAShape(4, 64, 64), MLAShape(16, 512, 64)]
"""One query head over a small latent, four over a latent with a wide rope part, and
DeepSeek-V3's latent (``kv_lora_rank`` 512 + rope 64) with sixteen."""


def _claimed(backend, device_type: str):
    """The kit's (shape, block_size) cases the backend accepts."""
    for shape in MLA_SHAPES:
        for block_size in checks.BLOCK_SIZES:
            config = AttentionConfig(
                head_size=shape.latent_size,
                dtype=checks.dtype_for(device_type),
                block_size=block_size,
                use_mla=True,
                device_type=device_type,
            )
            if not backend.validate_configuration(config):
                yield shape, block_size


@pytest.fixture(scope="module")
def comparison(backend, device_type) -> list[checks.Comparison]:
    """Every claimed case and shape through the backend and the reference, run once."""
    results = []
    for shape, block_size in _claimed(backend, device_type):
        for query_lens, context_lens in checks.SHAPES:
            batch = random_mla_batch(
                query_lens, context_lens, shape, block_size, dtype=checks.dtype_for(device_type),
                device=device_type, seed=shape.num_heads + block_size,
            )
            label = f"{shape} block_size={block_size} query_lens={query_lens} context_lens={context_lens}"
            results.append(
                checks.Comparison(
                    label, *run_mla_steps(backend, batch), *run_mla_steps(TorchMLABackend, batch)
                )
            )
    return results


def test_validate_configuration(backend):
    """validate_configuration returns reasons as strings and refuses non-MLA models and unknown KV dtypes"""
    checks.assert_reasons(backend)


def test_claims_kit_configurations(backend, device_type):
    """serves at least one of the kit's MLA head/latent/block-size cases on its device"""
    tried = f"{[str(shape) for shape in MLA_SHAPES]} x block sizes {checks.BLOCK_SIZES}"
    checks.assert_claims(_claimed(backend, device_type), device_type, tried)


def test_kv_cache_shape(backend):
    """get_kv_cache_shape holds exactly one latent (kv_lora_rank + rope) per token"""
    for num_blocks, block_size, latent_size in ((7, 16, 576), (3, 5, 80)):
        checks.assert_cache_shape(
            backend.get_kv_cache_shape(num_blocks, block_size, 1, latent_size),
            num_blocks * block_size * latent_size,
            f"one latent of size {latent_size} per token of {num_blocks} blocks of {block_size}",
        )


def test_writes_latent_where_slot_mapping_says(comparison):
    """writes each new token's latent [kv_c, k_pe] at its slot (block * block_size + offset) and nowhere else"""
    checks.assert_cache_matches(comparison, "latent", "[block, offset, latent dim]")


def test_matches_reference_on_mixed_batches(comparison, device_type):
    """attends like the MLA reference on mixed prefill/decode batches with cached prefixes"""
    checks.assert_outputs(comparison, device_type, TorchMLABackend.get_name())
