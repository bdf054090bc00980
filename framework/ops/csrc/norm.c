/* RMSNorm, alone and fused with the residual add before it, and the residual sum alone.
   Rows shared among the threads of the enclosing team (csrc/plan.h). */
#include <omp.h>
#include <math.h>
#include "vec.h"
#include "plan.h"

static inline void norm_row(float *out, const float *x, const float *w, int64_t N, float eps) {
    v8 ss = {0};
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) { const v8 v = loadv(x + i); ss += v * v; }
    float s = hsum(ss);
    for (; i < N; ++i) s += x[i] * x[i];
    const float inv = 1.f / sqrtf(s / (float)N + eps);
    i = 0;
    for (; i + 8 <= N; i += 8) storev(out + i, loadv(x + i) * inv * loadv(w + i));
    for (; i < N; ++i) out[i] = x[i] * inv * w[i];
}

/* out[t] = x[t] / rms(x[t]) * w; x and out are [T, N], contiguous. */
void rms_norm_body(float *out, const float *x, const float *w, int64_t T, int64_t N, float eps) {
    #pragma omp for
    for (int64_t t = 0; t < T; ++t) norm_row(out + t * N, x + t * N, w, N, eps);
}

void rms_norm(float *out, const float *x, const float *w, int64_t T, int64_t N, float eps) {
    #pragma omp parallel num_threads(omp_get_max_threads()) if (T * N >= 65536)
    rms_norm_body(out, x, w, T, N, eps);
}

/* In place: residual += x, then x = rms_norm(residual) * w (vLLM's fused_add_rms_norm). */
void fused_add_rms_norm_body(float *x, float *residual, const float *w, int64_t T, int64_t N, float eps) {
    #pragma omp for
    for (int64_t t = 0; t < T; ++t) {
        float *xr = x + t * N, *rr = residual + t * N;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) storev(rr + i, loadv(rr + i) + loadv(xr + i));
        for (; i < N; ++i) rr[i] += xr[i];
        norm_row(xr, rr, w, N, eps);
    }
}

void fused_add_rms_norm(float *x, float *residual, const float *w, int64_t T, int64_t N, float eps) {
    #pragma omp parallel num_threads(omp_get_max_threads()) if (T * N >= 65536)
    fused_add_rms_norm_body(x, residual, w, T, N, eps);
}

/* out[t] = x[t] + residual[t], or x[t] when residual is NULL; x and residual are [T, N],
   contiguous; out's rows are out_stride floats apart. */
void residual_sum(float *out, int64_t out_stride, const float *x, const float *residual, int64_t T, int64_t N) {
    #pragma omp for
    for (int64_t t = 0; t < T; ++t) {
        float *o = out + t * out_stride;
        const float *xr = x + t * N, *rr = residual ? residual + t * N : NULL;
        int64_t i = 0;
        if (rr) {
            for (; i + 8 <= N; i += 8) storev(o + i, loadv(xr + i) + loadv(rr + i));
            for (; i < N; ++i) o[i] = xr[i] + rr[i];
        } else {
            for (; i < N; ++i) o[i] = xr[i];
        }
    }
}
