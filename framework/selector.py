"""Choosing the platform and the attention backend."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from tokenmill import envs, plugins
from tokenmill.interfaces.attention import AttentionBackend, AttentionConfig
from tokenmill.interfaces.platform import Platform


def select_platform(name: str | None = None) -> type[Platform]:
    """The named platform (argument, else ``TOKENMILL_PLATFORM``), else auto-detection among
    the available, auto-selectable platforms: an out-of-tree one wins over the built-ins, then
    ``detection_priority``."""
    registry = plugins.get_registry("platforms")
    name = name or envs.TOKENMILL_PLATFORM
    if name is not None:
        platform = registry.load(name)
        if not platform.is_available():
            raise ValueError(f"platform {name!r} is not available on this machine")
        return registry.choose(name)
    candidates = []
    for reg in registry.entries.values():
        platform = reg.load()
        if platform.is_available() and platform.is_auto_selectable():
            builtin = reg.distribution == "tokenmill"
            candidates.append((not builtin, platform.detection_priority, reg.name, platform))
    if not candidates:
        raise RuntimeError(
            f"no available platform among {', '.join(registry.names()) or 'none'}"
            + registry.filter_suffix()
        )
    return registry.choose(max(candidates, key=lambda c: c[:3])[2])


def select_attention_backend(
    platform: type[Platform], config: AttentionConfig, name: str | None = None
) -> type[AttentionBackend]:
    """The named backend (argument, else ``TOKENMILL_ATTENTION_BACKEND``) if it can serve
    ``config``, else the platform's candidates in order. Never silently substitutes: an explicit
    choice that cannot serve is an error with its reasons, and when no candidate fits the error
    lists each one with its reasons."""
    return choose_attention_backend(platform, config, name)[0]


def choose_attention_backend(
    platform: type[Platform], config: AttentionConfig, name: str | None = None
) -> tuple[type[AttentionBackend], str]:
    """``select_attention_backend``'s choice and why it was made: who named it, or, when
    chosen automatically, its rank among the platform's candidates and why those before it
    were passed over."""
    registry = plugins.get_registry("attention_backends")
    chosen_by = "attention_backend" if name else "TOKENMILL_ATTENTION_BACKEND"
    name = name or envs.TOKENMILL_ATTENTION_BACKEND
    if name is not None:
        reasons = backend_reasons(name, config)
        if reasons:
            raise ValueError(f"attention backend {name!r} cannot be used: {'; '.join(reasons)}")
        return registry.choose(name), f"set by {chosen_by}"
    candidates = platform.get_attn_backend_candidates(config)
    report = []
    for candidate in candidates:
        reasons = backend_reasons(candidate, config)
        if not reasons:
            why = (
                f"automatic: the first to serve the model among platform {platform.name}'s "
                f"candidates {', '.join(candidates)}"
            )
            if report:
                why += f"; passed over {' | '.join(report)}"
            return registry.choose(candidate), why
        report.append(f"{candidate}: {'; '.join(reasons)}")
    raise ValueError(
        f"no attention backend of platform {platform.name!r} can serve {config}: "
        + (" | ".join(report) or "the platform lists no candidates")
    )


class AttentionSelector:
    """Chooses each attention layer's backend while a model is built (vLLM's per-layer
    ``get_attn_backend``): :func:`choose_attention_backend` for the layer's own needs (head
    size, MLA or not, sliding window) and the engine's (dtype, KV-cache dtype, block size,
    device), so a model may mix layer kinds (MLA layers get MLA backends, the others MHA
    backends). Layers with equal needs share one choice; each choice keeps its reason, and a
    layer nothing can serve is an error naming it, with every candidate's reasons."""

    def __init__(
        self,
        platform: type[Platform],
        dtype: torch.dtype,
        kv_cache_dtype: str,
        block_size: int,
        name: str | None = None,
    ) -> None:
        self.platform = platform
        self.name = name
        self.template = AttentionConfig(
            head_size=0,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            device_type=platform.device_type,
        )
        self.choices: dict[AttentionConfig, tuple[type[AttentionBackend], str]] = {}
        self.num_layers: Counter[AttentionConfig] = Counter()

    def __call__(
        self,
        layer_name: str,
        head_size: int,
        *,
        use_mla: bool = False,
        sliding_window: int | None = None,
    ) -> type[AttentionBackend]:
        config = dataclasses.replace(
            self.template, head_size=head_size, use_mla=use_mla, sliding_window=sliding_window
        )
        if config not in self.choices:
            try:
                self.choices[config] = choose_attention_backend(self.platform, config, self.name)
            except ValueError as e:
                raise ValueError(f"{layer_name}: {e}") from None
        self.num_layers[config] += 1
        return self.choices[config][0]

    def describe(self) -> str:
        """The choices made, for the start-up log: ``attention backend NAME (reason)``, or with
        several, each with its number of layers."""
        layers: Counter[tuple[str, str]] = Counter()
        for config, (backend, why) in self.choices.items():
            layers[backend.get_name(), why] += self.num_layers[config]
        if len(layers) == 1:
            (name, why), = layers
            return f"attention backend {name} ({why})"
        return "attention backends " + ", ".join(
            f"{name} for {n} layers ({why})" for (name, why), n in layers.items()
        )


def backend_reasons(name: str, config: AttentionConfig) -> list[str]:
    """Why backend ``name`` cannot serve ``config`` (an import failure is a reason too); works
    while a broken plugin is installed, for ``tokenmill plugins``."""
    registry = plugins.get_registry("attention_backends", strict=False)
    registry.get(name)
    try:
        backend = registry.load(name)
    except plugins.PluginError as e:
        return [str(e.__cause__ or e)]
    return backend.validate_configuration(config)
