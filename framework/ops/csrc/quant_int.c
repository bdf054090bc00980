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
#include <omp.h>
#include <math.h>
#include "quant_tile.h"
#include "plan.h"

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
STREAMED_LINEAR(int8_streamed, int8_load8, int8_load1, 0)
STREAMED_LINEAR(f32_streamed, f32_load8, f32_load1, 1)

/* Weight-only int8: out [M, N] = x [M, K] (row stride ldx) W^T * scale[n] + bias[n], the codes
   converted in registers. */
void int8_linear_body(float *out, const float *x, int64_t ldx, const int8_t *w, const float *scale,
                      const float *bias, int64_t M, int64_t N, int64_t K) {
    int8_streamed(out, x, ldx, w, K, scale, bias, M, N, K);
}

void int8_linear(float *out, const float *x, int64_t ldx, const int8_t *w, const float *scale,
                 const float *bias, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    int8_linear_body(out, x, ldx, w, scale, bias, M, N, K);
}

/* Float32 weights: out [M, N] = x [M, K] (row stride ldx) W^T + bias[n] (may be NULL). */
void f32_linear_body(float *out, const float *x, int64_t ldx, const float *w, const float *bias,
                     int64_t M, int64_t N, int64_t K) {
    f32_streamed(out, x, ldx, w, K * (int64_t)sizeof(float), NULL, bias, M, N, K);
}

void f32_linear(float *out, const float *x, int64_t ldx, const float *w, const float *bias,
                int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    f32_linear_body(out, x, ldx, w, bias, M, N, K);
}

/* out [N, K] = W * scale[n]. */
void int8_dequantize(float *out, const int8_t *w, const float *scale, int64_t N, int64_t K) {
    const int nthreads = omp_get_max_threads();
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
void int4_linear_body(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                      const float *minv, const float *bias, int64_t M, int64_t N, int64_t K,
                      int64_t group) {
    const int4_weights weights = {w, scale, minv, group};
    tiled_linear(out, x, ldx, int4_widen, &weights, NULL, bias, M, N, K);
}

void int4_linear(float *out, const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                 const float *minv, const float *bias, int64_t M, int64_t N, int64_t K,
                 int64_t group) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    int4_linear_body(out, x, ldx, w, scale, minv, bias, M, N, K, group);
}

/* out [N, K] = the float weight of a group-wise int4 one. */
void int4_dequantize(float *out, const uint8_t *w, const float *scale, const float *minv,
                     int64_t N, int64_t K, int64_t group) {
    const int nthreads = omp_get_max_threads();
    const int4_weights weights = {w, scale, minv, group};
    dequantize_rows(out, int4_widen, &weights, NULL, N, K, nthreads);
}

/* Dynamic symmetric per-row int8: scale[m] = max|x[m]| / 127 (1 for a zero row),
   q[m, k] = round(x[m, k] / scale[m]) in [-127, 127]; row m at q + m * ldq, zero from K to ldq. */
void quantize_rows_int8_body(int8_t *q, int64_t ldq, float *scale, const float *x, int64_t ldx,
                             int64_t M, int64_t K) {
    #pragma omp for
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * ldx;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(xr[k]));
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        scale[m] = s;
        int8_t *qr = q + m * ldq;
        for (int64_t k = 0; k < K; ++k) qr[k] = (int8_t)nearbyintf(xr[k] / s);
        for (int64_t k = K; k < ldq; ++k) qr[k] = 0;
    }
}

void quantize_rows_int8(int8_t *q, int64_t ldq, float *scale, const float *x, int64_t ldx,
                        int64_t M, int64_t K) {
    #pragma omp parallel num_threads(omp_get_max_threads()) if (M * K >= 65536)
    quantize_rows_int8_body(q, ldq, scale, x, ldx, M, K);
}

/* W8A8 weights in panels (the layout `quant/int8.py` packs): panel p holds weight rows 16p ..
   16p + 15, four columns at a time, byte ((p * K4 + c) * 16 + j) * 4 + t = W[16p + j, 4c + t]
   (zero past N and K; K4 = ceil(K / 4)). One 64-byte vector is then four columns of sixteen
   rows, the operand of VNNI's vpdpbusd (or two of AVX2's), against four bytes of an input row
   broadcast to every lane: no horizontal sums. */
#define W8_PANEL 16
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* vpdpbusd multiplies unsigned by signed bytes: the codes x go in as x + 128, and 128 times
   each weight row's sum comes off the int32 sums. */
#define W8_MR 8
#define W8_NP 3
#define W8_OFFSET 128
#elif defined(__AVX2__)
/* maddubs multiplies unsigned by signed bytes into saturating int16 pair sums: |w| times x with
   w's sign, at most 2 * 127 * 127 per pair, never saturates. */
#define W8_MR 3
#define W8_NP 1
#define W8_OFFSET 0
#else
#define W8_MR 1
#define W8_NP 1
#define W8_OFFSET 0
#endif

/* acc[m][16p + j] = sum_k xq[m, k] * W[16p + j, k] for m < mr, p < np (xq offset by W8_OFFSET). */
static inline __attribute__((always_inline)) void
w8a8_tile(int32_t acc[W8_MR][W8_NP * W8_PANEL], const int8_t *xq, int64_t ldq, const int mr,
          const int8_t *panels, const int np, int64_t K4) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a[W8_MR][W8_NP];
    for (int m = 0; m < mr; ++m)
        for (int p = 0; p < np; ++p) a[m][p] = _mm512_setzero_si512();
    for (int64_t c = 0; c < K4; ++c) {
        __m512i w[W8_NP];
        for (int p = 0; p < np; ++p) w[p] = _mm512_loadu_si512(panels + (p * K4 + c) * 64);
        for (int m = 0; m < mr; ++m) {
            int32_t four;
            memcpy(&four, xq + m * ldq + 4 * c, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int p = 0; p < np; ++p) a[m][p] = _mm512_dpbusd_epi32(a[m][p], xb, w[p]);
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int p = 0; p < np; ++p) _mm512_storeu_si512(acc[m] + p * W8_PANEL, a[m][p]);
#elif defined(__AVX2__)
    __m256i a[W8_MR][2 * W8_NP];
    for (int m = 0; m < mr; ++m)
        for (int h = 0; h < 2 * np; ++h) a[m][h] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < K4; ++c) {
        __m256i w[2 * W8_NP], aw[2 * W8_NP];
        for (int h = 0; h < 2 * np; ++h) {
            w[h] = _mm256_loadu_si256((const __m256i *)(panels + ((h / 2) * K4 + c) * 64 + (h % 2) * 32));
            aw[h] = _mm256_abs_epi8(w[h]);
        }
        for (int m = 0; m < mr; ++m) {
            int32_t four;
            memcpy(&four, xq + m * ldq + 4 * c, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            for (int h = 0; h < 2 * np; ++h) {
                const __m256i pairs = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xb, w[h]));
                a[m][h] = _mm256_add_epi32(a[m][h], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int h = 0; h < 2 * np; ++h) _mm256_storeu_si256((__m256i *)(acc[m] + h * 8), a[m][h]);
#else
    for (int m = 0; m < mr; ++m)
        for (int p = 0; p < np; ++p)
            for (int j = 0; j < W8_PANEL; ++j) {
                int32_t s = 0;
                for (int64_t c = 0; c < K4; ++c)
                    for (int t = 0; t < 4; ++t)
                        s += (int32_t)xq[m * ldq + 4 * c + t] * panels[((p * K4 + c) * W8_PANEL + j) * 4 + t];
                acc[m][p * W8_PANEL + j] = s;
            }
#endif
}

/* offset[16p + j] = W8_OFFSET * sum_k W[16p + j, k], what the offset codes add to the sums. */
static void w8a8_offsets(int32_t offset[W8_NP * W8_PANEL], const int8_t *panels, int np, int64_t K4) {
#if W8_OFFSET
    const __m512i off = _mm512_set1_epi8((char)W8_OFFSET);
    for (int p = 0; p < np; ++p) {
        __m512i s = _mm512_setzero_si512();
        for (int64_t c = 0; c < K4; ++c)
            s = _mm512_dpbusd_epi32(s, off, _mm512_loadu_si512(panels + (p * K4 + c) * 64));
        _mm512_storeu_si512(offset + p * W8_PANEL, s);
    }
#else
    (void)offset, (void)panels, (void)np, (void)K4;
#endif
}

#define W8_CASE(MRV, NPV) \
    case (MRV) * 4 + (NPV): w8a8_tile(acc, xq + m0 * ldq, ldq, MRV, panels, NPV, K4); break;
#if W8_MR == 8 && W8_NP == 3
#define W8_ROW(MRV) W8_CASE(MRV, 1) W8_CASE(MRV, 2) W8_CASE(MRV, 3)
#define W8_CASES W8_ROW(1) W8_ROW(2) W8_ROW(3) W8_ROW(4) W8_ROW(5) W8_ROW(6) W8_ROW(7) W8_ROW(8)
#elif W8_MR == 3
#define W8_CASES W8_CASE(1, 1) W8_CASE(2, 1) W8_CASE(3, 1)
#else
#define W8_CASES W8_CASE(1, 1)
#endif

/* W8A8: out [M, N] = (xq [M, K] . W [N, K]) * xscale[m] * wscale[n] + bias[n], integer sums;
   W in panels (above), xq rows ldq = 4 * K4 bytes apart (offset by W8_OFFSET in place first).
   Threads take groups of W8_NP panels; each runs every row tile of the input over its group
   while the group sits in cache. */
void w8a8_linear_body(float *out, int8_t *xq, const float *xscale, const int8_t *w,
                      const float *wscale, const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t K4 = (K + 3) / 4, ldq = 4 * K4, P = (N + W8_PANEL - 1) / W8_PANEL;
    const int64_t groups = (P + W8_NP - 1) / W8_NP;
    if (W8_OFFSET) {
        #pragma omp for
        for (int64_t i = 0; i < M * ldq; ++i) xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80);
    }
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t p0 = g * W8_NP;
        const int np = (int)(P - p0 < W8_NP ? P - p0 : W8_NP);
        const int8_t *panels = w + p0 * K4 * 64;
        int32_t acc[W8_MR][W8_NP * W8_PANEL];
        int32_t offset[W8_NP * W8_PANEL] = {0};
        w8a8_offsets(offset, panels, np, K4);
        for (int64_t m0 = 0; m0 < M; m0 += W8_MR) {
            const int mr = (int)(M - m0 < W8_MR ? M - m0 : W8_MR);
            switch (mr * 4 + np) { W8_CASES }
            for (int m = 0; m < mr; ++m)
                for (int64_t n = p0 * W8_PANEL; n < N && n < (p0 + np) * W8_PANEL; ++n) {
                    const int64_t j = n - p0 * W8_PANEL;
                    const float v = (float)(acc[m][j] - offset[j]) * (xscale[m0 + m] * wscale[n]);
                    out[(m0 + m) * N + n] = bias ? v + bias[n] : v;
                }
        }
    }
}

void w8a8_linear(float *out, int8_t *xq, const float *xscale, const int8_t *w,
                 const float *wscale, const float *bias, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    w8a8_linear_body(out, xq, xscale, w, wscale, bias, M, N, K);
}
