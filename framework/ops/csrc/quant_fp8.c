/* Linear layers on FP8 (e4m3fn) weights W [N, K] with one float scale per output row:
   out = x W^T * scale + bias, by quant_tile.h's streamed product; fp8_row widens a row for the
   dequantizer. */
#include <omp.h>
#include "quant_tile.h"
#include "plan.h"

/* e4m3fn bits s.eeee.mmm (bias 7) to float: the exponent and mantissa bits moved into a
   float's with the bias changed (exact for normal numbers); exponent 0 is subnormal,
   m * 2^-9, which is 2 * (f - 2^-7) of that f. The NaN codes (0x7f, 0xff) are not decoded. */
static inline v8 fp8_to_f32(const uint8_t *p) {
    const v8i i = widen_u8(p);
    const v8 f = (v8)(((i & 0x7f) << 20) + (120 << 23));
    const v8i sub = (i & 0x78) == 0;
    const v8 r = (v8)((sub & (v8i)(f * 2.f - 0x1p-6f)) | (~sub & (v8i)f));
    return (v8)((v8i)r | ((i & 0x80) << 24));
}

static inline float fp8_to_f32_1(uint8_t b) {
    union { uint32_t u; float f; } v = { .u = ((uint32_t)(b & 0x7f) << 20) + (120u << 23) };
    float r = (b & 0x78) ? v.f : 2.f * v.f - 0x1p-6f;
    return (b & 0x80) ? -r : r;
}

/* Row n of an FP8 weight W [N, K] as floats (unscaled). */
static void fp8_row(float *dst, const void *weights, int64_t n, int64_t K) {
    const uint8_t *w = (const uint8_t *)weights + n * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) storev(dst + k, fp8_to_f32(w + k));
    for (; k < K; ++k) dst[k] = fp8_to_f32_1(w[k]);
}

static inline v8 fp8_load8(const void *row, int64_t k) { return fp8_to_f32((const uint8_t *)row + k); }
static inline float fp8_load1(const void *row, int64_t k) { return fp8_to_f32_1(((const uint8_t *)row)[k]); }
STREAMED_LINEAR(fp8_streamed, fp8_load8, fp8_load1, 0)

/* out [M, N] = x [M, K] (row stride ldx) W^T * scale[n] + bias[n] (bias may be NULL). */
void fp8_linear_body(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                     const float *bias, int64_t M, int64_t N, int64_t K) {
    fp8_streamed(out, x, ldx, w, K, scale, bias, M, N, K);
}

void fp8_linear(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                const float *bias, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    fp8_linear_body(out, x, ldx, w, scale, bias, M, N, K);
}

/* out [N, K] = W * scale[n]. */
void fp8_dequantize(float *out, const uint8_t *w, const float *scale, int64_t N, int64_t K) {
    const int nthreads = omp_get_max_threads();
    dequantize_rows(out, fp8_row, w, scale, N, K, nthreads);
}
