/* Paged decode attention: one query token per request over its cached context. */
#include <math.h>
#include <stdlib.h>
#include "fp8.h"
#include "vec.h"

static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o);
}

/* Block b of a cache whose blocks hold `block` values: a float32 cache's own memory, or the
   block's first n values of a float8 cache converted into buf. */
static inline const float *block_f32(const void *cache, int64_t b, int64_t block, int64_t n,
                                     int kv_format, fp8_format f, float *buf) {
    if (kv_format == KV_F32) return (const float *)cache + b * block;
    fp8_to_f32(buf, (const uint8_t *)cache + b * block, n, f);
    return buf;
}

/* Request b's query is row rows[b] of q (rows q_stride floats apart, heads D apart) and its
   output row rows[b] of out [T, H, D]. key_cache, value_cache: [num_blocks, bs, kvh, D];
   block_table: [B, table_stride]; seq_lens: [B]. D is a multiple of 8. With window > 0 a
   request of length L attends only to positions L - window .. L - 1: blocks before that are
   skipped and the window's first block's earlier tokens get zero weight. One work item per
   request, in three passes: scores (four tokens at a time per head), softmax, then the weighted
   sum of values (32 output features at a time held in registers across a block's tokens).
   Scores are indexed from the first block read. The next block is prefetched while one is read:
   blocks are scattered, so the hardware prefetcher cannot.
   The caches hold float32 or, with kv_format KV_E4M3 / KV_E5M2, float8: each block read is
   converted into a per-thread float32 buffer first. The float8 cache's key scale is part of
   `scale`; its value scale `v_scale` multiplies the softmax weights. */
void paged_decode_attention(
    const float *q, int64_t q_stride, const int64_t *rows, const void *key_cache, const void *value_cache,
    const int64_t *block_table, int64_t table_stride, const int64_t *seq_lens,
    float *out, int64_t B, int64_t H, int64_t kvh, int64_t D, int64_t bs,
    float scale, float v_scale, int kv_format, int64_t max_len, int64_t window, int nthreads)
{
    const int64_t G = H / kvh, row = kvh * D, block = bs * row;
    const int64_t stride = (max_len + 7) / 8 * 8;
    const int64_t block_bytes = block * (kv_format == KV_F32 ? sizeof(float) : 1);
    const fp8_format fmt = fp8_format_of(kv_format);
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * H * stride);
        float *buf = kv_format == KV_F32 ? NULL : malloc(sizeof(float) * block);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t L = seq_lens[b], nblk = (L + bs - 1) / bs;
            const int64_t first = window > 0 && L > window ? L - window : 0;
            const int64_t j0 = first / bs, base = j0 * bs, Lp = (L - base + 7) / 8 * 8;
            const float *qb = q + rows[b] * q_stride;
            const int64_t *bt = block_table + b * table_stride;
            float *acc = out + rows[b] * H * D;

            for (int64_t j = j0; j < nblk; ++j) {
                const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
                const float *kb = block_f32(key_cache, bt[j], block, n * row, kv_format, fmt, buf);
                if (j + 1 < nblk) prefetch((const char *)key_cache + bt[j + 1] * block_bytes, block_bytes);
                for (int64_t h = 0; h < H; ++h) {
                    const float *qh = qb + h * D, *kh = kb + (h / G) * D;
                    float *sh = scores + h * stride + t0 - base;
                    int64_t i = 0;
                    for (; i + 4 <= n; i += 4) {
                        const float *k = kh + i * row;
                        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                        for (int64_t d = 0; d < D; d += 8) {
                            const v8 qv = loadv(qh + d);
                            a0 += qv * loadv(k + d);
                            a1 += qv * loadv(k + row + d);
                            a2 += qv * loadv(k + 2 * row + d);
                            a3 += qv * loadv(k + 3 * row + d);
                        }
                        hsum4(a0, a1, a2, a3, sh + i);
                    }
                    for (; i < n; ++i) {
                        v8 a = {0};
                        for (int64_t d = 0; d < D; d += 8) a += loadv(qh + d) * loadv(kh + i * row + d);
                        sh[i] = hsum(a);
                    }
                }
            }

            prefetch((const char *)value_cache + bt[j0] * block_bytes, block_bytes);
            for (int64_t h = 0; h < H; ++h) {
                float *sh = scores + h * stride;
                for (int64_t t = 0; t < first - base; ++t) sh[t] = -INFINITY;
                for (int64_t t = L - base; t < Lp; ++t) sh[t] = -INFINITY;
                v8 mv = splat(-INFINITY);
                for (int64_t t = 0; t < Lp; t += 8) mv = vmax(mv, loadv(sh + t));
                float m = mv[0];
                for (int k = 1; k < 8; ++k) m = mv[k] > m ? mv[k] : m;
                v8 sum = {0};
                for (int64_t t = 0; t < Lp; t += 8) {
                    const v8 e = vexp((loadv(sh + t) - m) * scale);
                    storev(sh + t, e);
                    sum += e;
                }
                const v8 inv = splat(v_scale / hsum(sum));
                for (int64_t t = 0; t < Lp; t += 8) storev(sh + t, loadv(sh + t) * inv);
            }

            memset(acc, 0, sizeof(float) * H * D);
            for (int64_t j = j0; j < nblk; ++j) {
                const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
                const float *vb = block_f32(value_cache, bt[j], block, n * row, kv_format, fmt, buf);
                if (j + 1 < nblk) prefetch((const char *)value_cache + bt[j + 1] * block_bytes, block_bytes);
                for (int64_t h = 0; h < H; ++h) {
                    const float *vh = vb + (h / G) * D, *p = scores + h * stride + t0 - base;
                    float *a = acc + h * D;
                    int64_t d = 0;
                    for (; d + 32 <= D; d += 32) {
                        v8 c0 = loadv(a + d), c1 = loadv(a + d + 8), c2 = loadv(a + d + 16), c3 = loadv(a + d + 24);
                        for (int64_t i = 0; i < n; ++i) {
                            const float *v = vh + i * row + d;
                            const v8 pi = splat(p[i]);
                            c0 += pi * loadv(v);
                            c1 += pi * loadv(v + 8);
                            c2 += pi * loadv(v + 16);
                            c3 += pi * loadv(v + 24);
                        }
                        storev(a + d, c0); storev(a + d + 8, c1); storev(a + d + 16, c2); storev(a + d + 24, c3);
                    }
                    for (; d < D; d += 8) {
                        v8 c = loadv(a + d);
                        for (int64_t i = 0; i < n; ++i) c += splat(p[i]) * loadv(vh + i * row + d);
                        storev(a + d, c);
                    }
                }
            }
        }
        free(scores);
        free(buf);
    }
}
