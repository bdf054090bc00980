"""What the attention-backend suites (``suite_backend``, and ``suite_mla_backend`` for MLA
backends) share: the fixtures naming the backend and its device, and the checks of its
configuration reasons, its cache after the writes and its outputs against a reference."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch

from tokenmill import plugins
from tokenmill.interfaces.attention import AttentionBackend, AttentionConfig
from tokenmill.testing.paged import MIXED_SHAPES, layout_permutation

BLOCK_SIZES = [16, 5]
SHAPES = [*MIXED_SHAPES, ([1] * 6, [3, 16, 17, 40, 1, 70])]
"""(query lengths, context lengths): mixed steps (fresh prefills, chunks on cached prefixes,
decodes), and decodes only."""


@pytest.fixture(scope="module")
def backend(tokenmill_backend: str) -> type[AttentionBackend]:
    return plugins.get_registry("attention_backends").load(tokenmill_backend)


@pytest.fixture(scope="module")
def device_type(backend) -> str:
    """The device the backend is checked on: the CPU when it serves the CPU, else a GPU."""
    for device_type in ("cpu", "cuda"):
        config = AttentionConfig(
            head_size=64, dtype=dtype_for(device_type), device_type=device_type, use_mla=backend.is_mla()
        )
        if not backend.validate_configuration(config):
            if device_type == "cuda" and not torch.cuda.is_available():
                break
            return device_type
    pytest.skip("needs a GPU: the backend serves no CPU configuration")


def dtype_for(device_type: str) -> torch.dtype:
    """The activation dtype the kit checks with on ``device_type``."""
    return torch.float32 if device_type == "cpu" else torch.float16


@dataclass
class Comparison:
    """One case run through the backend and through the reference backend: each step's
    output, and the cache after the last step."""

    label: str
    outputs: list[torch.Tensor]
    cache: torch.Tensor
    reference_outputs: list[torch.Tensor]
    reference_cache: torch.Tensor

    @property
    def permutation(self) -> tuple[int, ...] | None:
        """``cache.permute(permutation)`` is in the reference layout; None when no permutation
        of the backend's layout is known to be."""
        return layout_permutation(tuple(self.cache.shape), tuple(self.reference_cache.shape))


def assert_reasons(backend: type[AttentionBackend]) -> None:
    """``validate_configuration`` gives non-empty string reasons, and refuses configurations of
    the other kind (MLA or not) and KV-cache dtypes outside ``supported_kv_cache_dtypes``."""
    for use_mla in (False, True):
        for kv_dtype in ("auto", "fp8_e5m2"):
            for device_type in ("cpu", "cuda"):
                config = AttentionConfig(
                    head_size=64, dtype=dtype_for(device_type), kv_cache_dtype=kv_dtype,
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


def assert_claims(cases: Iterable, device_type: str, tried: str) -> None:
    """``validate_configuration`` accepts at least one of ``cases``, the accepted ones among
    the kit's ``tried`` cases."""
    assert list(cases), (
        f"validate_configuration rejects every case the kit tries on {device_type}: {tried}"
    )


def assert_cache_shape(shape: tuple[int, ...], numel: int, holds: str) -> None:
    """``shape`` (``get_kv_cache_shape``'s) is positive ints with ``numel`` elements, what the
    cache of ``holds`` takes."""
    assert all(isinstance(d, int) and d > 0 for d in shape), f"shape {shape} is not positive ints"
    assert torch.Size(shape).numel() == numel, f"shape {tuple(shape)} does not hold exactly {holds}"


def assert_cache_matches(comparisons: Iterable[Comparison], written: str, index: str) -> None:
    """The backend's cache, permuted to the reference layout, equals the reference's after the
    writes of ``written`` (``index`` names the reference layout's dimensions); skips when no
    case's layout is a permutation of the reference's."""
    checked = False
    for c in comparisons:
        if c.permutation is None:
            continue
        checked = True
        wrong = (c.cache.permute(c.permutation).float() != c.reference_cache.float()).nonzero()
        assert wrong.numel() == 0, (
            f"the cache differs from the reference after the {written} writes ({c.label}): "
            f"first wrong element {index} = {wrong[0].tolist()}"
        )
    if not checked:
        pytest.skip("the layout is not a permutation of the reference layout; writes are checked through reads only")


def assert_outputs(comparisons: Iterable[Comparison], device_type: str, reference: str) -> None:
    """Every step's output is within tolerance of the ``reference`` backend's."""
    tol = 1e-4 if device_type == "cpu" else 2e-2
    for c in comparisons:
        for step, (out, ref) in enumerate(zip(c.outputs, c.reference_outputs)):
            err = (out.float() - ref.float()).abs().max().item()
            assert out.shape == ref.shape and err <= tol * (1 + ref.abs().max().item()), (
                f"attention output differs from the reference backend {reference!r} by "
                f"{err:.3g} (step {step + 1} of {len(c.outputs)}, {c.label})"
            )
