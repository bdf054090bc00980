"""tokenmill: an LLM inference engine in the architecture of vLLM V1, built from plugins."""

from typing import TYPE_CHECKING, Any

from tokenmill import env_override
from tokenmill.logger import configure_logging
from tokenmill.plugins import hookimpl

env_override.apply()
configure_logging()

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.plugins import ModelRegistry
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "ModelRegistry": "tokenmill.plugins",
    "LoRARequest": "tokenmill.lora.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = [
    "LLM",
    "LoRARequest",
    "CompletionOutput",
    "ModelRegistry",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "hookimpl",
    "__version__",
]
