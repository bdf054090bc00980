"""KV connectors each breaking one contract point of the conformance kit's connector suite."""

from __future__ import annotations

from tokenmill.kv_connectors.offload import OffloadConnector


class LoadsIntoNeighbour(OffloadConnector):
    """Loads each block into the block after the one the scheduler gave it."""

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        meta.loads = [(block_id + 1, block_hash, tier) for block_id, block_hash, tier in meta.loads]
        super().start_load_kv()


class LoadsWhenAsked(OffloadConnector):
    """Queues the load of whatever it matches: matching is no longer free of side effects."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        num_tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if num_tokens:
            self.pending_loads.append((15, request.block_hashes[0], "host"))
        return num_tokens, load_async


class NeverSends(OffloadConnector):
    """Delays freeing a finished request's blocks and never reports them sent."""

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return True, None
