/* Rotary position embedding applied in place to query and key rows. */
#include <omp.h>
#include "vec.h"
#include "plan.h"

static inline void rotate(float *x, const float *cos, const float *sin, int64_t half, int neox) {
    const int64_t step = neox ? 1 : 2, offset = neox ? half : 1;
    for (int64_t i = 0; i < half; ++i) {
        float *a = x + i * step, *b = a + offset;
        const float x1 = *a, x2 = *b;
        *a = x1 * cos[i] - x2 * sin[i];
        *b = x2 * cos[i] + x1 * sin[i];
    }
}

/* q: [T, H*D] with row stride q_stride, k: [T, KVH*D] with row stride k_stride; cos_sin:
   [max_position, rot] holding rot/2 cosines then rot/2 sines per position. The first rot features
   of each head rotate: halves (neox) or interleaved pairs (GPT-J). */
void rotary_embedding_body(
    const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
    const float *cos_sin, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t rot, int neox) {
    const int64_t half = rot / 2;
    #pragma omp for
    for (int64_t t = 0; t < T; ++t) {
        const float *cos = cos_sin + positions[t] * rot, *sin = cos + half;
        for (int64_t h = 0; h < H; ++h) rotate(q + t * q_stride + h * D, cos, sin, half, neox);
        for (int64_t h = 0; h < KVH; ++h) rotate(k + t * k_stride + h * D, cos, sin, half, neox);
    }
}

void rotary_embedding(
    const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
    const float *cos_sin, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t rot, int neox) {
    #pragma omp parallel num_threads(omp_get_max_threads()) if (T * (H + KVH) * D >= 65536)
    rotary_embedding_body(positions, q, q_stride, k, k_stride, cos_sin, T, H, KVH, D, rot, neox);
}
