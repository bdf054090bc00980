"""tokenmill's import rules: one list of what is public, checked by import-linter (the project's
own layering) and by grimp, its import-graph engine (a third-party plugin's imports, in the
conformance kit).

- Base modules hold values and environment only: at run time they import only each other.
- R1: ``tokenmill.interfaces`` imports only ``interfaces`` and the base modules.
- R2: the core never imports a plugin package (``testing/``, the conformance kit, may).
- R3: a plugin package imports only the public API (:data:`PUBLIC_API`), never another plugin
  package.

Lazy and ``TYPE_CHECKING`` imports count. The plugin packages live in their own folders and
map onto the ``tokenmill`` namespace, which an editable install resolves through a finder rather
than one directory: :func:`namespace_copy` lays the ``.py`` files out as one package tree for
the tools to read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BASE_MODULES = (
    "envs",
    "engine_args",
    "config",
    "speculative_config",
    "kv_transfer_config",
    "sampling_params",
    "forward_context",
    "distributed",
    "kv_cache_dtype",
)
"""Values and environment: every layer may import them."""

PUBLIC_API: dict[str, str] = {
    "interfaces": "what plugins implement: `Platform`, `AttentionBackend`, `DecodeGraphRunner`, `Proposer`, `QuantizationMethod`, ...",
    "plugins": "`hookimpl`, the `register_*` functions, `ModelRegistry`, `PluginError`",
    "layers": "the layers models are built from (attention, linear, embeddings, norms, RoPE, MoE, FP8 KV cache)",
    "ops": "the CPU C kernels and Triton kernels the layers and platforms call",
    "model_loader": "loading a checkpoint into a model (`load_model`, weight iterators, GGUF files)",
    "sample": "the sampler's functions (logits processing, probabilities) a proposer drafts with",
    **{name: "base module: values and environment" for name in BASE_MODULES},
}
"""Top-level modules of ``tokenmill`` a plugin may import, and what each is for. docs/plugins.md
shows this table; a test keeps the two equal."""

PLUGIN_PACKAGES = ("platforms", "attention_backends", "models", "spec_decode", "quant", "kv_connectors")
"""The first-party plugin packages (each its own folder, registered through an entry point)."""

REUSABLE_MODULES = ("models.llama", "models.qwen2", "models.deepseek_v2")
"""Built-in model classes a third-party plugin may register under another name or subclass
(docs/plugins.md, "Reusing a built-in model"); first-party plugin packages may not."""

KIT_EXEMPT = ("testing",)
"""Core modules outside R2: the conformance kit checks the first-party plugins by name."""


def public_api_table() -> str:
    """The Markdown table of :data:`PUBLIC_API` that docs/plugins.md shows."""
    rows = [f"| `tokenmill.{name}` | {use} |" for name, use in PUBLIC_API.items()]
    return "\n".join(["| module | for |", "|---|---|", *rows])


def package_dirs() -> dict[str, Path]:
    """``""`` -> the installed ``tokenmill`` core's folder, and each plugin package -> its own."""
    dirs = {"": Path(importlib.util.find_spec("tokenmill").origin).parent}
    for name in PLUGIN_PACKAGES:
        dirs[name] = Path(importlib.util.find_spec(f"tokenmill.{name}").origin).parent
    return dirs


def namespace_copy(dest: Path) -> Path:
    """Copy the ``.py`` files of ``tokenmill`` and its plugin packages to ``dest/tokenmill/`` as
    one package tree; returns ``dest`` (put it first on ``PYTHONPATH``)."""
    for name, folder in package_dirs().items():
        target = dest / "tokenmill" / name if name else dest / "tokenmill"
        shutil.copytree(folder, target, ignore=_only_python, dirs_exist_ok=True)
    return dest


def _only_python(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())]


def top_level_modules(root: Path) -> list[str]:
    """The top-level modules and packages of the ``tokenmill`` tree under ``root``."""
    package = root / "tokenmill"
    names = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return sorted(names)


def contracts(root: Path) -> str:
    """import-linter's configuration (TOML) of R1, R2 and R3 for the tree under ``root``."""
    modules = top_level_modules(root)
    core = [m for m in modules if m not in PLUGIN_PACKAGES]
    allowed_in_interfaces = {"interfaces", *BASE_MODULES}

    def names(items) -> str:
        return "[" + ", ".join(f'"tokenmill.{m}"' for m in items) + "]"

    return "\n".join(
        [
            "[tool.importlinter]",
            'root_packages = ["tokenmill"]',
            "",
            "[[tool.importlinter.contracts]]",
            'name = "R1: tokenmill.interfaces imports only interfaces and the base modules"',
            'type = "forbidden"',
            "allow_indirect_imports = true",
            'source_modules = ["tokenmill.interfaces"]',
            f"forbidden_modules = {names(m for m in modules if m not in allowed_in_interfaces)}",
            "",
            "[[tool.importlinter.contracts]]",
            'name = "R2: the core never imports a plugin package"',
            'type = "forbidden"',
            "allow_indirect_imports = true",
            f"source_modules = {names(m for m in core if m not in KIT_EXEMPT)}",
            f"forbidden_modules = {names(PLUGIN_PACKAGES)}",
            "",
            "[[tool.importlinter.contracts]]",
            'name = "R3: plugin packages import only the public API"',
            'type = "forbidden"',
            "allow_indirect_imports = true",
            f"source_modules = {names(PLUGIN_PACKAGES)}",
            f"forbidden_modules = {names(m for m in core if m not in PUBLIC_API)}",
            "",
            "[[tool.importlinter.contracts]]",
            'name = "R3: no plugin package imports another"',
            'type = "independence"',
            f"modules = {names(PLUGIN_PACKAGES)}",
            "",
        ]
    )


def base_contract(root: Path) -> str:
    """import-linter's configuration (TOML) of the base modules' rule: at run time they import
    only each other (``TYPE_CHECKING`` imports, for annotations, are left out here)."""
    modules = top_level_modules(root)
    others = ", ".join(f'"tokenmill.{m}"' for m in modules if m not in BASE_MODULES)
    sources = ", ".join(f'"tokenmill.{m}"' for m in BASE_MODULES)
    return "\n".join(
        [
            "[tool.importlinter]",
            'root_packages = ["tokenmill"]',
            "exclude_type_checking_imports = true",
            "",
            "[[tool.importlinter.contracts]]",
            'name = "Base modules import only base modules at run time"',
            'type = "forbidden"',
            "allow_indirect_imports = true",
            f"source_modules = [{sources}]",
            f"forbidden_modules = [{others}]",
            "",
        ]
    )


def _run(root: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c code args`` in ``root`` with the tree under ``root`` first on the path."""
    env = {"PYTHONPATH": os.pathsep.join([str(root), *sys.path[1:]]), "PATH": os.environ.get("PATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=root, env=env, capture_output=True, text=True
    )


def lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess:
    """Run import-linter over the tree under ``root`` with ``config``."""
    code = "import sys; from importlinter.cli import lint_imports_command as c; sys.argv[0] = 'lint-imports'; c()"
    return _run(root, code, str(config), "--no-cache")


_VIOLATIONS = """
import json, sys
import grimp
package, allowed = sys.argv[1], json.loads(sys.argv[2])
roots = ["tokenmill"] + ([] if package.startswith("tokenmill.") else [package.split(".")[0]])
graph = grimp.build_graph(*roots, cache_dir=None)
found = []
for importer in sorted(graph.find_descendants(package) | {package}):
    for imported in sorted(graph.find_modules_directly_imported_by(importer)):
        if imported.split(".")[0] != "tokenmill" or imported == "tokenmill":
            continue
        if any(imported == a or imported.startswith(a + ".") for a in allowed):
            continue
        details = graph.get_import_details(importer=importer, imported=imported)
        lines = ", ".join(str(d["line_number"]) for d in details)
        found.append(f"{importer} -> {imported} (line {lines})")
print(json.dumps(found))
"""


_CYCLES = """
import json, sys
import grimp
graph = grimp.build_graph("tokenmill", cache_dir=None, exclude_type_checking_imports=True)
modules = sorted(graph.modules)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
index, low, on_stack, stack, cycles = {}, {}, set(), [], []
for root in modules:
    if root in index:
        continue
    work = [(root, 0)]
    while work:
        node, i = work.pop()
        if i == 0:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
        if i < len(edges[node]):
            work.append((node, i + 1))
            nxt = edges[node][i]
            if nxt not in index:
                work.append((nxt, 0))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
            continue
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[node])
print(json.dumps(sorted(cycles)))
"""


def import_cycles(root: Path) -> list[list[str]]:
    """The import circles of the tree under ``root``: each set of modules that import one
    another at run time (strongly connected, ``TYPE_CHECKING`` imports left out), from grimp's
    graph."""
    result = _run(root, _CYCLES)
    if result.returncode != 0:
        raise RuntimeError(f"grimp could not build the import graph: {result.stderr.strip()}")
    return json.loads(result.stdout)


def public_api_violations(package: str, root: Path) -> list[str]:
    """Imports by the modules of ``package`` (a third-party package found on ``sys.path``, or
    ``tokenmill.<plugin package>``) of tokenmill modules outside the public API, each as
    ``"importer -> imported (line N)"``, found by grimp over :func:`namespace_copy` at
    ``root``."""
    allowed = [f"tokenmill.{m}" for m in PUBLIC_API]
    if package.startswith("tokenmill."):
        allowed.append(package)
    else:
        allowed += [f"tokenmill.{m}" for m in REUSABLE_MODULES]
    result = _run(root, _VIOLATIONS, package, json.dumps(allowed))
    if result.returncode != 0:
        raise RuntimeError(f"grimp could not read {package!r}: {result.stderr.strip()}")
    return json.loads(result.stdout)
