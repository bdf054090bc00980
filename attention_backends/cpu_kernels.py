"""A C kernel for paged decode attention on the CPU, compiled on first use with the system C
compiler and loaded through ctypes.

It reads each request's keys and values straight from their cache blocks, once, instead of
gathering them into a contiguous copy for SDPA: decode attention is memory-bound, so reading the
context once instead of three times (gather read, gather write, SDPA read) is what matters. The
shared library is cached under the tokenmill cache directory, keyed by a hash of the source and
flags. Without a working compiler ``load()`` returns None and the backend keeps its SDPA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* q, out: [B, H, D]; caches: [num_blocks, bs, kvh, D]; block_table: [B, table_stride].
   One work item per request: each cached token's keys (and values) for all KV heads are one
   contiguous row, read once. */
void paged_decode_attention(
    const float *q, const float *key_cache, const float *value_cache,
    const int64_t *block_table, int64_t table_stride, const int64_t *seq_lens,
    float *out, int64_t B, int64_t H, int64_t kvh, int64_t D, int64_t bs,
    float scale, int64_t max_len, int nthreads)
{
    const int64_t G = H / kvh;
    const int64_t row = kvh * D;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * H * max_len);
        float *acc = (float *)malloc(sizeof(float) * H * D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t L = seq_lens[b];
            const float *qb = q + b * H * D;
            const int64_t *bt = block_table + b * table_stride;
            for (int64_t t0 = 0; t0 < L; t0 += bs) {
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                const float *kb = key_cache + bt[t0 / bs] * bs * row;
                for (int64_t i = 0; i < n; ++i) {
                    const float *k = kb + i * row;
                    for (int64_t h = 0; h < H; ++h) {
                        const float *qh = qb + h * D, *kh = k + (h / G) * D;
                        float s = 0.f;
                        #pragma omp simd reduction(+:s)
                        for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
                        scores[h * max_len + t0 + i] = s * scale;
                    }
                }
            }
            for (int64_t h = 0; h < H; ++h) {
                float *sh = scores + h * max_len, m = sh[0], sum = 0.f;
                for (int64_t t = 1; t < L; ++t) m = sh[t] > m ? sh[t] : m;
                for (int64_t t = 0; t < L; ++t) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
            }
            for (int64_t i = 0; i < H * D; ++i) acc[i] = 0.f;
            for (int64_t t0 = 0; t0 < L; t0 += bs) {
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                const float *vb = value_cache + bt[t0 / bs] * bs * row;
                for (int64_t i = 0; i < n; ++i) {
                    const float *v = vb + i * row;
                    for (int64_t h = 0; h < H; ++h) {
                        const float p = scores[h * max_len + t0 + i], *vh = v + (h / G) * D;
                        float *a = acc + h * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
                    }
                }
            }
            float *ob = out + b * H * D;
            for (int64_t i = 0; i < H * D; ++i) ob[i] = acc[i];
        }
        free(scores); free(acc);
    }
}
"""

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    from tokenmill.default_model import cache_dir

    return Path(cache_dir()) / "kernels"


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) when it cannot be built here."""
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; CPU decode attention falls back to SDPA")
        return None
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernel.c"
            src.write_text(SOURCE)
            built = Path(tmp) / "kernel.so"
            proc = subprocess.run(
                [compiler, *FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                logger.warning("CPU kernel build failed; falling back to SDPA:\n%s", proc.stderr)
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i64, ctypes.c_int]
    lib.paged_decode_attention.restype = None
    return lib


def paged_decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per request over its paged context.

    ``query`` [B, H, D] float32; caches [num_blocks, block_size, kv_heads, D] float32 (each a
    contiguous view); ``block_table`` [B, n] int64 and ``seq_lens`` [B] int64, contiguous."""
    query = query.contiguous()
    out = torch.empty_like(query)
    b, h, d = query.shape
    kvh, bs = key_cache.shape[2], key_cache.shape[1]
    lib.paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        b, h, kvh, d, bs, scale, max_len, torch.get_num_threads(),
    )
    return out
