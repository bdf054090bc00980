/* Batched LoRA (punica's BGMV): every token's own adapter slot, shrink then expand, in one call.

   The slots' weights are stacked as LoRAApply keeps them: for slot s and output slice i, rows
   (s * S + i) * max_rank .. + rank[s, i] of A [rows, K] (the shrink, x . A^T) and of B [rows, N]
   (the expand, its slice's columns offsets[i] .. offsets[i + 1]); the rows past a slice's rank
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

/* out [T, N] (row stride ldo) += for each token t with slot s = slots[t] >= 0, slice by slice:
   (x[t] . A_{s,i}^T) . B_{s,i}; x [T, K] (row stride ldx); ranks [max_loras, S] (each at most
   max_rank); offsets [S + 1]. Tokens with slot -1 (no adapter) are skipped. */
void lora_apply(float *out, int64_t ldo, const float *x, int64_t ldx, const float *lora_a,
                const float *lora_b, const int64_t *slots, const int64_t *ranks,
                const int64_t *offsets, int64_t T, int64_t K, int64_t N, int64_t S,
                int64_t max_rank) {
    const int nthreads = omp_get_max_threads();
    #pragma omp parallel num_threads(nthreads) if (T * max_rank * (K + N) >= (1 << 18))
    {
        float y[max_rank > 0 ? max_rank : 1];
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t s = slots[t];
            if (s < 0) continue;
            for (int64_t i = 0; i < S; ++i) {
                const int64_t rank = ranks[s * S + i];
                if (rank == 0) continue;
                const int64_t row = (s * S + i) * max_rank;
                shrink(y, x + t * ldx, lora_a + row * K, rank, K);
                expand(out + t * ldo, y, lora_b + row * N, rank, N, offsets[i], offsets[i + 1]);
            }
        }
    }
}
