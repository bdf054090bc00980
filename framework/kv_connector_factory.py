"""Building the engine's KV connector (``kv_transfer_config``) from the registry by name."""

from __future__ import annotations

from tokenmill import plugins
from tokenmill.config import EngineConfig
from tokenmill.interfaces.kv_cache_spec import KVCacheSpec
from tokenmill.interfaces.kv_connector import KVConnectorBase, KVConnectorRole


def create_kv_connector(
    config: EngineConfig,
    role: KVConnectorRole,
    rank: int,
    kv_cache_specs: dict[str, KVCacheSpec],
) -> KVConnectorBase | None:
    """The connector ``config.kv_transfer`` names, as ``role``; None without one. An unknown
    name is a ``ValueError`` listing the registered connectors."""
    if config.kv_transfer is None:
        return None
    cls = plugins.get_registry("kv_connectors").choose(config.kv_transfer.kv_connector)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise TypeError(
            f"KV connector {config.kv_transfer.kv_connector!r} ({cls!r}) is not a "
            f"KVConnectorBase subclass"
        )
    return cls(config, role, rank, kv_cache_specs)
