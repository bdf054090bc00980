/* Batched LoRA in one call: every token's own adapter slot, shrink (x . A^T) then expand (. B).

   The rows are grouped by slot (a stable counting sort) and each slot's rows cut into tiles of
   up to TILE rows; a tile runs as a small GEMM that reads its adapter's weights once for all its
   rows (punica's SGMV). A prefill's tokens share their request's adapter, so its tiles are full;
   so are a decode step's whenever several requests share an adapter; a slot with one row is a
   matrix-vector product (punica's BGMV). One code path: the number of rows per slot decides.

   The slots' weights are stacked as LoRAApply keeps them: for slot s and output slice i, rows
   (s * S + i) * max_rank .. + rank[s, i] of A [rows, K] (the shrink) and of B [rows, N] (the
   expand, its slice's columns offsets[i] .. offsets[i + 1]); the rows past a slice's rank
   are never read, and a slice of rank 0 (the adapter leaves it alone) is skipped. */
#include <omp.h>
#include "vec.h"

/* y[r] = dot(x, A row r) for r < rank, four rows at a time. */
static void shrink(float *y, const float *x, const float *a, int64_t rank, int64_t K) {
    int64_t r = 0;
    for (; r + 4 <= rank; r += 4) {
        const float *a0 = a + r * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
        v8 s0 = splat(0.f), s1 = s0, s2 = s0, s3 = s0;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const v8 xv = loadv(x + k);
            s0 += xv * loadv(a0 + k);
            s1 += xv * loadv(a1 + k);
            s2 += xv * loadv(a2 + k);
            s3 += xv * loadv(a3 + k);
        }
        hsum4(s0, s1, s2, s3, y + r);
        for (; k < K; ++k) {
            y[r] += x[k] * a0[k];
            y[r + 1] += x[k] * a1[k];
            y[r + 2] += x[k] * a2[k];
            y[r + 3] += x[k] * a3[k];
        }
    }
    for (; r < rank; ++r) {
        const float *ar = a + r * K;
        v8 s = splat(0.f);
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) s += loadv(x + k) * loadv(ar + k);
        y[r] = hsum(s);
        for (; k < K; ++k) y[r] += x[k] * ar[k];
    }
}

/* out[j] += sum_r y[r] * B[r, j] for j in [begin, end), eight columns held in a register. */
static void expand(float *out, const float *y, const float *b, int64_t rank, int64_t N,
                   int64_t begin, int64_t end) {
    int64_t j = begin;
    for (; j + 8 <= end; j += 8) {
        v8 acc = loadv(out + j);
        for (int64_t r = 0; r < rank; ++r) acc += splat(y[r]) * loadv(b + r * N + j);
        storev(out + j, acc);
    }
    for (; j < end; ++j) {
        float acc = out[j];
        for (int64_t r = 0; r < rank; ++r) acc += y[r] * b[r * N + j];
        out[j] = acc;
    }
}

#define TILE 4

/* y[m * ldy + r] = dot(xs[m], A row r) for n rows (n <= TILE, a constant once inlined) and
   r < rank: each A vector loaded serves the n rows, two A rows at a time. */
static inline __attribute__((always_inline)) void shrink_rows(
        float *y, int64_t ldy, const float *const *xs, const float *a, int64_t rank, int64_t K,
        const int n) {
    int64_t r = 0;
    for (; r + 2 <= rank; r += 2) {
        const float *a0 = a + r * K, *a1 = a0 + K;
        v8 s0[TILE], s1[TILE];
        for (int m = 0; m < n; ++m) s0[m] = s1[m] = splat(0.f);
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const v8 av0 = loadv(a0 + k), av1 = loadv(a1 + k);
            for (int m = 0; m < n; ++m) {
                const v8 xv = loadv(xs[m] + k);
                s0[m] += xv * av0;
                s1[m] += xv * av1;
            }
        }
        for (int m = 0; m < n; ++m) {
            float t0 = hsum(s0[m]), t1 = hsum(s1[m]);
            for (int64_t kk = k; kk < K; ++kk) {
                t0 += xs[m][kk] * a0[kk];
                t1 += xs[m][kk] * a1[kk];
            }
            y[m * ldy + r] = t0;
            y[m * ldy + r + 1] = t1;
        }
    }
    for (; r < rank; ++r) {
        for (int m = 0; m < n; ++m) {
            const float *xr = xs[m], *ar = a + r * K;
            v8 s = splat(0.f);
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) s += loadv(xr + k) * loadv(ar + k);
            float t = hsum(s);
            for (; k < K; ++k) t += xr[k] * ar[k];
            y[m * ldy + r] = t;
        }
    }
}

/* outs[m][j] += sum_r y[m * ldy + r] * B[r, j] for n rows and j in [begin, end): each B
   vector loaded serves the n rows, sixteen columns held in registers per row. */
static inline __attribute__((always_inline)) void expand_rows(
        float *const *outs, const float *y, int64_t ldy, const float *b, int64_t rank, int64_t N,
        int64_t begin, int64_t end, const int n) {
    int64_t j = begin;
    for (; j + 16 <= end; j += 16) {
        v8 lo[TILE], hi[TILE];
        for (int m = 0; m < n; ++m) {
            lo[m] = loadv(outs[m] + j);
            hi[m] = loadv(outs[m] + j + 8);
        }
        for (int64_t r = 0; r < rank; ++r) {
            const v8 b0 = loadv(b + r * N + j), b1 = loadv(b + r * N + j + 8);
            for (int m = 0; m < n; ++m) {
                const v8 ym = splat(y[m * ldy + r]);
                lo[m] += ym * b0;
                hi[m] += ym * b1;
            }
        }
        for (int m = 0; m < n; ++m) {
            storev(outs[m] + j, lo[m]);
            storev(outs[m] + j + 8, hi[m]);
        }
    }
    for (int m = 0; m < n; ++m) expand(outs[m], y + m * ldy, b, rank, N, j, end);
}

/* One tile: the n rows xs (in) and outs (out) of slot s, slice by slice. */
static inline __attribute__((always_inline)) void apply_tile(
        float *const *outs, const float *const *xs, const float *lora_a, const float *lora_b,
        const int64_t *ranks, const int64_t *offsets, int64_t s, int64_t K, int64_t N, int64_t S,
        int64_t max_rank, float *y, const int n) {
    for (int64_t i = 0; i < S; ++i) {
        const int64_t rank = ranks[s * S + i];
        if (rank == 0) continue;
        const int64_t row = (s * S + i) * max_rank;
        if (n == 1) {
            shrink(y, xs[0], lora_a + row * K, rank, K);
        } else {
            shrink_rows(y, max_rank, xs, lora_a + row * K, rank, K, n);
        }
        expand_rows(outs, y, max_rank, lora_b + row * N, rank, N, offsets[i], offsets[i + 1], n);
    }
}

/* out [T, N] (row stride ldo) += for each token t with slot s = slots[t] >= 0, slice by slice:
   (x[t] . A_{s,i}^T) . B_{s,i}; x [T, K] (row stride ldx); ranks [L, S] (each at most
   max_rank) for the L = max_loras slots; offsets [S + 1]. Tokens with slot -1 (no adapter) are
   skipped. */
void lora_apply(float *out, int64_t ldo, const float *x, int64_t ldx, const float *lora_a,
                const float *lora_b, const int64_t *slots, const int64_t *ranks,
                const int64_t *offsets, int64_t T, int64_t K, int64_t N, int64_t S, int64_t L,
                int64_t max_rank) {
    const int nthreads = omp_get_max_threads();
    int64_t start[L + 1];
    for (int64_t s = 0; s <= L; ++s) start[s] = 0;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= 0) ++start[slots[t] + 1];
    for (int64_t s = 0; s < L; ++s) start[s + 1] += start[s];
    int64_t order[T > 0 ? T : 1], fill[L > 0 ? L : 1];
    for (int64_t s = 0; s < L; ++s) fill[s] = start[s];
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= 0) order[fill[slots[t]]++] = t;
    /* tile i: rows order[first[i] ..] of one slot, tile_rows[i] of them */
    int64_t first[T > 0 ? T : 1];
    int tile_rows[T > 0 ? T : 1];
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < L; ++s)
        for (int64_t p = start[s]; p < start[s + 1]; p += TILE) {
            first[num_tiles] = p;
            tile_rows[num_tiles++] = (int)(start[s + 1] - p < TILE ? start[s + 1] - p : TILE);
        }
    #pragma omp parallel num_threads(nthreads) if (T * max_rank * (K + N) >= (1 << 18))
    {
        float y[TILE * (max_rank > 0 ? max_rank : 1)];
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < num_tiles; ++i) {
            const int n = tile_rows[i];
            const int64_t *rows = order + first[i];
            const int64_t s = slots[rows[0]];
            const float *xs[TILE];
            float *outs[TILE];
            for (int m = 0; m < n; ++m) {
                xs[m] = x + rows[m] * ldx;
                outs[m] = out + rows[m] * ldo;
            }
            switch (n) {
            case 4: apply_tile(outs, xs, lora_a, lora_b, ranks, offsets, s, K, N, S, max_rank, y, 4); break;
            case 3: apply_tile(outs, xs, lora_a, lora_b, ranks, offsets, s, K, N, S, max_rank, y, 3); break;
            case 2: apply_tile(outs, xs, lora_a, lora_b, ranks, offsets, s, K, N, S, max_rank, y, 2); break;
            default: apply_tile(outs, xs, lora_a, lora_b, ranks, offsets, s, K, N, S, max_rank, y, 1);
            }
        }
    }
}
