"""Every ``TOKENMILL_*`` environment variable tokenmill reads, with its type, default and doc.

As vLLM's ``vllm.envs``: ``envs.TOKENMILL_CACHE_DIR`` reads the environment when accessed, so a
change (or a test's ``monkeypatch.setenv``) takes effect at once. An unset or empty variable has
its default; a value of the wrong type is a ``ValueError`` naming the variable. Kept free of
heavy imports: the ``tokenmill`` command lists these in its ``--help``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

EnvType = Literal["str", "int", "float", "bool", "list"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    return value in _TRUE


def _parse_list(text: str) -> list[str] | None:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return names or None


_PARSERS: dict[EnvType, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": _parse_bool,
    "list": _parse_list,
}


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its type (how its text is parsed), its value when unset or
    empty, and what it does."""

    type: EnvType
    default: Any
    doc: str

    def read(self, name: str) -> Any:
        """The variable's value now."""
        text = os.environ.get(name, "")
        if not text.strip():
            return self.default
        try:
            return _PARSERS[self.type](text)
        except ValueError as e:
            raise ValueError(f"{name}={text!r} is not a valid {self.type}: {e}") from None

    def describe(self) -> str:
        """The doc with the type and the default (when it is not None), as ``tokenmill --help``
        shows it."""
        if self.default is None:
            return f"{self.doc} ({self.type})"
        default = int(self.default) if self.type == "bool" else self.default
        return f"{self.doc} ({self.type}, default: {default})"


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    "TOKENMILL_PLUGINS": EnvVar(
        "list",
        None,
        "comma-separated entry-point names of the plugins to load (the built-ins: platforms, "
        "attention_backends, models, spec_decode, quantization, commands, tool_parsers, kv_connectors); unset: all "
        "installed",
    ),
    "TOKENMILL_PLATFORM": EnvVar(
        "str", None, "platform to use instead of auto-detection; the platform argument wins"
    ),
    "TOKENMILL_ATTENTION_BACKEND": EnvVar(
        "str",
        None,
        "attention backend to use instead of the platform's candidates; the attention_backend "
        "argument wins",
    ),
    "TOKENMILL_CACHE_DIR": EnvVar(
        "str",
        None,
        "cache root for the converted default model and the compiled CPU kernels; unset: "
        "$XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill",
    ),
    "TOKENMILL_CPU_KVCACHE_SPACE": EnvVar(
        "float",
        2.0,
        "KV-cache size in GiB on a CPU platform when kv_cache_memory_bytes and num_kv_blocks "
        "are unset, at most a quarter of the available memory",
    ),
    "TOKENMILL_PP_LAYER_PARTITION": EnvVar(
        "list",
        None,
        "decoder layers of each pipeline stage, comma-separated (e.g. 10,20 for 30 layers over "
        "two stages); unset: an even split, the remainder to the stages before the last",
    ),
    "TOKENMILL_PP_BATCH_QUEUE": EnvVar(
        "bool",
        True,
        "under pipeline parallelism keep pipeline_parallel_size steps in flight so the stages "
        "work at once; 0: one step at a time (to measure what the queue gains)",
    ),
    "TOKENMILL_CPU_THREADS": EnvVar(
        "int", None, "torch threads of an engine on a CPU platform; unset: torch's default"
    ),
    "TOKENMILL_CPU_ADAPTIVE_THREADS": EnvVar(
        "bool",
        True,
        "step with fewer threads than TOKENMILL_CPU_THREADS (or torch's default) while other "
        "processes keep the cores busy, and with all of them again when the cores are free; 0: "
        "always all of them",
    ),
    "TOKENMILL_CPU_ISA": EnvVar(
        "str",
        "native",
        "instruction set the C kernels are built for: native (this CPU's, -march=native), avx2 "
        "(AVX2 + FMA, as on an AVX2-only CPU) or avx512 (adds AVX-512 F/VL/DQ/BW); avx2 also "
        "keeps the CPU platform's default dtype at float32 as on a CPU without native bf16",
    ),
    "TOKENMILL_DISABLE_CPU_KERNELS": EnvVar(
        "bool", False, "use torch ops instead of the C kernels compiled on first use"
    ),
    "TOKENMILL_GGUF_FLOAT_ACTIVATIONS": EnvVar(
        "bool",
        False,
        "GGUF weight blocks multiply float32 activations (the float product with the "
        "dequantized weights) instead of activations quantized to int8 blocks as llama.cpp does",
    ),
    "TOKENMILL_LOGGING_LEVEL": EnvVar(
        "str", "INFO", "level of the tokenmill logger: DEBUG, INFO, WARNING, ERROR or CRITICAL"
    ),
    "TOKENMILL_CONFIGURE_LOGGING": EnvVar(
        "bool",
        True,
        "give the tokenmill logger its own stderr handler and level; 0: leave it to the "
        "application's logging configuration",
    ),
    "TOKENMILL_ENGINE_STALL_TIMEOUT_S": EnvVar(
        "float",
        120.0,
        "seconds an engine core of 'tokenmill serve' may hold work without finishing a step "
        "before /health reports it stalled (503); it recovers once the core reports again",
    ),
    "TOKENMILL_GRAMMAR_COMPILE_TIMEOUT": EnvVar(
        "float",
        60.0,
        "seconds a request's structured-output constraint may take to compile; a request whose "
        "constraint takes longer finishes with finish_reason 'error'",
    ),
    "TOKENMILL_API_KEY": EnvVar(
        "str",
        None,
        "key 'tokenmill serve' requires as 'Authorization: Bearer KEY' on /v1 when --api-key "
        "is not given; unset: no key",
    ),
    "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        "bool",
        False,
        "'tokenmill serve --enable-lora' opens POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter, which load adapters from the server's disk; off: no such routes",
    ),
}


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name].read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])
