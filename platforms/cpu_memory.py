"""A loaded model's parameters moved into one mapping backed by transparent huge pages.

Decode streams every weight once per token. On 4 KiB pages that stream walks a TLB entry per
page (135,000 for the default model's 540 MB of float32), and the weights lie scattered over
the heap and many mappings; on 2 MiB pages it needs a few hundred. The default model in
float32 on 2 cores of an AMD EPYC (Zen 4) held to AVX2, the checkout before and after
alternated (``benchmarks/single_stream.py --python <before> --python <after> --quantization
none --threads 2 --rounds 4``): 12.1-12.7 ms per decode token as loaded, 10.8-11.0 ms moved
(16.0-16.6 against 14.3-14.4 in rounds where the machine's read bandwidth had halved). The quantized
formats, which read a quarter of the bytes or less, gained nothing measurable (``gguf``, ``int8``,
``w8a8`` within their noise).

Torch's allocator hands out huge pages only with ``THP_MEM_ALLOC_ENABLE=1`` set before it
starts, and then only for allocations of 2 MiB or more (most of a layer's weights are smaller),
so the weights are copied into a private anonymous mapping advised ``MADV_HUGEPAGE``. The kernel
honours the advice where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or
``always``; elsewhere the copy still packs the weights together and costs nothing per step.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64
"""Each storage starts on a cache line."""
_MAPPINGS: dict[int, int] = {}
"""Start -> end address of each live mapping made here: a parameter already in one stays (a
draft head shares the target's embedding)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter of ``model`` into one mapping advised for huge pages and point
    the parameters at their copies, so every holder of a parameter sees the move. Parameters
    that shared a storage (tied weights, views) still share one. Buffers stay: they are read a
    row at a time, and one module's may serve several models (the RoPE cache), which would
    keep this model's mapping alive after it is gone. Returns the bytes moved (0 where the OS
    gives no huge-page advice)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    tensors = [p for p in model.parameters() if p.device.type == "cpu"]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    storages = {ptr: s for ptr, s in storages.items() if s.nbytes() and not _in_a_mapping(ptr)}
    total = sum(_aligned(s.nbytes()) for s in storages.values())
    if not total:
        return 0
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8)
    _MAPPINGS[base.data_ptr()] = base.data_ptr() + len(region)
    weakref.finalize(region, _MAPPINGS.pop, base.data_ptr(), None)
    arena = base.untyped_storage()
    offset = (-base.data_ptr()) % HUGE_PAGE
    starts: dict[int, int] = {}
    for ptr, storage in storages.items():
        nbytes = storage.nbytes()
        source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
        base[offset : offset + nbytes].copy_(source)
        starts[ptr] = offset
        offset += _aligned(nbytes)
    with torch.no_grad():
        for t in tensors:
            start = starts.get(t.untyped_storage().data_ptr())
            if start is not None:
                moved = torch.empty(0, dtype=t.dtype).set_(
                    arena, start // t.element_size() + t.storage_offset(), t.size(), t.stride()
                )
                t.data = moved
    del storages, source
    _return_freed_heap()
    return total


def _in_a_mapping(ptr: int) -> bool:
    return any(start <= ptr < end for start, end in _MAPPINGS.items())


def _return_freed_heap() -> None:
    """Give the pages the old copies leave free back to the OS: glibc keeps freed heap memory
    below its top (170 MB of the default model's float32 weights) until ``malloc_trim``."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
