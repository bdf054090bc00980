"""What a model needs to run as pipeline stages (vLLM's ``SupportsPP`` pieces): the
activations one stage hands the next, the placeholder for modules another stage holds, and
the split of the decoder layers.

A model that supports pipeline parallelism sets ``supports_pp = True``, builds its layers
with :func:`make_layers` (the embedding only on the first stage, the final norm and the LM
head only on the last, :class:`PPMissingLayer` elsewhere), takes ``intermediate_tensors`` in
``forward`` on the later stages and returns :class:`IntermediateTensors` from the earlier ones,
and skips checkpoint weights of modules it does not hold (:func:`missing_prefixes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_indices,
)


@dataclass
class IntermediateTensors:
    """The residual stream between two stages: the last layer's output and the residual."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def pack(self) -> torch.Tensor:
        """``[2, T, hidden]``: one tensor to send."""
        return torch.stack((self.hidden_states, self.residual))

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> IntermediateTensors:
        return cls(packed[0], packed[1])


class PPMissingLayer(nn.Module):
    """Stands for a module another pipeline stage holds: no parameters, and calling it is a
    bug."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a module of another pipeline stage was called")


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """This stage's ``[start, end)`` layers and a list of all ``num_layers`` (so names keep
    their checkpoint indices), ``build(i)`` for this stage's and :class:`PPMissingLayer` for
    the others."""
    start, end = get_pp_indices(
        num_layers, get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
    )
    layers = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes (``"model.layers.3."``) of the modules of other stages in ``model``:
    checkpoint weights under them belong to another stage."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
