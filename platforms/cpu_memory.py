"""A loaded model's parameters moved into one mapping backed by transparent huge pages.

Decode streams every weight once per token. On 4 KiB pages that stream walks a TLB entry per
page (135,000 for the default model's 540 MB of float32), and the weights lie scattered over
the heap and many mappings; on 2 MiB pages it needs a few hundred. The default model in float32
on 2 cores of an AMD EPYC (Zen 4) held to AVX2, the checkout before and after alternated
(``benchmarks/single_stream.py --python <before> --python <after> --quantization none --threads
2 --rounds 4``): 12.1-12.7 ms per decode token as loaded, 10.8-11.0 ms moved (16.0-16.6 against
14.3-14.4 in rounds where the machine's read bandwidth had halved). The quantized formats,
which read a quarter of the bytes or less, gained nothing measurable (``gguf``, ``int8``,
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
    """Copy every CPU parameter of ``model`` into one mapping advised for huge pages and point the
    parameters at their copies, so every holder of a parameter sees the move. Parameters that
    shared a storage (tied weights, views) still share one; each old storage is freed as soon
    as its parameters point at the copy, so the move needs little memory beyond the weights.
    Buffers stay: they are read a row at a time, and one
    module's may serve several models (the RoPE cache), which would keep this model's mapping
    alive after it is gone. Returns the bytes moved (0 where the OS gives no huge-page advice)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    by_storage: dict[int, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.device.type == "cpu":
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    groups = [
        ps for ptr, ps in by_storage.items() if ps[0].untyped_storage().nbytes() and not _in_a_mapping(ptr)
    ]
    total = sum(_aligned(ps[0].untyped_storage().nbytes()) for ps in groups)
    if not total:
        return 0
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8)
    _MAPPINGS[base.data_ptr()] = base.data_ptr() + len(region)
    weakref.finalize(region, _MAPPINGS.pop, base.data_ptr(), None)
    arena = base.untyped_storage()
    offset = (-base.data_ptr()) % HUGE_PAGE
    with torch.no_grad():
        for params in groups:
            nbytes = params[0].untyped_storage().nbytes()
            source = torch.empty(0, dtype=torch.uint8).set_(params[0].untyped_storage(), 0, (nbytes,), (1,))
            base[offset : offset + nbytes].copy_(source)
            del source
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype).set_(
                    arena, offset // p.element_size() + p.storage_offset(), p.size(), p.stride()
                )
            offset += _aligned(nbytes)
    return_freed_heap()
    return total


def _in_a_mapping(ptr: int) -> bool:
    return any(start <= ptr < end for start, end in _MAPPINGS.items())


def return_freed_heap() -> None:
    """Give freed heap pages back to the OS: glibc keeps freed memory below the heap's top (the
    170 MB of the default model's float32 weights ``move_to_huge_pages`` copied, a failed
    graph capture's tensors) until ``malloc_trim``."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
