/* The float micro-kernel of the quantized linear kernels: every input row times a block of
   NR weight rows that the caller has dequantized into a float buffer. */
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

/* acc[m][j] = dot(x row m, wb row j) for m < mr, j < NR over K columns. */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t ldx, const int mr, const float *wb, int64_t K, float acc[MR][NR]) {
    v8 a[MR][NR];
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < NR; ++j) a[m][j] = (v8){0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8 xv[MR];
        for (int m = 0; m < mr; ++m) xv[m] = loadv(x + m * ldx + k);
        for (int j = 0; j < NR; ++j) {
            const v8 w = loadv(wb + j * K + k);
            for (int m = 0; m < mr; ++m) a[m][j] += xv[m] * w;
        }
    }
    for (int m = 0; m < mr; ++m) {
        hsum4(a[m][0], a[m][1], a[m][2], a[m][3], acc[m]);
        for (int64_t kk = k; kk < K; ++kk)
            for (int j = 0; j < NR; ++j) acc[m][j] += x[m * ldx + kk] * wb[j * K + kk];
    }
}

/* out[m, n0 + j] = (x[m] . wb[j]) * scale[n0 + j] (scale may be NULL) + bias[n0 + j] (may be
   NULL) for every input row m and j < nr. */
static void rows_times_block(float *out, const float *x, int64_t ldx, const float *wb, int nr,
                             const float *scale, const float *bias, int64_t M, int64_t N,
                             int64_t K, int64_t n0) {
    float acc[MR][NR];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const float *xm = x + m0 * ldx;
        switch (mr) {
#if MR == 4
            case 4: tile(xm, ldx, 4, wb, K, acc); break;
#endif
            case 3: tile(xm, ldx, 3, wb, K, acc); break;
            case 2: tile(xm, ldx, 2, wb, K, acc); break;
            default: tile(xm, ldx, 1, wb, K, acc); break;
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
   NULL): each thread widens NR weight rows at a time into a float buffer (a few KiB, in L1) and
   multiplies every input row by them, so each weight byte is read from memory once per call;
   threads split the output rows. Inlined, so `widen` is too. */
static inline __attribute__((always_inline)) void
tiled_linear(float *out, const float *x, int64_t ldx, widen_row_fn widen, const void *weights,
             const float *scale, const float *bias, int64_t M, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float *wb = malloc(sizeof(float) * NR * K);
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            for (int j = 0; j < NR; ++j) widen(wb + j * K, weights, n0 + (j < nr ? j : 0), K);
            rows_times_block(out, x, ldx, wb, nr, scale, bias, M, N, K, n0);
        }
        free(wb);
    }
}

/* out [M, N] = x [M, K] (row stride ldx) W^T + bias[n] (may be NULL) for a float32 W [N, K]:
   the tiles read the weight rows in place (NR consecutive rows are one contiguous run, so each
   thread streams its share of W once, front to back); only a last partial block of rows is
   copied, padded with its first row. */
static inline void streamed_linear(float *out, const float *x, int64_t ldx, const float *w,
                                   const float *bias, int64_t M, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float *tail = NULL;
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            const float *wb = w + n0 * K;
            if (nr < NR) {
                tail = malloc(sizeof(float) * NR * K);
                for (int j = 0; j < NR; ++j) memcpy(tail + j * K, w + (n0 + (j < nr ? j : 0)) * K, sizeof(float) * K);
                wb = tail;
            }
            rows_times_block(out, x, ldx, wb, nr, NULL, bias, M, N, K, n0);
        }
        free(tail);
    }
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
