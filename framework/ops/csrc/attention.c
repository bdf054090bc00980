/* Paged decode attention: one query token per request over its cached context. */
#include <omp.h>
#include <math.h>
#include <stdlib.h>
#include "fp8.h"
#include "plan.h"
#include "vec.h"

/* How many blocks ahead of the one being read keys are prefetched, into L2 (a block is
   kilobytes: more lines than L1 keeps in flight). */
#define PREFETCH_AHEAD 2

static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 2);
}

/* Block b of a cache whose blocks hold `block` values: a float32 cache's own memory, or the
   block's first n values of a float8 cache converted into buf. */
static inline const float *block_f32(const void *cache, int64_t b, int64_t block, int64_t n,
                                     int kv_format, fp8_format f, float *buf) {
    if (kv_format == KV_F32) return (const float *)cache + b * block;
    fp8_to_f32(buf, (const uint8_t *)cache + b * block, n, f);
    return buf;
}

/* The shape of one call, shared by its work items. */
typedef struct {
    const void *key_cache, *value_cache;
    int64_t H, G, D, row, bs, block, block_bytes, stride;
    int kv_format;
    fp8_format fmt;
    float scale;
} attn_shape;

/* Query heads attended together: up to HC heads of one kv-head group read each key and value
   row once, and their HC x 4 independent sums keep the FMA units busy (one head alone is bound
   by the latency of its chain of FMAs). */
#define HC 3

/* Heads h .. h + result - 1 (at most HC) share h's kv head. */
static inline int heads_in_chunk(const attn_shape *s, int64_t h) {
    const int64_t left = s->G - h % s->G;
    return left < HC ? (int)left : HC;
}

/* sh[c * stride + i] = q_c . key i for hc query heads q (D apart) over n keys kh (row apart). */
static inline __attribute__((always_inline)) void chunk_scores(const float *q, const int hc, int64_t D, const float *kh,
                                                               int64_t row, int64_t n, float *sh, int64_t stride) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *k = kh + i * row;
        v8 a[HC][4];
        for (int c = 0; c < hc; ++c)
            for (int t = 0; t < 4; ++t) a[c][t] = (v8){0};
        for (int64_t d = 0; d < D; d += 8) {
            const v8 k0 = loadv(k + d), k1 = loadv(k + row + d), k2 = loadv(k + 2 * row + d), k3 = loadv(k + 3 * row + d);
            for (int c = 0; c < hc; ++c) {
                const v8 qv = loadv(q + c * D + d);
                a[c][0] += qv * k0;
                a[c][1] += qv * k1;
                a[c][2] += qv * k2;
                a[c][3] += qv * k3;
            }
        }
        for (int c = 0; c < hc; ++c) hsum4(a[c][0], a[c][1], a[c][2], a[c][3], sh + c * stride + i);
    }
    for (; i < n; ++i)
        for (int c = 0; c < hc; ++c) {
            v8 a = {0};
            for (int64_t d = 0; d < D; d += 8) a += loadv(q + c * D + d) * loadv(kh + i * row + d);
            sh[c * stride + i] = hsum(a);
        }
}

/* acc[c * D + d] += sum_i p[c * stride + i] * value i [d] for hc heads over n values vh (row
   apart), 32 features at a time held in registers across the values. */
static inline __attribute__((always_inline)) void chunk_values(const float *p, int64_t stride, const int hc, int64_t D,
                                                               const float *vh, int64_t row, int64_t n, float *acc) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        v8 c[HC][4];
        for (int h = 0; h < hc; ++h)
            for (int u = 0; u < 4; ++u) c[h][u] = loadv(acc + h * D + d + 8 * u);
        for (int64_t i = 0; i < n; ++i) {
            const float *v = vh + i * row + d;
            const v8 v0 = loadv(v), v1 = loadv(v + 8), v2 = loadv(v + 16), v3 = loadv(v + 24);
            for (int h = 0; h < hc; ++h) {
                const v8 pi = splat(p[h * stride + i]);
                c[h][0] += pi * v0;
                c[h][1] += pi * v1;
                c[h][2] += pi * v2;
                c[h][3] += pi * v3;
            }
        }
        for (int h = 0; h < hc; ++h)
            for (int u = 0; u < 4; ++u) storev(acc + h * D + d + 8 * u, c[h][u]);
    }
    for (; d < D; d += 8)
        for (int h = 0; h < hc; ++h) {
            v8 c = loadv(acc + h * D + d);
            for (int64_t i = 0; i < n; ++i) c += splat(p[h * stride + i]) * loadv(vh + i * row + d);
            storev(acc + h * D + d, c);
        }
}

/* One request's query qb [H, D] over blocks ja..jb-1 of its table bt, positions below `first`
   or from L on weighted zero. Writes acc [H, D] = sum over positions of
   exp((score - m[h]) * scale) * value, with m[h] the range's highest score and l[h] the sum of
   those weights. In three passes: scores (chunk_scores), the weights, then the weighted sum of
   values (chunk_values). Blocks are scattered, so the hardware prefetcher cannot fetch them:
   while block j's keys are read, block j + PREFETCH_AHEAD's keys and block j's values are
   prefetched (the values are then in L2 for the third pass), a share of their lines before each
   chunk of heads rather than all at once: a burst of a block's ~400 prefetches left the reads
   and the arithmetic mostly serial (16 requests x 300 tokens, 2 threads of an AMD EPYC:
   510-565 us per layer, 204 us with the caches in L3; shared out, 420-480 us). */
static void attend_blocks(const attn_shape *s, const float *qb, const int64_t *bt, int64_t ja, int64_t jb,
                          int64_t first, int64_t L, float *scores, float *buf, float *acc, float *m, float *l) {
    const int64_t H = s->H, D = s->D, row = s->row, bs = s->bs, base = ja * bs;
    const int64_t end = L < jb * bs ? L : jb * bs, Lp = (end - base + 7) / 8 * 8;
    for (int64_t j = ja; j < ja + PREFETCH_AHEAD && j < jb; ++j)
        prefetch((const char *)s->key_cache + bt[j] * s->block_bytes, s->block_bytes);
    for (int64_t j = ja; j < jb; ++j) {
        const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
        const float *kb = block_f32(s->key_cache, bt[j], s->block, n * row, s->kv_format, s->fmt, buf);
        const char *knext = j + PREFETCH_AHEAD < jb
                                ? (const char *)s->key_cache + bt[j + PREFETCH_AHEAD] * s->block_bytes
                                : NULL;
        const char *vcur = (const char *)s->value_cache + bt[j] * s->block_bytes;
        const int64_t slice = (s->block_bytes / H + 63) / 64 * 64;
        for (int64_t h = 0, hc; h < H; h += hc) {
            hc = heads_in_chunk(s, h);
            const int64_t o = h * slice, e = o + hc * slice < s->block_bytes ? hc * slice : s->block_bytes - o;
            if (e > 0) {
                if (knext) prefetch(knext + o, e);
                prefetch(vcur + o, e);
            }
            float *sh = scores + h * s->stride + t0 - base;
            const float *qh = qb + h * D, *kh = kb + (h / s->G) * D;
            switch (hc) {
                case 3: chunk_scores(qh, 3, D, kh, row, n, sh, s->stride); break;
                case 2: chunk_scores(qh, 2, D, kh, row, n, sh, s->stride); break;
                default: chunk_scores(qh, 1, D, kh, row, n, sh, s->stride); break;
            }
        }
    }

    for (int64_t h = 0; h < H; ++h) {
        float *sh = scores + h * s->stride;
        for (int64_t t = 0; t < first - base; ++t) sh[t] = -INFINITY;
        for (int64_t t = end - base; t < Lp; ++t) sh[t] = -INFINITY;
        v8 mv = splat(-INFINITY);
        for (int64_t t = 0; t < Lp; t += 8) mv = vmax(mv, loadv(sh + t));
        float mh = mv[0];
        for (int k = 1; k < 8; ++k) mh = mv[k] > mh ? mv[k] : mh;
        v8 sum = {0};
        for (int64_t t = 0; t < Lp; t += 8) {
            const v8 e = vexp((loadv(sh + t) - mh) * s->scale);
            storev(sh + t, e);
            sum += e;
        }
        m[h] = mh;
        l[h] = hsum(sum);
    }

    memset(acc, 0, sizeof(float) * H * D);
    for (int64_t j = ja; j < jb; ++j) {
        const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
        const float *vb = block_f32(s->value_cache, bt[j], s->block, n * row, s->kv_format, s->fmt, buf);
        for (int64_t h = 0, hc; h < H; h += hc) {
            hc = heads_in_chunk(s, h);
            const float *vh = vb + (h / s->G) * D, *p = scores + h * s->stride + t0 - base;
            switch (hc) {
                case 3: chunk_values(p, s->stride, 3, D, vh, row, n, acc + h * D); break;
                case 2: chunk_values(p, s->stride, 2, D, vh, row, n, acc + h * D); break;
                default: chunk_values(p, s->stride, 1, D, vh, row, n, acc + h * D); break;
            }
        }
    }
}

/* Request b's query is row rows[b] of q (rows q_stride floats apart, heads D apart) and its
   output row rows[b] of out [T, H, D]. key_cache, value_cache: [num_blocks, bs, kvh, D];
   block_table: [B, table_stride]; seq_lens: [B]. D is a multiple of 8. With window > 0 a
   request of length L attends only to positions L - window .. L - 1: blocks before that are
   skipped and the window's first block's earlier tokens get zero weight.
   With at least as many requests as threads, one work item per request. With fewer, each
   request's blocks are split into ceil(nthreads / B) ranges attended in parallel, and the
   ranges' partial sums merged by their maxima (flash-decoding), so a single stream's attention
   uses every thread.
   The caches hold float32 or, with kv_format KV_E4M3 / KV_E5M2, float8: each block read is
   converted into a per-thread float32 buffer first. The float8 cache's key scale is part of
   `scale`; its value scale `v_scale` multiplies the output. */
void paged_decode_attention_body(
    const float *q, int64_t q_stride, const int64_t *rows, const void *key_cache, const void *value_cache,
    const int64_t *block_table, int64_t table_stride, const int64_t *seq_lens,
    float *out, int64_t B, int64_t H, int64_t kvh, int64_t D, int64_t bs,
    float scale, float v_scale, int kv_format, int64_t max_len, int64_t window) {
    const int nthreads = omp_get_num_threads();
    const int64_t row = kvh * D, block = bs * row;
    const attn_shape s = {
        key_cache, value_cache, H, H / kvh, D, row, bs, block,
        block * (kv_format == KV_F32 ? (int64_t)sizeof(float) : 1), (max_len + 7) / 8 * 8,
        kv_format, fp8_format_of(kv_format), scale,
    };
    const int64_t nsplit = B >= nthreads ? 1 : (nthreads + B - 1) / B, part = H * D + 2 * H;
    float *parts = NULL;
    if (nsplit > 1) {
        #pragma omp single copyprivate(parts)
        parts = malloc(sizeof(float) * B * nsplit * part);
    }
    {
        float *scores = malloc(sizeof(float) * H * s.stride);
        float *ml = malloc(sizeof(float) * 2 * H);
        float *buf = kv_format == KV_F32 ? NULL : malloc(sizeof(float) * block);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * nsplit; ++w) {
            const int64_t b = w / nsplit, r = w % nsplit;
            const int64_t L = seq_lens[b], nblk = (L + bs - 1) / bs;
            const int64_t first = window > 0 && L > window ? L - window : 0, j0 = first / bs;
            const int64_t nr = nblk - j0 < nsplit ? nblk - j0 : nsplit;
            const float *qb = q + rows[b] * q_stride;
            const int64_t *bt = block_table + b * table_stride;
            if (L <= 0) {
                /* A padding row of a captured decode batch: no context, output zero. */
                if (r == 0) memset(out + rows[b] * H * D, 0, sizeof(float) * H * D);
                continue;
            }
            if (nsplit == 1) {
                float *acc = out + rows[b] * H * D;
                attend_blocks(&s, qb, bt, j0, nblk, first, L, scores, buf, acc, ml, ml + H);
                for (int64_t h = 0; h < H; ++h) {
                    const v8 inv = splat(v_scale / ml[H + h]);
                    for (int64_t d = 0; d < D; d += 8) storev(acc + h * D + d, loadv(acc + h * D + d) * inv);
                }
                continue;
            }
            float *p = parts + w * part;
            if (r >= nr) {
                for (int64_t h = 0; h < H; ++h) p[H * D + h] = -INFINITY, p[H * D + H + h] = 0.f;
                continue;
            }
            const int64_t nb = nblk - j0;
            attend_blocks(&s, qb, bt, j0 + nb * r / nr, j0 + nb * (r + 1) / nr, first, L, scores, buf, p,
                          p + H * D, p + H * D + H);
        }
        if (nsplit > 1) {
            #pragma omp for
            for (int64_t b = 0; b < B; ++b) {
                float *acc = out + rows[b] * H * D;
                if (seq_lens[b] <= 0) continue;
                for (int64_t h = 0; h < H; ++h) {
                    float M = -INFINITY, den = 0.f;
                    for (int64_t r = 0; r < nsplit; ++r) {
                        const float mr = parts[(b * nsplit + r) * part + H * D + h];
                        M = mr > M ? mr : M;
                    }
                    memset(acc + h * D, 0, sizeof(float) * D);
                    for (int64_t r = 0; r < nsplit; ++r) {
                        const float *p = parts + (b * nsplit + r) * part;
                        if (p[H * D + h] == -INFINITY) continue;
                        const float c = expf((p[H * D + h] - M) * scale);
                        den += c * p[H * D + H + h];
                        const v8 cv = splat(c);
                        for (int64_t d = 0; d < D; d += 8)
                            storev(acc + h * D + d, loadv(acc + h * D + d) + cv * loadv(p + h * D + d));
                    }
                    const v8 inv = splat(v_scale / den);
                    for (int64_t d = 0; d < D; d += 8) storev(acc + h * D + d, loadv(acc + h * D + d) * inv);
                }
            }
        }
        free(scores);
        free(ml);
        free(buf);
    }
    if (nsplit > 1) {
        #pragma omp single nowait
        free(parts);
    }
}

void paged_decode_attention(
    const float *q, int64_t q_stride, const int64_t *rows, const void *key_cache, const void *value_cache,
    const int64_t *block_table, int64_t table_stride, const int64_t *seq_lens,
    float *out, int64_t B, int64_t H, int64_t kvh, int64_t D, int64_t bs,
    float scale, float v_scale, int kv_format, int64_t max_len, int64_t window) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    paged_decode_attention_body(q, q_stride, rows, key_cache, value_cache, block_table, table_stride, seq_lens,
                                out, B, H, kvh, D, bs, scale, v_scale, kv_format, max_len, window);
}

/* Each token's key and value rows (kvh * D floats; rows key_stride / value_stride floats apart)
   into slot slots[i] of the float32 caches [num_slots, kvh * D]; a negative slot writes
   nothing. */
void kv_cache_write(float *key_cache, float *value_cache, const int64_t *slots, const float *key,
                    int64_t key_stride, const float *value, int64_t value_stride, int64_t n, int64_t row)
{
    #pragma omp for
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        memcpy(key_cache + slots[i] * row, key + i * key_stride, sizeof(float) * row);
        memcpy(value_cache + slots[i] * row, value + i * value_stride, sizeof(float) * row);
    }
}
