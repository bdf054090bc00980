"""Prefix-cache block hashes: each full block's hash chains its parent's hash, its tokens and
any extra keys (cache salt, later LoRA or multimodal inputs), so equal hashes mean equal
prefixes.

Two algorithms (``EngineConfig.prefix_caching_hash_algo``):

* ``"sha256"`` (the default): SHA-256 over an unambiguous byte encoding. Crafting two prefixes
  with one hash is infeasible, so a shared server never hands one client's KV blocks to another
  (the class of bug of vLLM's CVE-2025-25183), and digests are the same in every process.
* ``"builtin"``: Python's ``hash()`` of a tuple. Faster, but collisions are easy to construct
  and it varies between processes; only for a single trusted client.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenmill.engine_args import HASH_ALGOS, PrefixCachingHashAlgo

if TYPE_CHECKING:
    from tokenmill.core.request import Request

BlockHash = bytes
ExtraKeys = tuple[tuple[str, str], ...]
"""``(kind, value)`` pairs a block's reuse also depends on, e.g. ``(("cache_salt", "a"),)``."""
HashFunction = Callable[[BlockHash | None, Sequence[int], ExtraKeys | None], BlockHash]

NONE_HASH: BlockHash = hashlib.sha256(b"tokenmill-root").digest()
"""The parent of every request's first block."""

_U32 = struct.Struct("<I")


def _encode_extra_keys(extra_keys: ExtraKeys | None) -> bytes:
    if not extra_keys:
        return b""
    parts: list[bytes] = []
    for kind, value in extra_keys:
        for text in (kind, value):
            data = text.encode()
            parts += (_U32.pack(len(data)), data)
    return b"".join(parts)


def sha256_block_hash(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """SHA-256 of parent digest, token count, tokens (little-endian uint32) and extra keys,
    each part fixed-width or length-prefixed."""
    n = len(token_ids)
    data = b"".join(
        (
            NONE_HASH if parent_hash is None else parent_hash,
            _U32.pack(n),
            struct.pack(f"<{n}I", *token_ids),
            _encode_extra_keys(extra_keys),
        )
    )
    return hashlib.sha256(data).digest()


def builtin_block_hash(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """Python's ``hash()`` of the same parts, as 8 bytes: fast, but not collision-resistant."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    return hash((parent, tuple(token_ids), extra_keys)).to_bytes(8, "little", signed=True)


_HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256_block_hash,
    "builtin": builtin_block_hash,
}


def get_hash_function(algo: PrefixCachingHashAlgo) -> HashFunction:
    """The block-hash function of ``algo``; raises ``ValueError`` for an unknown name."""
    if algo not in _HASH_FUNCTIONS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
    return _HASH_FUNCTIONS[algo]


def request_extra_keys(request: Request, block_index: int) -> ExtraKeys | None:
    """Keys besides the tokens that must match for a block to be shared: the cache salt and
    the LoRA adapter (its id and name). They go into the first block only: every later hash
    chains it."""
    if block_index != 0:
        return None
    keys: list[tuple[str, str]] = []
    if request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    if request.lora_request is not None:
        keys.append(("lora", f"{request.lora_request.lora_int_id}:{request.lora_request.lora_name}"))
    return tuple(keys) or None


def make_block_hasher(block_size: int, algo: PrefixCachingHashAlgo = "sha256") -> Callable[[Request], None]:
    """A callback that appends hashes for a request's newly filled blocks."""
    hash_fn = get_hash_function(algo)

    def update(request: Request) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * block_size <= len(tokens):
            i = len(hashes)
            block = tokens[i * block_size : (i + 1) * block_size]
            parent = hashes[-1] if hashes else None
            hashes.append(hash_fn(parent, block, request_extra_keys(request, i)))

    return update
