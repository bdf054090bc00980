/* Gated SiLU for fused gate/up projections. */
#include <omp.h>
#include <math.h>
#include "vec.h"
#include "plan.h"

/* out[t, i] = silu(x[t, i]) * x[t, d + i] for x [T, 2d], out [T, d], both contiguous. */
void silu_and_mul_body(float *out, const float *x, int64_t T, int64_t d) {
    #pragma omp for
    for (int64_t t = 0; t < T; ++t) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const v8 gv = loadv(g + i);
            storev(o + i, gv / (1.f + vexp(-gv)) * loadv(u + i));
        }
        for (; i < d; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void silu_and_mul(float *out, const float *x, int64_t T, int64_t d) {
    #pragma omp parallel num_threads(omp_get_max_threads()) if (T * d >= 65536)
    silu_and_mul_body(out, x, T, d);
}
