/* run_plan: a decode plan's kernel calls in one OpenMP region (csrc/plan.h). */
#include <omp.h>
#include <stddef.h>
#include "plan.h"

/* The kernels a plan can call, by id. */
static const char *const KERNELS[] = {
    "paged_decode_attention", "kv_cache_write", "embedding", "rms_norm", "fused_add_rms_norm",
    "residual_sum", "silu_and_mul", "rotary_embedding", "gguf_matmul", "gguf_matmul_q8",
    "int8_linear", "f32_linear", "int4_linear", "quantize_rows_int8", "w8a8_linear", "fp8_linear",
};

/* The name of kernel `id`, NULL past the last: how the caller numbers the kernels. */
const char *plan_kernel(int64_t id) {
    return id >= 0 && id < (int64_t)(sizeof KERNELS / sizeof *KERNELS) ? KERNELS[id] : NULL;
}

#define P(i) ((void *)(intptr_t)o->a[i])
#define I(i) (o->a[i])

static void run_op(const plan_op *o) {
    switch (o->kernel) {
        case 0:
            paged_decode_attention_body(P(0), I(1), P(2), P(3), P(4), P(5), I(6), P(7), P(8), I(9), I(10), I(11),
                                        I(12), I(13), o->f[0], o->f[1], (int)I(14), I(15), I(16));
            break;
        case 1: kv_cache_write(P(0), P(1), P(2), P(3), I(4), P(5), I(6), I(7), I(8)); break;
        case 2: embedding(P(0), P(1), P(2), I(3), I(4)); break;
        case 3: rms_norm_body(P(0), P(1), P(2), I(3), I(4), o->f[0]); break;
        case 4: fused_add_rms_norm_body(P(0), P(1), P(2), I(3), I(4), o->f[0]); break;
        case 5: residual_sum(P(0), I(1), P(2), P(3), I(4), I(5)); break;
        case 6: silu_and_mul_body(P(0), P(1), I(2), I(3)); break;
        case 7:
            rotary_embedding_body(P(0), P(1), I(2), P(3), I(4), P(5), I(6), I(7), I(8), I(9), I(10), (int)I(11));
            break;
        case 8: gguf_matmul_body((int)I(0), P(1), I(2), P(3), I(4), I(5), P(6), I(7)); break;
        case 9: gguf_matmul_q8_body((int)I(0), P(1), I(2), P(3), I(4), I(5), P(6), I(7)); break;
        case 10: int8_linear_body(P(0), P(1), I(2), P(3), P(4), P(5), I(6), I(7), I(8)); break;
        case 11: f32_linear_body(P(0), P(1), I(2), P(3), P(4), I(5), I(6), I(7)); break;
        case 12: int4_linear_body(P(0), P(1), I(2), P(3), P(4), P(5), P(6), I(7), I(8), I(9), I(10)); break;
        case 13: quantize_rows_int8_body(P(0), I(1), P(2), P(3), I(4), I(5), I(6)); break;
        case 14: w8a8_linear_body(P(0), P(1), P(2), P(3), P(4), P(5), I(6), I(7), I(8)); break;
        default: fp8_linear_body(P(0), P(1), I(2), P(3), P(4), P(5), I(6), I(7), I(8)); break;
    }
}

/* The n calls of `ops` in order, on omp_get_max_threads() threads (read at every call, as each
   kernel does): one parallel region, each kernel's loops shared by its team, a barrier after
   each. */
void run_plan(const plan_op *ops, int64_t n) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    for (int64_t i = 0; i < n; ++i) run_op(&ops[i]);
}
