"""The conformance kit's pytest plugin (entry point ``pytest11``: active wherever tokenmill is
installed, inert unless one of its options is given).

``pytest --tokenmill-plugin NAME`` checks every platform, attention backend, model,
speculative-decoding proposer, quantization method and KV connector that the
``tokenmill.plugins`` entry point ``NAME`` registers; ``--tokenmill-backend``,
``--tokenmill-platform``, ``--tokenmill-model``, ``--tokenmill-proposer``,
``--tokenmill-quantization`` and ``--tokenmill-kv-connector`` pick single parts (each may repeat). The
suites are the ``suite_*`` modules next to this one, one test per contract point (an attention
backend whose ``is_mla()`` is true gets ``suite_mla_backend``); without explicit test paths
only they run. A summary lists each part's contract points."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import pytest

SUITES = {
    "attention_backends": ("tokenmill.testing.suite_backend", "tokenmill_backend", "--tokenmill-backend"),
    "platforms": ("tokenmill.testing.suite_platform", "tokenmill_platform", "--tokenmill-platform"),
    "models": ("tokenmill.testing.suite_model", "tokenmill_model", "--tokenmill-model"),
    "proposers": ("tokenmill.testing.suite_proposer", "tokenmill_proposer", "--tokenmill-proposer"),
    "quantization_methods": ("tokenmill.testing.suite_quant", "tokenmill_quantization", "--tokenmill-quantization"),
    "kv_connectors": ("tokenmill.testing.suite_kv_connector", "tokenmill_kv_connector", "--tokenmill-kv-connector"),
}
"""kind -> (suite module, the fixture naming the part under test, the option picking one)."""

IMPORTS_SUITE = "tokenmill.testing.suite_imports"
"""The suite of each ``--tokenmill-plugin NAME``'s package (its fixture:
``tokenmill_plugin_package``)."""

MLA_BACKEND_SUITE = "tokenmill.testing.suite_mla_backend"
"""The suite of attention backends whose ``is_mla()`` is true, instead of ``suite_backend``."""

LABELS = {
    "attention_backends": "attention backend",
    "platforms": "platform",
    "models": "model",
    "proposers": "proposer",
    "quantization_methods": "quantization method",
    "kv_connectors": "KV connector",
    "plugin": "plugin",
}


class KitHooks:
    """Hooks a plugin author implements in a ``conftest.py`` (or a pytest plugin)."""

    @pytest.hookspec(firstresult=True)
    def pytest_tokenmill_tiny_checkpoint(self, arch: str, path: Path) -> Path | None:
        """Save a tiny random checkpoint of architecture ``arch`` (``config.json`` and
        safetensors) under ``path`` and return the directory; None leaves it to the kit, which
        builds one with transformers when transformers knows ``arch``."""

    @pytest.hookspec(firstresult=True)
    def pytest_tokenmill_proposer_target(self, method: str, path: Path) -> Path | None:
        """Save the tiny target checkpoint (vocabulary of 256) to check proposer ``method``
        on under ``path`` and return it, for a proposer that needs a particular target (``mtp``
        a DeepSeek-V3 with MTP layers); None leaves it to the kit: a tiny Llama."""

    @pytest.hookspec(firstresult=True)
    def pytest_tokenmill_speculative_config(self, method: str, model_path: Path, prompts: list[list[int]]) -> dict | None:
        """The ``speculative_config`` to check proposer ``method`` with, on the tiny target at
        ``model_path`` and these prompts (token ids); None leaves it to the kit:
        ``{"method": method}`` (with the target as its own draft for ``draft_model``)."""

    @pytest.hookspec(firstresult=True)
    def pytest_tokenmill_kv_transfer_config(self, name: str, path: Path) -> dict | None:
        """The ``kv_transfer_config`` to check KV connector ``name`` with (``path``: an empty
        directory it may use); None leaves it to the kit: ``{"kv_connector": name}``."""


@dataclass
class Outcome:
    kind: str
    part: str
    point: str
    status: str = "PASS"


_OUTCOMES = pytest.StashKey[dict[str, Outcome]]()


def pytest_addhooks(pluginmanager) -> None:
    pluginmanager.add_hookspecs(KitHooks)


def pytest_addoption(parser) -> None:
    group = parser.getgroup("tokenmill", "tokenmill plugin conformance kit")
    group.addoption(
        "--tokenmill-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="check every part the tokenmill.plugins entry point NAME registers",
    )
    for kind, (_, _, option) in SUITES.items():
        group.addoption(
            option, action="append", default=[], metavar="NAME", help=f"check the {LABELS[kind]} NAME"
        )


def selected_parts(config) -> dict[str, list[str]]:
    """kind -> names of the parts to check, from the kit's options."""
    plugin_names = config.getoption("--tokenmill-plugin")
    from tokenmill import plugins

    parts = {kind: list(config.getoption(option)) for kind, (_, _, option) in SUITES.items()}
    for kind, names in parts.items():
        registry = plugins.get_registry(kind)
        unknown = [name for name in names if name not in registry]
        if unknown:
            raise pytest.UsageError(
                f"{SUITES[kind][2]}: no registered {LABELS[kind]} named {', '.join(unknown)}; "
                f"registered: {', '.join(registry.names())}"
            )
    if plugin_names:
        installed = plugins.get_plugin_manager().plugin_distributions
        unknown = sorted(set(plugin_names) - set(installed))
        if unknown:
            raise pytest.UsageError(
                f"--tokenmill-plugin: no installed tokenmill plugin named {', '.join(unknown)}; "
                f"installed: {', '.join(sorted(installed))}"
            )
        for kind in SUITES:
            for reg in plugins.get_registry(kind).entries.values():
                if reg.plugin in plugin_names and reg.name not in parts[kind]:
                    parts[kind].append(reg.name)
    return {kind: names for kind, names in parts.items() if names}


def plugin_packages(config) -> dict[str, str]:
    """``--tokenmill-plugin`` name -> the package its entry point lives in: a third party's
    top-level package, or ``tokenmill.<plugin package>``; plugins that are part of tokenmill's
    core (its commands, its tool parsers) have none."""
    from tokenmill import plugins
    from tokenmill.testing.layering import PLUGIN_PACKAGES

    packages = {}
    for ep in importlib.metadata.entry_points(group=plugins.ENTRY_POINT_GROUP):
        if ep.name not in config.getoption("--tokenmill-plugin"):
            continue
        parts = ep.module.split(".")
        if parts[0] != plugins.PROJECT:
            packages[ep.name] = parts[0]
        elif len(parts) > 1 and parts[1] in PLUGIN_PACKAGES:
            packages[ep.name] = ".".join(parts[:2])
    return packages


def suite_of(kind: str, name: str) -> str:
    """The suite module that checks part ``name`` of ``kind``."""
    if kind != "attention_backends":
        return SUITES[kind][0]
    from tokenmill import plugins

    try:
        backend = plugins.get_registry(kind).load(name)
    except plugins.PluginError as e:
        raise pytest.UsageError(str(e)) from e
    return MLA_BACKEND_SUITE if backend.is_mla() else SUITES[kind][0]


def _active(config) -> bool:
    return bool(config.getoption("--tokenmill-plugin")) or any(
        config.getoption(option) for _, _, option in SUITES.values()
    )


def pytest_configure(config) -> None:
    if _active(config) and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = []  # only the kit runs, not the project's own test paths


def pytest_generate_tests(metafunc) -> None:
    if "tokenmill_plugin_package" in metafunc.fixturenames:
        packages = plugin_packages(metafunc.config)
        metafunc.parametrize("tokenmill_plugin_package", list(packages.values()), ids=list(packages), scope="module")
    for kind, (_, fixture, _) in SUITES.items():
        if fixture in metafunc.fixturenames:
            names = [
                name
                for name in selected_parts(metafunc.config).get(kind, [])
                if suite_of(kind, name) == metafunc.module.__name__
            ]
            metafunc.parametrize(fixture, names, ids=names, scope="module")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Add the suites of the selected kinds of part (before ``-k``/``-m`` deselect)."""
    if not _active(config):
        return
    outcomes = config.stash.setdefault(_OUTCOMES, {})
    if plugin_packages(config):
        suite = importlib.import_module(IMPORTS_SUITE)
        module = pytest.Module.from_parent(session, path=Path(suite.__file__))
        module.obj = suite
        for item in module.collect():
            point = (item.function.__doc__ or item.name).strip().splitlines()[0]
            outcomes[item.nodeid] = Outcome("plugin", item.callspec.id, point)
            items.append(item)
    for kind, names in selected_parts(config).items():
        for suite_name in dict.fromkeys(suite_of(kind, name) for name in names):
            suite = importlib.import_module(suite_name)
            module = pytest.Module.from_parent(session, path=Path(suite.__file__))
            module.obj = suite
            for item in module.collect():
                part = item.callspec.params[SUITES[kind][1]]
                point = (item.function.__doc__ or item.name).strip().splitlines()[0]
                variant = item.callspec.id.replace(part, "", 1).strip("-")
                if variant:
                    point += f" [{variant}]"
                outcomes[item.nodeid] = Outcome(kind, part, point)
                items.append(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    outcome = item.config.stash.get(_OUTCOMES, {}).get(item.nodeid)
    if outcome is not None:
        if report.failed:
            outcome.status = "FAIL"
        elif report.skipped and outcome.status == "PASS":
            outcome.status = "SKIP"
    return report


def pytest_terminal_summary(terminalreporter, config) -> None:
    outcomes = config.stash.get(_OUTCOMES, {})
    if not outcomes:
        return
    terminalreporter.section("tokenmill conformance")
    by_part: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes.values():
        by_part.setdefault((outcome.kind, outcome.part), []).append(outcome)
    for (kind, part), points in by_part.items():
        passed = sum(o.status == "PASS" for o in points)
        terminalreporter.write_line(
            f"{LABELS[kind]} {part!r}: {passed} of {len(points)} contract points passed"
        )
        for o in points:
            terminalreporter.write_line(f"  {o.status}  {o.point}")
