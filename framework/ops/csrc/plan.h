/* Decode plans: a recorded sequence of kernel calls run by one C call in one OpenMP region.

   Each kernel a plan runs has a body (`<name>_body`, or the kernel itself where it never opened
   a region) whose loops are orphaned `omp for`s: inside a parallel region they bind to its team
   and share their iterations, and their implicit barriers order one kernel's writes before the
   next kernel's reads; called outside any region they run on the calling thread alone. Each
   kernel's own entry point opens a region of omp_get_max_threads() threads around its body, so
   a kernel called alone and the same kernel in a plan run one code path and give the same
   result. A body's serial setup is done by every thread for itself (no barrier), or by one
   (`omp single`) where its result is shared. */
#pragma once
#include <stdint.h>

#define PLAN_INTS 17
#define PLAN_FLOATS 2

/* One kernel call: the kernel's id (its index in plan.c's table) and its arguments in order,
   pointers and integers in `a`, floats in `f`. */
typedef struct {
    int64_t kernel;
    int64_t a[PLAN_INTS];
    float f[PLAN_FLOATS];
} plan_op;

void paged_decode_attention_body(
    const float *q, int64_t q_stride, const int64_t *rows, const void *key_cache, const void *value_cache,
    const int64_t *block_table, int64_t table_stride, const int64_t *seq_lens,
    float *out, int64_t B, int64_t H, int64_t kvh, int64_t D, int64_t bs,
    float scale, float v_scale, int kv_format, int64_t max_len, int64_t window);
void kv_cache_write(float *key_cache, float *value_cache, const int64_t *slots, const float *key,
                    int64_t key_stride, const float *value, int64_t value_stride, int64_t n, int64_t row);
void embedding(float *out, const float *table, const int64_t *ids, int64_t n, int64_t dim);
void rms_norm_body(float *out, const float *x, const float *w, int64_t T, int64_t N, float eps);
void fused_add_rms_norm_body(float *x, float *residual, const float *w, int64_t T, int64_t N, float eps);
void residual_sum(float *out, int64_t out_stride, const float *x, const float *residual, int64_t T, int64_t N);
void silu_and_mul_body(float *out, const float *x, int64_t T, int64_t d);
void rotary_embedding_body(
    const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
    const float *cos_sin, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t rot, int neox);
void gguf_matmul_body(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                      float *y, int64_t N);
void gguf_matmul_q8_body(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                         float *y, int64_t N);
void int8_linear_body(float *out, const float *x, int64_t ldx, const int8_t *w, const float *scale,
                      const float *bias, int64_t M, int64_t N, int64_t K);
void f32_linear_body(float *out, const float *x, int64_t ldx, const float *w, const float *bias,
                     int64_t M, int64_t N, int64_t K);
void int4_linear_body(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                      const float *minv, const float *bias, int64_t M, int64_t N, int64_t K,
                      int64_t group);
void quantize_rows_int8_body(int8_t *q, int64_t ldq, float *scale, const float *x, int64_t ldx,
                             int64_t M, int64_t K);
void w8a8_linear_body(float *out, int8_t *xq, const float *xscale, const int8_t *w,
                      const float *wscale, const float *bias, int64_t M, int64_t N, int64_t K);
void fp8_linear_body(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                     const float *bias, int64_t M, int64_t N, int64_t K);
