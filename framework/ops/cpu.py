"""CPU kernels: C sources in ``csrc/`` compiled on first use with the system C compiler
(``-O3 -fopenmp`` and the instruction set of ``TOKENMILL_CPU_ISA``: ``-march=native`` by default,
``-mavx2 -mfma -mf16c`` for ``avx2``) into one shared library, cached under the tokenmill cache directory
by a hash of the sources, flags, compiler and CPU, and loaded with ctypes. On x86-64 the kernels
need AVX2 and FMA (``csrc/vec.h``); where the build fails they are off.

They run on contiguous float32 CPU tensors (the decode attention also on float8 KV caches, and
the quantized weights of ``cpu_quant``, which wraps ``quant_int.c`` and ``quant_fp8.c``); callers
(the CPU platform's op table, the
``cpu_sdpa`` backend) check :func:`supports` and otherwise use their torch path. The OpenMP
runtime they link is the one torch already loaded, so they share its threads, and each kernel
runs on as many as ``torch.set_num_threads`` last gave the calling thread (``omp_get_max_threads``),
read at every call: a recorded decode graph follows a change of the thread count.
A decode plan (:func:`pack_plan`, ``csrc/plan.c``) runs a recorded sequence of these calls in
one C call and one OpenMP region, each kernel's loops shared by the region's threads.
``TOKENMILL_DISABLE_CPU_KERNELS=1`` turns them all off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)

SOURCES = (
    "attention.c", "embedding.c", "norm.c", "activation.c", "rotary.c", "gguf.c", "quant_int.c", "quant_fp8.c",
    "lora.c", "plan.c",
)
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
# TOKENMILL_CPU_ISA: the compiler's instruction-set flags and the /proc/cpuinfo flags they need.
ISA_FLAGS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
    "avx512": (
        ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw"],
        ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512bw"),
    ),
}
_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "paged_decode_attention": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _INT, _I64, _I64],
    "kv_cache_write": [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64],
    "embedding": [_PTR, _PTR, _PTR, _I64, _I64],
    "rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, _F32],
    "fused_add_rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, _F32],
    "residual_sum": [_PTR, _I64, _PTR, _PTR, _I64, _I64],
    "silu_and_mul": [_PTR, _PTR, _I64, _I64],
    "rotary_embedding": [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
    "gguf_matmul": [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "gguf_matmul_q8": [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "gguf_dequantize": [_INT, _PTR, _I64, _I64, _I64, _PTR],
    "int8_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "f32_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64],
    "int8_dequantize": [_PTR, _PTR, _PTR, _I64, _I64],
    "int4_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
    "int4_dequantize": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "quantize_rows_int8": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64],
    "w8a8_linear": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "fp8_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "fp8_dequantize": [_PTR, _PTR, _PTR, _I64, _I64],
    "lora_apply": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64],
}


PLAN_INTS, PLAN_FLOATS = 17, 2
"""Arguments of one call in a plan: pointers and integers, floats (``csrc/plan.h``)."""


class PlanOp(ctypes.Structure):
    """One kernel call of a plan (``plan_op`` in ``csrc/plan.h``)."""

    _fields_ = [("kernel", _I64), ("a", _I64 * PLAN_INTS), ("f", _F32 * PLAN_FLOATS)]


KV_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
"""KV-cache dtypes the decode attention reads, and their codes in ``csrc/fp8.h``."""


def _cpu_signature() -> str:
    """The CPU model and feature flags, so a cache shared between machines never hands one a
    library built for another's instruction set."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def cpu_flags() -> set[str]:
    """The feature flags of this CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def isa_flags() -> list[str]:
    """The compiler flags of ``TOKENMILL_CPU_ISA``; ValueError for an unknown value or one
    whose instructions this CPU lacks."""
    isa = envs.TOKENMILL_CPU_ISA.strip().lower()
    if isa not in ISA_FLAGS:
        raise ValueError(f"TOKENMILL_CPU_ISA={isa!r} is not one of {', '.join(ISA_FLAGS)}")
    flags, needs = ISA_FLAGS[isa]
    if missing := [f for f in needs if f not in cpu_flags()]:
        raise ValueError(f"TOKENMILL_CPU_ISA={isa}: this CPU lacks {', '.join(missing)}")
    return flags


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    csrc = Path(__file__).parent / "csrc"
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "compiling CPU kernels with %s (once per machine, cached in %s) ...", compiler, target.parent
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / "kernels.so"
        proc = subprocess.run(
            [compiler, *flags, *(str(csrc / s) for s in SOURCES), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            logger.warning("CPU kernels failed to build; using torch ops instead:\n%s", proc.stderr)
            return False
        os.replace(built, target)
    logger.info("compiled CPU kernels in %.1f s", time.perf_counter() - start)
    return True


@cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (logged once) when it cannot be built here."""
    if envs.TOKENMILL_DISABLE_CPU_KERNELS:
        return None
    flags = [*FLAGS, *isa_flags()]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; CPU kernels fall back to torch ops")
        return None
    from tokenmill.default_model import cache_dir

    csrc = Path(__file__).parent / "csrc"
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        digest.update(path.read_bytes())
    digest.update(" ".join([*flags, compiler, _cpu_signature()]).encode())
    target = Path(cache_dir()) / "kernels" / f"cpu_kernels_{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists() and not _build(compiler, flags, target):
            return None
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        logger.warning("CPU kernels unavailable (%s); using torch ops instead", e)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    lib.plan_kernel.argtypes, lib.plan_kernel.restype = [_I64], ctypes.c_char_p
    lib.run_plan.argtypes, lib.run_plan.restype = [_PTR, _I64], None
    return lib


@cache
def plan_kernels() -> dict[str, int]:
    """The kernels a plan can call, by name: their ids in ``csrc/plan.c``."""
    lib = load()
    assert lib is not None
    ids: dict[str, int] = {}
    while (name := lib.plan_kernel(len(ids))) is not None:
        ids[name.decode()] = len(ids)
    return ids


def pack_plan(calls: list[tuple[str, tuple[Any, ...]]]) -> ctypes.Array[PlanOp]:
    """Kernel calls ``(name, args)``, the arguments as given to the kernel, packed for
    :func:`run_plan`; ValueError for a kernel no plan runs."""
    ids = plan_kernels()
    plan = (PlanOp * len(calls))()
    for op, (name, args) in zip(plan, calls):
        if name not in ids:
            raise ValueError(f"kernel {name} cannot run in a plan")
        op.kernel = ids[name]
        ints = [int(v or 0) for t, v in zip(SIGNATURES[name], args) if t is not _F32]
        floats = [float(v) for t, v in zip(SIGNATURES[name], args) if t is _F32]
        op.a[: len(ints)] = ints
        op.f[: len(floats)] = floats
    return plan


def run_plan(plan: ctypes.Array[PlanOp]) -> None:
    """The calls of a :func:`pack_plan` plan, in order, in one C call: one parallel region of
    ``omp_get_max_threads`` threads (read at every call), a barrier between kernels."""
    load().run_plan(plan, len(plan))


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels can take these tensors: float32, on the CPU, last dim contiguous,
    and the library built."""
    for t in tensors:
        if t is not None and (t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1):
            return False
    return load() is not None


def supports_kv_cache(kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention` reads this cache: float32 or float8, on the CPU,
    contiguous."""
    return kv_cache.dtype in KV_FORMATS and kv_cache.is_cpu and kv_cache.is_contiguous()


def _int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int64 tensor, without a dispatcher call when it already is one
    (the per-step index tensors, read by every layer)."""
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def paged_decode_attention(
    query: torch.Tensor,
    output: torch.Tensor,
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of one query token per request over its paged context (with a sliding window,
    its last ``sliding_window`` positions), written into ``output[rows]``.

    ``query`` [T, H, D] (rows may be strided, D a multiple of 8) and ``output`` [T, H, D]
    contiguous; ``rows`` [B], the token row of each request; caches
    [num_blocks, block_size, kv_heads, D] (each a contiguous view) of a dtype in
    ``KV_FORMATS``, a float8 cache holding ``key / k_scale`` and ``value / v_scale``;
    ``block_table`` [B, n] and ``seq_lens`` [B] (integer tensors; int64 contiguous ones are used
    as they are)."""
    _, h, d = query.shape
    if query.stride(1) != d or query.stride(2) != 1:
        query = query.contiguous()
    rows, block_table, seq_lens = _int64(rows), _int64(block_table), _int64(seq_lens)
    kvh, bs = key_cache.shape[2], key_cache.shape[1]
    load().paged_decode_attention(
        query.data_ptr(), query.stride(0), rows.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        seq_lens.data_ptr(), output.data_ptr(), rows.shape[0], h, kvh, d, bs, scale * k_scale,
        v_scale, KV_FORMATS[key_cache.dtype], max_len, sliding_window or 0,
    )


def kv_cache_write(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``key`` and ``value`` [n, kv_heads, D] (token rows may be strided, each token's
    heads contiguous) into slots ``slots`` [n] of float32 caches [num_slots, kv_heads, D]
    (contiguous); a negative slot writes nothing."""
    slots = _int64(slots)
    n, row = key.shape[0], key.shape[1] * key.shape[2]
    load().kv_cache_write(
        key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), key.data_ptr(), key.stride(0),
        value.data_ptr(), value.stride(0), n, row,
    )


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [n] of ``table`` [vocab, dim] (contiguous float32), as [n, dim]."""
    ids = _int64(ids)
    out = table.new_empty(ids.shape[0], table.shape[1])
    load().embedding(out.data_ptr(), table.data_ptr(), ids.data_ptr(), ids.shape[0], table.shape[1])
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    load().rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``; returns
    ``(x, residual)``. Both must be contiguous and of one shape."""
    n = x.shape[-1]
    load().fused_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps
    )
    return x, residual


def residual_sum(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """``out = x + residual`` (``x`` when ``residual`` is None) for contiguous [T, N] ``x`` and
    ``residual``; ``out`` [T, N] needs only its last dimension contiguous."""
    n = x.shape[-1]
    load().residual_sum(
        out.data_ptr(), out.stride(0), x.data_ptr(), 0 if residual is None else residual.data_ptr(), x.numel() // n, n
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for contiguous ``x`` [..., 2d]."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], d)
    load().silu_and_mul(out.data_ptr(), x.data_ptr(), x.numel() // (2 * d), d)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> None:
    """Rotate ``query`` [T, H*head_size] and ``key`` [T, KVH*head_size] in place (rows may be
    strided views, features contiguous); ``cos_sin_cache`` [max_position, rotary_dim] is
    contiguous, cosines then sines; ``positions`` [T], each below max_position."""
    positions = _int64(positions)
    t = query.shape[0]
    load().rotary_embedding(
        positions.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
        cos_sin_cache.data_ptr(), t, query.shape[1] // head_size, key.shape[1] // head_size,
        head_size, rotary_dim, int(is_neox_style),
    )


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_ranks: torch.Tensor,
    slice_offsets: torch.Tensor,
    max_rank: int,
) -> None:
    """Batched LoRA (``csrc/lora.c``): ``out [T, N] +=`` each token's slot adapter applied to
    ``x [T, K]`` (rows of both may be strided, features contiguous). ``lora_a`` [L*S*R, K] and
    ``lora_b`` [L*S*R, N] (contiguous) stack ``max_rank`` (R) rows per slot and slice, of which
    the first ``slice_ranks`` [L, S] are used; ``slice_offsets`` [S + 1] are the slices' output
    columns; ``token_slots`` [T] is each token's slot (below L), -1 for none."""
    token_slots, slice_ranks, slice_offsets = _int64(token_slots), _int64(slice_ranks), _int64(slice_offsets)
    load().lora_apply(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
        token_slots.data_ptr(), slice_ranks.data_ptr(), slice_offsets.data_ptr(), x.shape[0], x.shape[1],
        out.shape[1], slice_ranks.shape[1], slice_ranks.shape[0], max_rank,
    )
