"""The router's view of its instances: which are up, how many requests each is serving, and
which prompt blocks each decode instance holds (from the instance's published KV events)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Literal

import httpx

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


@dataclass
class Instance:
    """One ``tokenmill serve`` (or vLLM) instance behind the router."""

    url: str
    role: Role
    up: bool = False
    reason: str = "not checked yet"
    """Why the instance is down (the last health check's or request's failure)."""
    in_flight: int = 0
    blocks: set[str] = field(default_factory=set)
    """Hex hashes of the KV blocks the instance's prefix cache holds."""
    kv_seq: int = 0
    """The last KV event applied to ``blocks``."""
    kv_log_id: str | None = None
    """The instance's event log that ``kv_seq`` counts in."""
    kv_events: bool = True
    """False once the instance answered 404 to ``/kv_events`` (a server that publishes none)."""

    def mark_down(self, reason: str) -> None:
        if self.up:
            logger.warning("%s instance %s is down: %s", self.role, self.url, reason)
        self.up = False
        self.reason = reason

    def apply_kv_events(self, answer: dict) -> None:
        """Apply one ``GET /kv_events`` answer: a snapshot (``reset``) or the events since
        ``kv_seq``."""
        if answer.get("reset"):
            self.blocks = set(answer["blocks"])
        for event in answer.get("events", ()):
            if event["type"] == "BlockStored":
                self.blocks.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                self.blocks.difference_update(event["block_hashes"])
            elif event["type"] == "AllBlocksCleared":
                self.blocks.clear()
        self.kv_seq = answer["seq"]
        self.kv_log_id = answer["log_id"]

    def prefix_hits(self, block_hashes: list[str]) -> int:
        """How many of the prompt's leading blocks the instance holds."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self.blocks:
                break
            hits += 1
        return hits


class NoInstanceError(Exception):
    """No instance of a role is up."""


class InstancePool:
    """The prefill and decode instances, kept current by ``watch``."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.instances = [Instance(url.rstrip("/"), "prefill") for url in prefill] + [
            Instance(url.rstrip("/"), "decode") for url in decode
        ]

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def pick(self, role: Role, block_hashes: list[str] = ()) -> Instance:
        """The up instance of ``role`` holding the longest prefix of ``block_hashes`` (prefix
        affinity), the least loaded among equals; ``NoInstanceError`` naming each instance's
        reason when none is up."""
        candidates = [i for i in self.of_role(role) if i.up]
        if not candidates:
            reasons = "; ".join(f"{i.url}: {i.reason}" for i in self.of_role(role))
            raise NoInstanceError(f"no {role} instance is up ({reasons})")
        return max(candidates, key=lambda i: (i.prefix_hits(block_hashes), -i.in_flight))

    def all_up(self) -> str | None:
        """None when each role has an instance up; else why not."""
        for role in ("prefill", "decode"):
            try:
                self.pick(role)
            except NoInstanceError as e:
                return str(e)
        return None

    async def check(self, client: httpx.AsyncClient, instance: Instance) -> None:
        """Health-check one instance and, for a decode instance, fetch its new KV events."""
        try:
            answer = await client.get(instance.url + "/health")
            if answer.status_code != 200:
                instance.mark_down(f"/health answered {answer.status_code}")
                return
            if instance.role == "decode" and instance.kv_events:
                await self._fetch_kv_events(client, instance)
        except httpx.HTTPError as e:
            instance.mark_down(f"{type(e).__name__}: {e}")
            return
        if not instance.up:
            logger.info("%s instance %s is up", instance.role, instance.url)
        instance.up = True
        instance.reason = ""

    async def _fetch_kv_events(self, client: httpx.AsyncClient, instance: Instance) -> None:
        answer = await client.get(
            instance.url + "/kv_events",
            params={"after": instance.kv_seq, "log_id": instance.kv_log_id or ""},
        )
        if answer.status_code == 404:
            instance.kv_events = False
            logger.info("%s publishes no KV events: no prefix affinity to it", instance.url)
            return
        answer.raise_for_status()
        instance.apply_kv_events(answer.json())

    async def watch(self, client: httpx.AsyncClient, interval: float) -> None:
        """Check every instance every ``interval`` seconds, forever."""
        while True:
            await asyncio.gather(*(self.check(client, i) for i in self.instances))
            await asyncio.sleep(interval)
