"""The KV connector interface: moving KV blocks between an engine's paged cache and somewhere
else (a directory, a host-memory or disk tier, another engine), with vLLM V1's names and split.

One connector class runs as two instances: the **scheduler** side (role
``KVConnectorRole.SCHEDULER``, in the engine core) decides what to load and save, and the
**worker** side (``KVConnectorRole.WORKER``, one per worker rank) moves the bytes. They talk
only through the :class:`KVConnectorMetadata` the scheduler side builds each step (it rides on
the scheduler output to the workers) and the :class:`KVConnectorOutput` the workers report
back (which requests finished sending or receiving).

A step, in order:

1. scheduler: for a waiting request, :meth:`KVConnectorBase.get_num_new_matched_tokens` says
   how many tokens past the local prefix-cache hits the connector can supply, and whether it
   loads them asynchronously; after allocating blocks the scheduler calls
   :meth:`KVConnectorBase.update_state_after_alloc`; at the end of scheduling
   :meth:`KVConnectorBase.build_connector_meta`.
2. worker: :meth:`KVConnectorBase.bind_connector_metadata`, :meth:`KVConnectorBase.start_load_kv`,
   then for each attention layer :meth:`KVConnectorBase.wait_for_layer_load` before it runs and
   :meth:`KVConnectorBase.save_kv_layer` after it wrote its cache, then
   :meth:`KVConnectorBase.wait_for_save`, :meth:`KVConnectorBase.get_finished` and
   :meth:`KVConnectorBase.clear_connector_metadata`.
3. scheduler: requests in ``finished_recving`` become schedulable (their external tokens
   count as computed); blocks of finished requests whose freeing the connector delayed
   (:meth:`KVConnectorBase.request_finished`) are freed when they appear in
   ``finished_sending``.

A synchronous load (``load_async`` False) is complete when ``start_load_kv`` and the
``wait_for_layer_load`` calls return: the step's forward pass reads the loaded blocks. An
asynchronous one may finish steps later; the request waits (``WAITING_FOR_REMOTE_KVS``) without
holding up the other requests.

Connectors register through the ``register_kv_connectors`` hook (``register("name",
"pkg.mod:Class")``) and are chosen with ``kv_transfer_config={"kv_connector": "name", ...}``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.interfaces.kv_cache_spec import KVCacheSpec

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig


class KVLoadError(Exception):
    """Raised by ``get_num_new_matched_tokens`` when the request must fail rather than compute
    its prompt locally (a connector's "fail" policy for KV it could not load): the scheduler
    finishes that request with ``finish_reason="error"`` and the message, and schedules the
    others as usual."""


class KVConnectorRole(enum.Enum):
    """Which side of the connector an instance is."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorRequest(Protocol):
    """What the scheduler side sees of a request (the engine core's requests have these)."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    """The prompt and the output tokens so far."""
    block_hashes: list[bytes]
    """The prefix-cache hash of each full block of ``all_token_ids``: a chain over the tokens
    and the request's ``cache_salt`` and LoRA adapter, so equal hashes mean equal prefixes of
    the same tenant (SHA-256 unless ``prefix_caching_hash_algo='builtin'``)."""
    cache_salt: str | None
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None
    """What the client sent for this request's transfer (vLLM's ``kv_transfer_params``)."""

    @property
    def num_tokens(self) -> int: ...


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side in one step; each connector subclasses
    it with its own fields. It must pickle (it crosses to worker processes)."""


@dataclass
class KVConnectorOutput:
    """What the workers report after a step: requests whose KV finished sending (their blocks
    may be freed) or receiving (they may run)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving


class KVConnectorBase(ABC):
    """A KV connector (vLLM's ``KVConnectorBase_V1``). The engine builds it once the KV cache
    is sized, as ``cls(config, role, rank, kv_cache_specs)``: ``config`` is the engine's
    (``config.kv_transfer`` is the :class:`~tokenmill.kv_transfer_config.KVTransferConfig`),
    ``rank`` the worker's tensor-parallel rank (0 on the scheduler side), ``kv_cache_specs``
    the model's attention layers' specs by name (both sides get them). A setting the
    connector cannot honour raises ``ValueError`` naming it."""

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        rank: int = 0,
        kv_cache_specs: dict[str, KVCacheSpec] | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.rank = rank
        self.kv_cache_specs = kv_cache_specs or {}
        assert config.kv_transfer is not None
        self.kv_transfer_config = config.kv_transfer
        self._connector_metadata: KVConnectorMetadata | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all attention layers (from ``kv_cache_specs``)."""
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    # ----- worker side -----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The worker's paged caches, by attention layer name, in forward order. Each tensor is
        a view of the layer's cache whose first dimension is the block: ``kv_caches[name][b]``
        is block ``b`` of that layer whatever the attention backend's layout, and writing
        into it writes the cache."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata after the forward pass."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """This step's metadata (only between bind and clear)."""
        assert self._connector_metadata is not None, "no connector metadata bound for this step"
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start loading this step's blocks into the paged caches (before the forward)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s synchronous loads of this step are in its cache."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving layer ``layer_name``'s blocks of this step; ``kv_layer`` is its cache
        (the view ``register_kv_caches`` gave), ``attn_metadata`` the layer's metadata."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the paged cache (it may be
        overwritten in the next step)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(done_sending, done_recving)``: requests whose asynchronous send finished (their
        blocks may be freed) and whose asynchronous load finished, since the last call.
        ``finished_req_ids`` are the requests the scheduler finished in this step. A
        synchronous connector returns ``(None, None)``."""
        return None, None

    # ----- scheduler side -----

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: KVConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """``(tokens, load_async)``: how many tokens after the first ``num_computed_tokens``
        (the local prefix-cache hits, a multiple of the block size) the connector can load,
        leaving at least the prompt's last token to compute, and whether the load is
        asynchronous. The tokens may end inside a block (the prompt's partial last block, as
        a decode instance loads it): that block is loaded whole and its slots past the loaded
        tokens are overwritten as they are computed. Free of side effects: the scheduler may ask again in later
        steps, or never use the answer."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: KVConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The scheduler admitted ``request`` with blocks ``block_ids`` (all of its blocks, in
        order); ``request.num_computed_tokens`` is its local hit count and the
        ``num_external_tokens`` the connector offered follow it (0: none to load). A request
        preempted and admitted again comes again, with its new blocks."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's metadata for the workers, from the scheduler output (its
        ``scheduled_new_reqs``, ``scheduled_cached_reqs`` and ``num_scheduled_tokens``); called
        once per step after scheduling, with every request's ``num_computed_tokens`` already
        counting the step's tokens. Resets the per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the workers reported after a step (for a connector that tracks it)."""
        return None

    def get_stats(self) -> dict[str, int]:
        """The scheduler side's own counters, merged into the engine's ``get_stats()`` (e.g.
        ``kv_transfer_recomputed``: loads that failed, their prompts computed locally)."""
        return {}

    def request_finished(
        self, request: KVConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished, holding ``block_ids``: ``(delay_free, kv_transfer_params)``.
        With ``delay_free`` the scheduler keeps the blocks until a worker reports the request
        in ``done_sending``; ``kv_transfer_params`` go back to the client with the request's
        last output."""
        return False, None


KVConnectorBase_V1 = KVConnectorBase
"""vLLM's name of the base class."""
