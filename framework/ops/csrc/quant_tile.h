/* The float micro-kernel of the linear kernels on float32 and quantized weights: every input row
   times a block of NR weight rows, read as floats either from a buffer the rows were widened
   into (tiled_linear) or converted in registers from the weights as stored (STREAMED_LINEAR). */
#pragma once
#include <stdlib.h>
#include "vec.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Eight int8 / uint8 values widened to int32 lanes (vpmovsxbd / vpmovzxbd: GCC lowers 8-byte
   vector conversions element by element). */
static inline v8i widen_i8(const int8_t *p) {
#if defined(__AVX2__)
    return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8i v;
    for (int i = 0; i < 8; ++i) v[i] = p[i];
    return v;
#endif
}

static inline v8i widen_u8(const uint8_t *p) {
#if defined(__AVX2__)
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8i v;
    for (int i = 0; i < 8; ++i) v[i] = p[i];
    return v;
#endif
}

#define NR 4  /* weight rows per block */
/* Input rows per tile: MR x NR accumulators, MR input vectors and one weight vector fit the
   16 vector registers of AVX2 with MR = 3, the 32 of AVX-512 with MR = 4. */
#if defined(__AVX512F__)
#define MR 4
#else
#define MR 3
#endif

/* How a tile reads a weight row as floats: eight values from column k, and one. */
typedef v8 (*load8_fn)(const void *row, int64_t k);
typedef float (*load1_fn)(const void *row, int64_t k);

static inline v8 f32_load8(const void *row, int64_t k) { return loadv((const float *)row + k); }
static inline float f32_load1(const void *row, int64_t k) { return ((const float *)row)[k]; }

/* acc[m][j] = dot(x row m, weight row w[j]) for m < mr, j < NR over K columns, the weights read
   by load8 / load1 (inlined with the tile, so converting codes happens in registers). One input
   row has a second set of accumulators, so its NR sums are not bound by the FMA latency. The
   tile prefetches pf_bytes from pf into L2 a share per step (pf_bytes 0: none). */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t ldx, const int mr, const void *const w[NR], load8_fn load8,
     load1_fn load1, int64_t K, float acc[MR][NR], const char *pf, int64_t pf_bytes) {
    v8 a[MR][NR];
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < NR; ++j) a[m][j] = (v8){0};
    int64_t k = 0;
    if (mr == 1) {
        v8 c[NR];
        for (int j = 0; j < NR; ++j) c[j] = (v8){0};
        const int64_t steps = K / 16 > 0 ? K / 16 : 1, share = (pf_bytes / steps + 63) / 64 * 64;
        int64_t off = 0;
        for (; k + 16 <= K; k += 16) {
            for (int64_t b = 0; b < share && off < pf_bytes; b += 64, off += 64)
                __builtin_prefetch(pf + off, 0, 2);
            const v8 x0 = loadv(x + k), x1 = loadv(x + k + 8);
            for (int j = 0; j < NR; ++j) {
                a[0][j] += x0 * load8(w[j], k);
                c[j] += x1 * load8(w[j], k + 8);
            }
        }
        for (int j = 0; j < NR; ++j) a[0][j] += c[j];
        for (; off < pf_bytes; off += 64) __builtin_prefetch(pf + off, 0, 2);
    }
    const int64_t steps8 = K / 8 > 0 ? K / 8 : 1, share8 = (pf_bytes / steps8 + 63) / 64 * 64;
    int64_t off8 = mr == 1 ? pf_bytes : 0; /* one row: prefetched above */
    for (; k + 8 <= K; k += 8) {
        for (int64_t b = 0; b < share8 && off8 < pf_bytes; b += 64, off8 += 64)
            __builtin_prefetch(pf + off8, 0, 2);
        v8 xv[MR];
        for (int m = 0; m < mr; ++m) xv[m] = loadv(x + m * ldx + k);
        for (int j = 0; j < NR; ++j) {
            const v8 wv = load8(w[j], k);
            for (int m = 0; m < mr; ++m) a[m][j] += xv[m] * wv;
        }
    }
    for (; off8 < pf_bytes; off8 += 64) __builtin_prefetch(pf + off8, 0, 2);
    for (int m = 0; m < mr; ++m) {
        hsum4(a[m][0], a[m][1], a[m][2], a[m][3], acc[m]);
        for (int64_t kk = k; kk < K; ++kk)
            for (int j = 0; j < NR; ++j) acc[m][j] += x[m * ldx + kk] * load1(w[j], kk);
    }
}

/* out[m, n0 + j] = (x[m] . w[j]) * scale[n0 + j] (scale may be NULL) + bias[n0 + j] (may be
   NULL) for every input row m and j < nr; a single-row tile prefetches pf as it goes. */
static inline __attribute__((always_inline)) void
rows_times_block(float *out, const float *x, int64_t ldx, const void *const w[NR], load8_fn load8,
                 load1_fn load1, int nr, const float *scale, const float *bias, int64_t M,
                 int64_t N, int64_t K, int64_t n0, const char *pf, int64_t pf_bytes) {
    float acc[MR][NR];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const float *xm = x + m0 * ldx;
        switch (mr) {
#if MR == 4
            case 4: tile(xm, ldx, 4, w, load8, load1, K, acc, m0 == 0 ? pf : NULL, pf_bytes); break;
#endif
            case 3: tile(xm, ldx, 3, w, load8, load1, K, acc, m0 == 0 ? pf : NULL, pf_bytes); break;
            case 2: tile(xm, ldx, 2, w, load8, load1, K, acc, m0 == 0 ? pf : NULL, pf_bytes); break;
            default: tile(xm, ldx, 1, w, load8, load1, K, acc, m0 == 0 ? pf : NULL, pf_bytes); break;
        }
        for (int m = 0; m < mr; ++m)
            for (int j = 0; j < nr; ++j) {
                float v = acc[m][j];
                if (scale) v *= scale[n0 + j];
                if (bias) v += bias[n0 + j];
                out[(m0 + m) * N + n0 + j] = v;
            }
    }
}

/* Weight row n widened to K floats in dst: how tiled_linear reads one kind of weight. */
typedef void (*widen_row_fn)(float *dst, const void *weights, int64_t n, int64_t K);

/* out [M, N] = x [M, K] (row stride ldx) W^T * scale[n] (scale may be NULL) + bias[n] (may be
   NULL), for weights no loader reads in registers (int4's groups): each thread widens NR weight
   rows at a time into a float buffer (a few KiB, in L1) and
   multiplies every input row by them, so each weight byte is read from memory and converted
   once per call; the threads of the enclosing team split the output rows. Inlined, so `widen`
   is too. */
static inline __attribute__((always_inline)) void
tiled_linear(float *out, const float *x, int64_t ldx, widen_row_fn widen, const void *weights,
             const float *scale, const float *bias, int64_t M, int64_t N, int64_t K) {
    {
        float *wb = malloc(sizeof(float) * NR * K);
        const void *rows[NR];
        for (int j = 0; j < NR; ++j) rows[j] = wb + j * K;
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            for (int j = 0; j < NR; ++j) widen(wb + j * K, weights, n0 + (j < nr ? j : 0), K);
            rows_times_block(out, x, ldx, rows, f32_load8, f32_load1, nr, scale, bias, M, N, K, n0, NULL, 0);
        }
        free(wb);
    }
}

/* STREAMED_LINEAR(name, load8, load1, spread) defines `name`, the same product reading the weight
   rows W [N, row_bytes] in place through load8 / load1, no buffer: NR consecutive rows are one
   contiguous run, so each thread streams its share of W once, front to back (a last partial
   block repeats its first row). Converting the codes again for each tile of MR input rows
   (from L1 after the first) costs less than tiled_linear's store and reload of every weight:
   int8 over the default model's layers, 2 threads, 8 rows 17 vs 41 ms, 64 rows 118 vs 139 ms
   for dequantize + F.linear. The rows are read a few bytes per step, and without prefetching
   one thread keeps too few cache misses in flight (int8 at one row: 5 GB/s per thread, 13-17
   with it, on a 2-core AMD EPYC). Each block's lines are prefetched before its tiles run and
   the next block's into L2 — with `spread` and at most one tile of input rows (M <= MR), the
   next block's a share per step of the tile instead (the current one then came in while the
   previous block ran): float32's 30 layers and head at one row, medians of 25 alternated runs,
   24.9 -> 21.4 and 22.2 -> 19.2 ms; the 30 layers at 2, 3 and 4 rows (a speculative
   verification), best of 5, 15.4 -> 10.6, 19.9 -> 13.4 and 24.7 -> 17.0 ms; int8's blocks are
   four times smaller and it was 30 % slower so. The threads of the enclosing team share the
   blocks. A macro, so the loaders are named in the loop and inlined, not called through a
   pointer. */
#define STREAMED_LINEAR(name, load8, load1, spread)                                              \
    static void name(float *out, const float *x, int64_t ldx, const void *weights,              \
                     int64_t row_bytes, const float *scale, const float *bias, int64_t M,       \
                     int64_t N, int64_t K) {                                                     \
        const int sp = (spread) && M <= MR;                                                      \
        {                                                                                        \
            int64_t expect = -1;                                                                 \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t n0 = 0; n0 < N; n0 += NR) {                                             \
                const int nr = N - n0 < NR ? (int)(N - n0) : NR;                                 \
                const char *block = (const char *)weights + n0 * row_bytes;                      \
                const int64_t next = N - n0 - NR < NR ? N - n0 - NR : NR;                        \
                const char *after = next > 0 ? block + NR * row_bytes : NULL;                    \
                const int64_t after_bytes = next > 0 ? next * row_bytes : 0;                     \
                if (!sp || n0 != expect)                                                         \
                    for (int64_t b = 0; b < nr * row_bytes; b += 64) __builtin_prefetch(block + b); \
                if (!sp)                                                                         \
                    for (int64_t b = 0; b < after_bytes; b += 64) __builtin_prefetch(after + b, 0, 2); \
                expect = n0 + NR;                                                                \
                const void *rows[NR];                                                            \
                for (int j = 0; j < NR; ++j) rows[j] = block + (j < nr ? j : 0) * row_bytes;    \
                rows_times_block(out, x, ldx, rows, load8, load1, nr, scale, bias, M, N, K, n0,  \
                                 sp ? after : NULL, sp ? after_bytes : 0);                       \
            }                                                                                    \
        }                                                                                        \
    }

/* out [N, K] = W * scale[n] (scale may be NULL), W's rows widened by `widen`. */
static inline __attribute__((always_inline)) void
dequantize_rows(float *out, widen_row_fn widen, const void *weights, const float *scale, int64_t N,
                int64_t K, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        float *o = out + n * K;
        widen(o, weights, n, K);
        if (!scale) continue;
        const float s = scale[n];
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) storev(o + k, loadv(o + k) * s);
        for (; k < K; ++k) o[k] *= s;
    }
}
