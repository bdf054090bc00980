"""The front end's log of its engine cores' KV events, which ``GET /kv_events`` publishes: a
router follows it to know which prompt blocks each instance's prefix cache holds."""

from __future__ import annotations

import uuid
from collections import Counter, deque
from typing import Any

from tokenmill.core.block_pool import KVCacheEvent

MAX_EVENTS = 4096
"""Events kept; a reader further behind gets a snapshot of the whole index instead."""


class KVEventLog:
    """Numbered KV events (hashes in hex) and the set of hashes they leave cached."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.log_id = uuid.uuid4().hex
        """Names this log: a reader holding another's sequence numbers (the server restarted)
        gets a snapshot."""
        self.events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=max_events)
        self.seq = 0
        self.cached: Counter[str] = Counter()
        """Hash -> how many engine cores index it (data parallelism runs several)."""

    def extend(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            hashes = [h.hex() for h in event.block_hashes]
            if event.type == "BlockStored":
                self.cached.update(hashes)
            else:
                self.cached.subtract(hashes)
                for h in hashes:
                    if self.cached[h] <= 0:
                        del self.cached[h]
            self.seq += 1
            self.events.append((self.seq, {"type": event.type, "block_hashes": hashes}))

    def since(self, after: int, log_id: str | None) -> dict[str, Any]:
        """The events numbered above ``after``, or (``reset``) the cached hashes as ``blocks``
        when some of those events are no longer kept or ``log_id`` is not this log's."""
        oldest = self.events[0][0] if self.events else self.seq + 1
        head = {"log_id": self.log_id, "seq": self.seq}
        if log_id != self.log_id or after > self.seq or after < oldest - 1:
            return {**head, "reset": True, "blocks": list(self.cached), "events": []}
        return {
            **head,
            "reset": False,
            "events": [event for seq, event in self.events if seq > after],
        }
