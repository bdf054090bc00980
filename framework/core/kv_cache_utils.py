"""Prefix-cache block hashes: each full block's hash chains its parent's hash, its tokens and
any extra keys (cache salt, later LoRA), so equal hashes mean equal prefixes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.core.request import Request

NONE_HASH = hash("tokenmill-root")


def hash_block_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple | None = None
) -> int:
    """Hash of one full block; hashes are only compared within the scheduler process."""
    return hash((NONE_HASH if parent_hash is None else parent_hash, token_ids, extra_keys))


def request_extra_keys(request: Request, block_index: int) -> tuple | None:
    """Keys besides the tokens that must match for a block to be shared."""
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


def make_block_hasher(block_size: int) -> Callable[[Request], None]:
    """A callback that appends hashes for a request's newly filled blocks."""

    def update(request: Request) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * block_size <= len(tokens):
            i = len(hashes)
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, block, request_extra_keys(request, i)))

    return update
