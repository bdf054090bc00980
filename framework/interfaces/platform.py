"""The hardware-platform interface (after vLLM's ``Platform``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tokenmill.interfaces.attention import AttentionConfig

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.interfaces.decode_graph import DecodeGraphRunner
    from tokenmill.distributed.device_communicator import DeviceCommunicator


OP_NAMES = (
    "rms_norm",
    "residual_sum",
    "silu_and_mul",
    "rotary_embedding",
    "embedding",
    "unquantized_linear",
    "unquantized_fused_moe",
    "lora_apply",
)
"""The ops a platform may replace: one per ``CustomOp`` layer (``tokenmill.layers``);
``unquantized_linear``, the :class:`~tokenmill.interfaces.quantization.LinearMethod` class
(made with no arguments) of the linear layers and LM head that no quantization method takes;
``unquantized_fused_moe``, the
:class:`~tokenmill.layers.fused_moe.UnquantizedFusedMoEMethod` class of the MoE layers; and
``lora_apply`` (a ``CustomOp`` layer too), the batched LoRA shrink and expand of
:class:`~tokenmill.layers.lora.LoRAApply`: every token's own adapter added to a linear
layer's output in one call."""


class Platform:
    """A device family the engine can run on. Subclasses set the class attributes and override
    the class methods that differ; nothing is instantiated."""

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    supported_quantization: ClassVar[tuple[str, ...]] = ()
    """Quantization methods it runs; empty: any registered method (as in vLLM)."""
    dist_backend: ClassVar[str] = "gloo"
    """The ``torch.distributed`` backend its tensor-parallel ranks talk over."""
    detection_priority: ClassVar[int] = 0
    """Among available built-in platforms the highest priority wins (CUDA over CPU)."""
    custom_ops: ClassVar[Mapping[str, Callable[..., Any] | str]] = {}
    """The op table: op name (one of ``OP_NAMES``, a layer's ``op_name``) -> ``op(layer, *args)``
    replacing that layer's ``forward_native``, or the op's ``"module:function"`` path. Layers
    without an entry use ``forward_native``."""

    @classmethod
    def is_available(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> type[DeviceCommunicator]:
        """The collectives of this platform's process groups (tensor-parallel all-reduce and
        all-gather, pipeline send/recv, expert-parallel dispatch/combine): the base
        :class:`~tokenmill.distributed.device_communicator.DeviceCommunicator` runs them all
        through ``torch.distributed`` on ``dist_backend``."""
        from tokenmill.distributed.device_communicator import DeviceCommunicator

        return DeviceCommunicator

    @classmethod
    def is_auto_selectable(cls) -> bool:
        """Whether auto-detection may pick this platform when it is available. A platform meant
        to run only when named (``platform=`` / ``TOKENMILL_PLATFORM``) returns False."""
        return True

    @classmethod
    def get_device_capability(cls) -> tuple[int, int] | None:
        return None

    @classmethod
    def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
        """Backend names to try, by priority."""
        return []

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype ``dtype="auto"`` resolves to for a checkpoint stored in ``model_dtype``."""
        return model_dtype if model_dtype in cls.supported_dtypes else cls.supported_dtypes[0]

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Adjust or reject an engine configuration for this platform."""

    @classmethod
    def get_ops(cls) -> dict[str, Callable[..., Any]]:
        """``custom_ops`` with every path imported: the op table a model is built with (once per
        engine)."""
        unknown = sorted(set(cls.custom_ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(
                f"platform {cls.name!r} replaces unknown op(s) {', '.join(map(repr, unknown))}; "
                f"ops are {', '.join(OP_NAMES)}"
            )
        return {name: _resolve_op(cls.name, name, op) for name, op in cls.custom_ops.items()}

    @classmethod
    def decode_graph_runner(cls, config: EngineConfig) -> type[DecodeGraphRunner] | None:
        """The platform's :class:`~tokenmill.interfaces.decode_graph.DecodeGraphRunner`
        subclass that captures and replays decode steps, or None (the default) to run every
        step eagerly. ``enforce_eager`` turns graphs off whatever this returns."""
        return None

    @classmethod
    def place_weights(cls, model: nn.Module) -> None:
        """Move a just-loaded model's parameters to the memory this platform reads them
        fastest from. Called once for each model loaded (the target by the worker, a draft model
        or head by its proposer), before anything records where a weight lies (decode graphs,
        LoRA wrappers). The default leaves them where loading put them; the CPU platform moves
        them onto huge pages."""

    @classmethod
    def import_kernels(cls) -> None:
        """Import compiled kernels the platform needs, once per process."""

    @classmethod
    def device(cls, rank: int = 0) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def get_device_total_memory(cls) -> int:
        raise NotImplementedError

    @classmethod
    def get_available_memory(cls) -> int:
        raise NotImplementedError

    @classmethod
    def get_kv_cache_budget(cls, config: EngineConfig) -> int:
        """Bytes for the KV cache when the user gave neither blocks nor bytes."""
        raise NotImplementedError

    @classmethod
    def set_num_threads(cls, config: EngineConfig) -> None:
        """Apply thread settings for the current process."""

    @classmethod
    def before_step(cls) -> None:
        """Called by the worker before each step, in the thread that runs the step's forward
        (thread settings such as torch's thread count are per thread). The CPU platform adapts
        its thread count to the cores other processes leave free here."""


def _resolve_op(platform: str, name: str, op: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(op):
        return op
    module_name, _, attr = op.partition(":")
    try:
        resolved: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        return resolved
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"platform {platform!r}: cannot import op {name!r} from {op!r}: {e}"
        ) from e
