"""``kv_transfer_config``: which KV connector an engine runs and in which role, with vLLM's
keys, checked, with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = get_args(KVRole)


@dataclass(frozen=True)
class KVTransferConfig:
    """KV transfer settings (vLLM's ``KVTransferConfig``).

    Attributes:
        kv_connector: the registered KV connector (``storage``, ``offload`` or a plugin's;
            ``tokenmill plugins`` lists them).
        kv_role: ``kv_producer`` (computes KV for others and saves it), ``kv_consumer`` (loads
            KV others computed) or ``kv_both``.
        kv_connector_extra_config: the connector's own settings, which it reads and checks
            itself (an unknown key is the connector's error).
    """

    kv_connector: str
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(
                f"kv_transfer_config['kv_connector'] must name a KV connector, got "
                f"{self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config['kv_role'] must be one of {', '.join(KV_ROLES)}, got "
                f"{self.kv_role!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                f"kv_transfer_config['kv_connector_extra_config'] must be a JSON object, got "
                f"{self.kv_connector_extra_config!r}"
            )

    @property
    def is_kv_producer(self) -> bool:
        """Whether this engine saves or sends the KV it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this engine loads KV computed elsewhere."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        """Check ``raw`` (``kv_transfer_config`` as ``LLM(...)`` or the CLI's JSON gives it)."""
        if not isinstance(raw, dict):
            raise ValueError(
                f"kv_transfer_config must be a dict or a KVTransferConfig, got {type(raw).__name__}"
            )
        known = {"kv_connector", "kv_role", "kv_connector_extra_config"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "kv_connector" not in raw:
            raise ValueError("kv_transfer_config needs 'kv_connector' (the connector's name)")
        return cls(**raw)

    def extra(self, key: str, default: Any = None) -> Any:
        """``kv_connector_extra_config[key]``, or ``default``."""
        return self.kv_connector_extra_config.get(key, default)
