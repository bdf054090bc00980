"""One KV block of every attention layer as bytes, checked before use.

Layout: ``MAGIC``, the header's length (uint32), the header (JSON: the block hash, each
layer's name, dtype and shape, the payload's length and SHA-256), the header's SHA-256, then
the payload (each layer's block, in header order, as raw bytes). A file is used only if its
size, its header digest, its block hash and its payload digest all check out: a corrupt or
truncated file is a miss, never wrong tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

MAGIC = b"TMKVBLK1"
_LEN = struct.Struct("<I")
_DIGEST = 32
SUFFIX = ".kvblock"


class BlockFileError(ValueError):
    """The bytes are not a valid block of the expected hash."""


def namespace(config: EngineConfig) -> str:
    """A directory name for blocks of this model, cache dtype, block size and hash algorithm:
    engines share blocks only when all of them match."""
    key = json.dumps(
        [
            os.path.realpath(config.weights_path or config.model_path),
            str(config.kv_cache_torch_dtype),
            config.kv_cache_dtype,
            config.block_size,
            config.prefix_caching_hash_algo,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def encode(block_hash: bytes, layers: dict[str, torch.Tensor]) -> bytes:
    """The bytes of one block: ``layers`` maps each layer's name to its block (any device)."""
    chunks = [t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in layers.values()]
    payload = b"".join(chunks)
    header = json.dumps(
        {
            "block_hash": block_hash.hex(),
            "layers": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in layers.items()],
            "payload_bytes": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    return b"".join((MAGIC, _LEN.pack(len(header)), header, hashlib.sha256(header).digest(), payload))


@dataclass
class Block:
    """A decoded block: each layer's ``(name, dtype, shape)`` and the raw payload."""

    layers: list[tuple[str, torch.dtype, tuple[int, ...]]]
    payload: bytes

    def copy_into(self, kv_caches: dict[str, torch.Tensor], block_id: int) -> None:
        """Write this block into block ``block_id`` of each layer's blocks-first cache view."""
        offset = 0
        for name, dtype, shape in self.layers:
            target = kv_caches[name][block_id]
            if target.dtype != dtype or tuple(target.shape) != shape:
                raise BlockFileError(
                    f"layer {name!r}: block is {dtype} {shape}, the cache {target.dtype} "
                    f"{tuple(target.shape)}"
                )
            size = target.numel() * target.element_size()
            raw = torch.frombuffer(bytearray(self.payload[offset : offset + size]), dtype=torch.uint8)
            target.copy_(raw.view(dtype).view(shape))
            offset += size


def decode(data: bytes, block_hash: bytes) -> Block:
    """Check ``data`` as the block of ``block_hash`` and decode it; ``BlockFileError`` says
    what is wrong."""
    fixed = len(MAGIC) + _LEN.size
    if len(data) < fixed or not data.startswith(MAGIC):
        raise BlockFileError("not a block file (bad magic or too short)")
    (header_len,) = _LEN.unpack_from(data, len(MAGIC))
    header_end = fixed + header_len
    if len(data) < header_end + _DIGEST:
        raise BlockFileError("truncated header")
    header = data[fixed:header_end]
    if hashlib.sha256(header).digest() != data[header_end : header_end + _DIGEST]:
        raise BlockFileError("header digest mismatch")
    meta = json.loads(header)
    payload = data[header_end + _DIGEST :]
    if len(payload) != meta["payload_bytes"]:
        raise BlockFileError(f"size {len(data)} does not match the header (truncated or padded)")
    if meta["block_hash"] != block_hash.hex():
        raise BlockFileError("holds another block")
    if hashlib.sha256(payload).hexdigest() != meta["payload_sha256"]:
        raise BlockFileError("payload digest mismatch")
    layers = [(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in meta["layers"]]
    return Block(layers, payload)


def read(path: Path, block_hash: bytes) -> Block:
    """Read and check the block file at ``path``."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BlockFileError(f"unreadable: {e}") from e
    return decode(data, block_hash)


def write(path: Path, data: bytes) -> None:
    """Write ``data`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class FileChecker:
    """Whether block files are valid, remembered per file version (size, modification time):
    a scheduler asks about the same files step after step. An invalid file is logged once."""

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[tuple[int, int], bool]] = {}

    def is_valid(self, path: Path, block_hash: bytes) -> bool:
        try:
            st = path.stat()
        except OSError:
            return False
        version = (st.st_size, st.st_mtime_ns)
        seen = self._seen.get(path)
        if seen is not None and seen[0] == version:
            return seen[1]
        try:
            read(path, block_hash)
            valid = True
        except BlockFileError as e:
            logger.warning("KV block file %s is unusable (%s): treated as a miss", path, e)
            valid = False
        self._seen[path] = (version, valid)
        return valid
