"""First-party KV connectors: ``storage`` (KV blocks of prompts saved to a directory keyed by
their block hashes, loaded by any engine that sees the same prefix) and ``offload`` (blocks kept
in a bounded host-memory tier, then a bounded disk tier that survives restarts) and ``p2p``
(a prefill instance's blocks pulled by a decode instance over ZMQ: disaggregated serving).

Connectors implement ``tokenmill.interfaces.KVConnectorBase`` and are registered through the
``register_kv_connectors`` hook of a ``tokenmill.plugins`` entry point.
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_kv_connectors(register):
    register("storage", "tokenmill.kv_connectors.storage:StorageConnector")
    register("offload", "tokenmill.kv_connectors.offload:OffloadConnector")
    register("p2p", "tokenmill.kv_connectors.p2p:P2pConnector")
