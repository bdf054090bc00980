"""Plugin loading: pluggy hook specs, entry points and the registries they fill.

Every platform, attention backend, model architecture, proposer, quantization method, KV
connector and ``tokenmill`` subcommand is registered through a ``register(name, "package.module:Class")``
callback handed to a hook implementation. First-party parts come through the same ``tokenmill.plugins`` entry points as
third-party ones. Targets are imported only when chosen.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from tokenmill import envs

logger = logging.getLogger(__name__)

PROJECT = "tokenmill"
ENTRY_POINT_GROUP = "tokenmill.plugins"
RUNTIME = "(runtime)"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

KINDS = {
    "platforms": "register_platforms",
    "attention_backends": "register_attention_backends",
    "models": "register_models",
    "proposers": "register_proposers",
    "quantization_methods": "register_quantization_methods",
    "commands": "register_commands",
    "tool_parsers": "register_tool_parsers",
    "kv_connectors": "register_kv_connectors",
}


class HookSpecs:
    """The hooks a plugin module may implement; each receives a ``register(name, target)``."""

    @hookspec
    def register_platforms(self, register: Callable[[str, str], None]) -> None:
        """Register hardware platforms: ``register("cpu", "pkg.mod:CpuPlatform")``."""

    @hookspec
    def register_attention_backends(self, register: Callable[[str, str], None]) -> None:
        """Register attention backends by name."""

    @hookspec
    def register_models(self, register: Callable[[str, str], None]) -> None:
        """Register model classes by HF architecture name (``config.json`` ``architectures``)."""

    @hookspec
    def register_proposers(self, register: Callable[[str, str], None]) -> None:
        """Register speculative-decoding proposers by method name."""

    @hookspec
    def register_quantization_methods(self, register: Callable[[str, str], None]) -> None:
        """Register quantization methods by name."""

    @hookspec
    def register_commands(self, register: Callable[[str, str], None]) -> None:
        """Register ``tokenmill`` subcommands: ``register("hello", "pkg.cli:add_hello")``, where
        ``add_hello(subparsers)`` adds the ``hello`` parser to the ``argparse`` subparsers and
        sets its ``func(args) -> int`` default; keep heavy imports inside ``func``."""

    @hookspec
    def register_tool_parsers(self, register: Callable[[str, str], None]) -> None:
        """Register tool-call parsers (``ToolParser`` subclasses) by the name
        ``--tool-call-parser`` takes: ``register("hermes", "pkg.mod:HermesParser")``."""

    @hookspec
    def register_kv_connectors(self, register: Callable[[str, str], None]) -> None:
        """Register KV connectors (``KVConnectorBase`` subclasses) by the name
        ``kv_transfer_config["kv_connector"]`` takes: ``register("storage", "pkg.mod:Cls")``."""


class PluginError(RuntimeError):
    """A plugin failed to load or register; the message names the plugin and its distribution."""


@dataclass(frozen=True)
class Registration:
    """One registered part: where it lives and who registered it."""

    kind: str
    name: str
    target: str
    plugin: str
    distribution: str
    cls: type | None = None
    """The class itself, when a runtime registration passed one instead of a path."""

    def load(self) -> Any:
        """Import and return the registered class (for a command, its function)."""
        if self.cls is not None:
            return self.cls
        module_name, _, attr = self.target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as e:
            raise PluginError(
                f"cannot import {_label(self.kind)} {self.name!r} "
                f"({self.target}) registered by plugin {self.plugin!r} "
                f"from distribution {self.distribution!r}: {e}"
            ) from e
        return obj


class Registry:
    """Name -> lazy registration for one kind of part."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, Registration] = {}
        self.filter_note = ""
        """Which plugins ``TOKENMILL_PLUGINS`` left out, for errors about missing parts."""

    def add(self, reg: Registration, *, replace: bool) -> None:
        """Add ``reg``; without ``replace``, a name taken by another target is an error and a
        name taken by the same target keeps its first registration."""
        old = self.entries.get(reg.name)
        if old is not None and not replace:
            if old.target != reg.target:
                raise PluginError(
                    f"{self.kind} name {reg.name!r} registered twice: by plugin {old.plugin!r} "
                    f"({old.distribution}) and by plugin {reg.plugin!r} ({reg.distribution})"
                )
            return
        self.entries[reg.name] = reg

    def get(self, name: str) -> Registration:
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(sorted(self.entries)) or "none"
            raise ValueError(
                f"unknown {_label(self.kind)} {name!r}; registered: {known}{self.filter_suffix()}"
            ) from None

    def load(self, name: str) -> type:
        return self.get(name).load()

    def choose(self, name: str) -> type:
        """Load ``name`` for an engine and log where it comes from: at INFO for a part from a
        third-party plugin or a runtime registration, at DEBUG for a built-in one."""
        reg = self.get(name)
        cls = reg.load()
        if reg.plugin == RUNTIME:
            level, source = logging.INFO, "registered at run time"
        else:
            level = logging.DEBUG if reg.distribution == PROJECT else logging.INFO
            source = f"from plugin {reg.plugin!r} (distribution {reg.distribution!r})"
        logger.log(level, "using %s %r: %s %s", _label(self.kind), name, reg.target, source)
        return cls

    def filter_suffix(self) -> str:
        """``" (<filter_note>)"``, or ``""`` when ``TOKENMILL_PLUGINS`` left nothing out."""
        return f" ({self.filter_note})" if self.filter_note else ""

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries


class PluginManager:
    """Loads entry-point plugins and runs their hooks into one registry per kind.

    A plugin that fails to load or register leaves nothing behind: its error goes to
    ``errors`` and the other plugins load as usual."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(HookSpecs)
        self.registries = {kind: Registry(kind) for kind in KINDS}
        self.plugin_distributions: dict[str, str] = {}
        self.errors: list[PluginError] = []

    def load_entry_points(self) -> None:
        """Load the entry points ``TOKENMILL_PLUGINS`` allows (all when unset); a name in it
        that no installed entry point has is a ``ValueError`` listing the installed ones."""
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        allowed: list[str] | None = envs.TOKENMILL_PLUGINS
        if allowed is not None:
            installed = {ep.name for ep in entry_points}
            unknown = sorted(set(allowed) - installed)
            if unknown:
                raise ValueError(
                    f"TOKENMILL_PLUGINS names unknown plugin(s) {', '.join(map(repr, unknown))}; "
                    f"installed plugins: {', '.join(sorted(installed)) or 'none'}"
                )
            excluded = sorted(installed - set(allowed))
            if excluded:
                note = (
                    f"TOKENMILL_PLUGINS={','.join(allowed)!r} excluded the "
                    f"plugin(s) {', '.join(excluded)}"
                )
                for registry in self.registries.values():
                    registry.filter_note = note
        for ep in entry_points:
            if allowed is not None and ep.name not in allowed:
                continue
            dist = ep.dist.name if ep.dist is not None else "unknown"
            try:
                try:
                    module = ep.load()
                except Exception as e:
                    raise PluginError(
                        f"plugin {ep.name!r} from distribution {dist!r} failed to load "
                        f"({ep.value}): {e}"
                    ) from e
                self.register_plugin(module, ep.name, dist)
            except PluginError as e:
                self.errors.append(e)

    def register_plugin(self, module: object, name: str, distribution: str) -> None:
        """Register a hook-implementing object and run its hooks now; on error, nothing of it
        stays registered."""
        existing = self.pm.get_plugin(name)
        if existing is module:
            return
        if existing is not None:
            raise PluginError(
                f"plugin name {name!r} is used by distribution "
                f"{self.plugin_distributions[name]!r} and by distribution {distribution!r}"
            )
        try:
            try:
                self.pm.register(module, name=name)
                self.pm.check_pending()
            except Exception as e:
                raise PluginError(
                    f"plugin {name!r} from distribution {distribution!r} is not a valid "
                    f"tokenmill plugin: {e} (the hooks are {', '.join(KINDS.values())})"
                ) from e
            for kind, hook_name in KINDS.items():
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin_name == name:
                        self._run_hook(kind, impl, name, distribution)
        except PluginError:
            self.pm.unregister(name=name)
            for registry in self.registries.values():
                registry.entries = {k: r for k, r in registry.entries.items() if r.plugin != name}
            raise
        self.plugin_distributions[name] = distribution

    def _run_hook(self, kind: str, impl: pluggy.HookImpl, plugin: str, dist: str) -> None:
        registry = self.registries[kind]

        def register(part_name: str, target: str) -> None:
            if not isinstance(part_name, str) or ":" not in str(target):
                raise PluginError(
                    f"plugin {plugin!r} from distribution {dist!r} registered "
                    f"{part_name!r} -> {target!r}; expected register(name, 'module:Class')"
                )
            registry.add(Registration(kind, part_name, target, plugin, dist), replace=False)

        try:
            impl.function(register=register)
        except PluginError:
            raise
        except Exception as e:
            raise PluginError(
                f"plugin {plugin!r} from distribution {dist!r} failed in "
                f"{impl.function.__name__}: {e}"
            ) from e


def _label(kind: str) -> str:
    """``"attention_backends"`` -> ``"attention backend"``."""
    return kind[:-1].replace("_", " ")


_lock = threading.Lock()
_manager: PluginManager | None = None
_runtime: list[Registration] = []


def get_plugin_manager(strict: bool = True) -> PluginManager:
    """The process-wide plugin manager, loading entry points on first use.

    ``strict`` raises the first plugin's ``PluginError`` if any plugin failed, so no engine runs
    without an installed plugin; ``strict=False`` returns the healthy parts and the failures in
    ``errors`` (for ``tokenmill plugins``)."""
    global _manager
    with _lock:
        if _manager is None:
            manager = PluginManager()
            manager.load_entry_points()
            for reg in _runtime:
                manager.registries[reg.kind].add(reg, replace=True)
            _manager = manager
        manager = _manager
    if strict and manager.errors:
        raise manager.errors[0].with_traceback(None)
    return manager


def reload_plugins() -> PluginManager:
    """Forget loaded plugins and load them again (runtime registrations are kept)."""
    global _manager
    with _lock:
        _manager = None
    return get_plugin_manager()


def get_registry(kind: str, strict: bool = True) -> Registry:
    """The registry of one kind: platforms, attention_backends, models, proposers,
    quantization_methods, commands, tool_parsers, kv_connectors; ``strict`` as in ``get_plugin_manager``."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of {', '.join(KINDS)}")
    return get_plugin_manager(strict).registries[kind]


def register(kind: str, name: str, target: str | type) -> None:
    """Register a class, or a lazy ``"module:Class"`` path, at run time in this process
    (an engine-core process repeats them, see ``runtime_registrations``; a class must then be
    importable by its path).

    A runtime registration replaces an entry-point one of the same name.
    """
    if isinstance(target, type):
        path = f"{target.__module__}:{target.__qualname__}"
        reg = Registration(kind, name, path, RUNTIME, RUNTIME, target)
    elif isinstance(target, str) and ":" in target:
        reg = Registration(kind, name, target, RUNTIME, RUNTIME)
    else:
        raise ValueError(f"target {target!r} must be 'module:Class' or a class")
    get_registry(kind, strict=False).add(reg, replace=True)
    _runtime.append(reg)


def runtime_registrations() -> list[tuple[str, str, str]]:
    """``(kind, name, "module:Class")`` of each runtime registration, in order."""
    return [(reg.kind, reg.name, reg.target) for reg in _runtime]


def register_platform(name: str, target: str | type) -> None:
    """``register("platforms", name, target)``."""
    register("platforms", name, target)


def register_attention_backend(name: str, target: str | type) -> None:
    """``register("attention_backends", name, target)``."""
    register("attention_backends", name, target)


def register_model(name: str, target: str | type) -> None:
    """``register("models", name, target)``: ``name`` is an HF architecture."""
    register("models", name, target)


def register_proposer(name: str, target: str | type) -> None:
    """``register("proposers", name, target)``."""
    register("proposers", name, target)


def register_quantization_method(name: str, target: str | type) -> None:
    """``register("quantization_methods", name, target)``."""
    register("quantization_methods", name, target)


def register_tool_parser(name: str, target: str | type) -> None:
    """``register("tool_parsers", name, target)``."""
    register("tool_parsers", name, target)


def register_kv_connector(name: str, target: str | type) -> None:
    """``register("kv_connectors", name, target)``."""
    register("kv_connectors", name, target)


class ModelRegistry:
    """Architecture name -> lazily imported model class, filled by ``register_models`` hooks."""

    @staticmethod
    def register_model(arch: str, target: str | type) -> None:
        """vLLM's spelling of :func:`register_model`."""
        register_model(arch, target)

    @staticmethod
    def supported_archs() -> list[str]:
        return get_registry("models").names()

    @staticmethod
    def resolve(architectures: list[str] | None) -> tuple[type, str]:
        """The first registered class among ``architectures`` and its name."""
        registry = get_registry("models")
        for arch in architectures or []:
            if arch in registry:
                return registry.choose(arch), arch
        raise ValueError(
            f"model architectures {architectures} are not supported; "
            f"registered: {', '.join(registry.names()) or 'none'}{registry.filter_suffix()}"
        )
