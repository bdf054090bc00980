/* Linear layers on integer-quantized weights W [N, K] (out = x W^T * scale + bias):
   - int8: one int8 per weight, one float scale per output row;
   - int4: two 4-bit codes per byte, a float scale and minimum per row and group of `group`
     columns (w = q * scale + min); in each 32-column chunk byte j holds column j in its low
     nibble and column j + 16 in its high nibble;
   - w8a8: int8 weights times int8 activations quantized per row (dynamic, symmetric), summed
     in int32.
   Weight-only kernels run quant_tile.h's products: int8 (and float32 weights, f32_linear)
   streamed, int4 tiled over rows widened to float. The
   dequantize kernels write the float weight for callers that hand large batches to a float
   GEMM. */
#include <math.h>
#include "quant_tile.h"

/* Row n of an int8 weight W [N, K] as floats (unscaled codes). */
static void int8_row(float *dst, const void *weights, int64_t n, int64_t K) {
    const int8_t *w = (const int8_t *)weights + n * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) storev(dst + k, __builtin_convertvector(widen_i8(w + k), v8));
    for (; k < K; ++k) dst[k] = (float)w[k];
}

/* Row n of an int4 weight as floats: q * scale + min per group. */
static void int4_row(float *dst, const uint8_t *w, const float *scale, const float *minv,
                     int64_t K, int64_t group) {
    for (int64_t k = 0; k < K; k += 8) {
        const uint8_t *chunk = w + (k / 32) * 16;
        const int64_t o = k % 32;
        v8i b = widen_u8(chunk + (o < 16 ? o : o - 16));
        b = o < 16 ? (b & 15) : (b >> 4);
        const float s = scale[k / group], mn = minv[k / group];
        storev(dst + k, __builtin_convertvector(b, v8) * s + mn);
    }
}

static inline v8 int8_load8(const void *row, int64_t k) {
    return __builtin_convertvector(widen_i8((const int8_t *)row + k), v8);
}
static inline float int8_load1(const void *row, int64_t k) { return (float)((const int8_t *)row)[k]; }
STREAMED_LINEAR(int8_streamed, int8_load8, int8_load1)
STREAMED_LINEAR(f32_streamed, f32_load8, f32_load1)

/* Weight-only int8: out [M, N] = x [M, K] (row stride ldx) W^T * scale[n] + bias[n], the codes
   converted in registers. */
void int8_linear(float *out, const float *x, int64_t ldx, const int8_t *w, const float *scale,
                 const float *bias, int64_t M, int64_t N, int64_t K, int nthreads) {
    int8_streamed(out, x, ldx, w, K, scale, bias, M, N, K, nthreads);
}

/* Float32 weights: out [M, N] = x [M, K] (row stride ldx) W^T + bias[n] (may be NULL). */
void f32_linear(float *out, const float *x, int64_t ldx, const float *w, const float *bias,
                int64_t M, int64_t N, int64_t K, int nthreads) {
    f32_streamed(out, x, ldx, w, K * (int64_t)sizeof(float), NULL, bias, M, N, K, nthreads);
}

/* out [N, K] = W * scale[n]. */
void int8_dequantize(float *out, const int8_t *w, const float *scale, int64_t N, int64_t K, int nthreads) {
    dequantize_rows(out, int8_row, w, scale, N, K, nthreads);
}

/* A group-wise int4 weight, as int4_widen reads it. */
typedef struct {
    const uint8_t *w;
    const float *scale, *minv;
    int64_t group;
} int4_weights;

static void int4_widen(float *dst, const void *weights, int64_t n, int64_t K) {
    const int4_weights *p = weights;
    const int64_t groups = K / p->group;
    int4_row(dst, p->w + n * (K / 2), p->scale + n * groups, p->minv + n * groups, K, p->group);
}

/* Group-wise int4 (K a multiple of 32, group a multiple of 8 dividing K):
   out [M, N] = x [M, K] W^T + bias. */
void int4_linear(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                 const float *minv, const float *bias, int64_t M, int64_t N, int64_t K,
                 int64_t group, int nthreads) {
    const int4_weights weights = {w, scale, minv, group};
    tiled_linear(out, x, ldx, int4_widen, &weights, NULL, bias, M, N, K, nthreads);
}

/* out [N, K] = the float weight of a group-wise int4 one. */
void int4_dequantize(float *out, const uint8_t *w, const float *scale, const float *minv,
                     int64_t N, int64_t K, int64_t group, int nthreads) {
    const int4_weights weights = {w, scale, minv, group};
    dequantize_rows(out, int4_widen, &weights, NULL, N, K, nthreads);
}

/* Dynamic symmetric per-row int8: scale[m] = max|x[m]| / 127 (1 for a zero row),
   q[m, k] = round(x[m, k] / scale[m]) in [-127, 127]. */
void quantize_rows_int8(int8_t *q, float *scale, const float *x, int64_t ldx, int64_t M,
                        int64_t K, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * ldx;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(xr[k]));
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        scale[m] = s;
        for (int64_t k = 0; k < K; ++k) q[m * K + k] = (int8_t)nearbyintf(xr[k] / s);
    }
}

/* sum_k a[k] * b[k] for int8 codes in [-127, 127]. With AVX2, |b| (unsigned) times a with b's
   sign in pairs of int16 products: no pair sum exceeds 2 * 127 * 127, so nothing saturates. */
static inline int32_t dot_i8(const int8_t *a, const int8_t *b, int64_t K) {
    int64_t k = 0;
    int32_t s = 0;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (; k + 32 <= K; k += 32) {
        const __m256i av = _mm256_loadu_si256((const __m256i *)(a + k));
        const __m256i bv = _mm256_loadu_si256((const __m256i *)(b + k));
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(bv, bv), _mm256_sign_epi8(av, bv));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    s = _mm_cvtsi128_si32(h);
#endif
    for (; k < K; ++k) s += (int32_t)a[k] * b[k];
    return s;
}

/* W8A8: out [M, N] = (xq [M, K] . W [N, K]) * xscale[m] * wscale[n] + bias[n], integer sums. */
void w8a8_linear(float *out, const int8_t *xq, const float *xscale, const int8_t *w,
                 const float *wscale, const float *bias, int64_t M, int64_t N, int64_t K,
                 int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        const int64_t n1 = N - n0 < NR ? N : n0 + NR;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) {
                float v = (float)dot_i8(xq + m * K, w + n * K, K) * (xscale[m] * wscale[n]);
                out[m * N + n] = bias ? v + bias[n] : v;
            }
    }
}
