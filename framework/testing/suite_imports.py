"""The contract point of a plugin's package as a whole: it imports only tokenmill's public API
(``tokenmill.testing.layering``), lazy and ``TYPE_CHECKING`` imports included."""

from __future__ import annotations

from tokenmill.testing import layering


def test_imports_only_the_public_api(tokenmill_plugin_package: str, tmp_path) -> None:
    """imports only tokenmill's public API"""
    violations = layering.public_api_violations(tokenmill_plugin_package, layering.namespace_copy(tmp_path))
    assert not violations, (
        f"{tokenmill_plugin_package} imports tokenmill modules outside the public API "
        f"(docs/plugins.md, 'Public API'):\n  " + "\n  ".join(violations)
    )
