"""The GPU tests' backend chooser; the paged batches themselves live in ``tokenmill.testing``."""

from __future__ import annotations

import pytest
import torch

from tokenmill import plugins
from tokenmill.interfaces.attention import AttentionBackend, AttentionConfig
from tokenmill.selector import backend_reasons


def usable_backend(
    name: str, head_size: int, dtype: torch.dtype, block_size: int
) -> type[AttentionBackend]:
    """The registered backend ``name``, or a skip with its reasons when it cannot serve this
    configuration on the GPU here."""
    config = AttentionConfig(
        head_size=head_size, dtype=dtype, block_size=block_size, device_type="cuda"
    )
    reasons = backend_reasons(name, config)
    if reasons:
        pytest.skip(f"{name} cannot serve {config}: {'; '.join(reasons)}")
    return plugins.get_registry("attention_backends").load(name)
