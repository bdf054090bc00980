/* Products with GGUF (llama.cpp) quantized weights kept as stored: Q4_0, Q4_1 and Q8_0 blocks of
   32 weights, each block a float16 scale d (Q4_1: and a float16 offset m) and its quants.

     Q4_0: 18 bytes, w = (q - 8) * d, q the low nibbles of bytes 0..15 then their high nibbles
     Q4_1: 20 bytes, w = q * d + m, nibbles as Q4_0
     Q8_0: 34 bytes, w = q * d, q int8

   A weight matrix is [N, row_bytes]: row o holds output o's K / 32 blocks. Output rows in
   parallel. Two products:
   - gguf_matmul: each block widened to float32 in registers and multiplied with float32
     activations (fp32 FMA), so the result is the float product with the dequantized weights, up
     to the order of the sums;
   - gguf_matmul_q8: llama.cpp's: each activation row first quantized to blocks of 32 int8 codes
     (quantize_q8), then every block's integer dot product summed in int32 (AVX2 maddubs)
     and scaled by both blocks' scales. */
#include <omp.h>
#include <math.h>
#include <stdlib.h>
#include "vec.h"
#include "plan.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8 };
#define QK 32

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    /* Exponent rebias by a multiply, which also normalises subnormals (F. Giesen's method). */
    union { uint32_t u; float f; } o = {(uint32_t)(h & 0x7fff) << 13}, magic = {(254u - 15u) << 23},
                                     infnan = {(127u + 16u) << 23};
    o.f *= magic.f;
    if (o.f >= infnan.f) o.u |= 255u << 23;
    o.u |= (uint32_t)(h & 0x8000) << 16;
    return o.f;
#endif
}

static inline int64_t block_bytes(int type) {
    return type == GGUF_Q4_0 ? 18 : type == GGUF_Q4_1 ? 20 : 34;
}

/* The 32 quants of one block as floats in w[0..3] (Q4_0 already minus 8), its scale in *d and
   offset (Q4_1; else 0) in *m. */
static inline __attribute__((always_inline)) void load_block(int type, const uint8_t *b, v8 w[4], float *d, float *m) {
    *d = f16_to_f32(b);
    *m = type == GGUF_Q4_1 ? f16_to_f32(b + 2) : 0.f;
#if defined(__AVX2__)
    if (type == GGUF_Q8_0) {
        for (int k = 0; k < 4; ++k)
            w[k] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k))));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == GGUF_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    if (type == GGUF_Q4_0) {
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
    }
    w[0] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#else
    float f[QK];
    if (type == GGUF_Q8_0) {
        for (int j = 0; j < QK; ++j) f[j] = (float)(int8_t)b[2 + j];
    } else {
        const uint8_t *qs = b + (type == GGUF_Q4_1 ? 4 : 2);
        const int off = type == GGUF_Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; ++j) {
            f[j] = (float)((qs[j] & 0x0f) - off);
            f[j + 16] = (float)((qs[j] >> 4) - off);
        }
    }
    for (int k = 0; k < 4; ++k) w[k] = loadv(f + 8 * k);
#endif
}

/* y[t * ldy] = sum_i W[o, i] x[t, i] for nt (<= 8) activation rows x [nt, K]; xsum [nt, K / 32]
   holds each block's sum of x (for the Q4_1 offsets). */
static inline __attribute__((always_inline)) void dot_rows(
    int type, const uint8_t *row, const float *x, int64_t K, const float *xsum, int nt, float *y, int64_t ldy) {
    const int64_t nb = K / QK, bb = block_bytes(type);
    v8 acc[8] = {{0}};
    float macc[8] = {0};
    for (int64_t b = 0; b < nb; ++b) {
        v8 w[4];
        float d, m;
        load_block(type, row + b * bb, w, &d, &m);
        for (int t = 0; t < nt; ++t) {
            const float *xt = x + t * K + b * QK;
            const v8 s = w[0] * loadv(xt) + w[1] * loadv(xt + 8) + w[2] * loadv(xt + 16) + w[3] * loadv(xt + 24);
            acc[t] += s * d;
            if (type == GGUF_Q4_1) macc[t] += m * xsum[t * nb + b];
        }
    }
    for (int t = 0; t < nt; ++t) y[t * ldy] = hsum(acc[t]) + macc[t];
}

/* y[t, o] for all T rows of x, in groups of up to 8 rows of x (each block is widened once per
   group). */
static inline __attribute__((always_inline)) void matmul_row(
    int type, const uint8_t *row, const float *x, int64_t T, int64_t K, const float *xsum, float *y, int64_t N) {
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const float *xt = x + t0 * K, *st = xsum + t0 * (K / QK);
        float *yt = y + t0 * N;
        switch (T - t0 >= 8 ? 8 : (int)(T - t0)) {
            case 8: dot_rows(type, row, xt, K, st, 8, yt, N); break;
            case 7: dot_rows(type, row, xt, K, st, 7, yt, N); break;
            case 6: dot_rows(type, row, xt, K, st, 6, yt, N); break;
            case 5: dot_rows(type, row, xt, K, st, 5, yt, N); break;
            case 4: dot_rows(type, row, xt, K, st, 4, yt, N); break;
            case 3: dot_rows(type, row, xt, K, st, 3, yt, N); break;
            case 2: dot_rows(type, row, xt, K, st, 2, yt, N); break;
            default: dot_rows(type, row, xt, K, st, 1, yt, N); break;
        }
    }
}

/* y [T, N] = x [T, K] @ W.T for W [N, row_bytes] of GGUF type `type` (Q4_0, Q4_1 or Q8_0: the
   caller checks); K a multiple of 32; x and y contiguous float32. The body shares the output rows
   among the threads of the enclosing team (csrc/plan.h); each thread sums x's blocks itself. */
void gguf_matmul_body(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                      float *y, int64_t N) {
    float *xsum = malloc(sizeof(float) * (size_t)(T * (K / QK) + 1));
    for (int64_t i = 0; i < T * (K / QK); ++i) {
        const float *xb = x + i * QK;
        xsum[i] = hsum(loadv(xb) + loadv(xb + 8) + loadv(xb + 16) + loadv(xb + 24));
    }
    /* The type is switched on inside the loop so each case is compiled for its type. */
    #pragma omp for schedule(static)
    for (int64_t o = 0; o < N; ++o) {
        const uint8_t *row = w + o * row_bytes;
        switch (type) {
            case GGUF_Q4_0: matmul_row(GGUF_Q4_0, row, x, T, K, xsum, y + o, N); break;
            case GGUF_Q4_1: matmul_row(GGUF_Q4_1, row, x, T, K, xsum, y + o, N); break;
            default: matmul_row(GGUF_Q8_0, row, x, T, K, xsum, y + o, N); break;
        }
    }
    free(xsum);
}

void gguf_matmul(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                 float *y, int64_t N) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    gguf_matmul_body(type, w, row_bytes, x, T, K, y, N);
}

static inline __attribute__((always_inline)) void dequantize_row(int type, const uint8_t *row, int64_t K, float *out) {
    const int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < K / QK; ++b) {
        v8 q[4];
        float d, m;
        load_block(type, row + b * bb, q, &d, &m);
        for (int k = 0; k < 4; ++k) storev(out + b * QK + 8 * k, q[k] * d + m);
    }
}

/* out [N, K] float32 = the weights of W [N, row_bytes] (types as gguf_matmul). */
void gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, float *out) {
    const int nthreads = omp_get_max_threads();
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < N; ++o) {
        switch (type) {
            case GGUF_Q4_0: dequantize_row(GGUF_Q4_0, w + o * row_bytes, K, out + o * K); break;
            case GGUF_Q4_1: dequantize_row(GGUF_Q4_1, w + o * row_bytes, K, out + o * K); break;
            default: dequantize_row(GGUF_Q8_0, w + o * row_bytes, K, out + o * K); break;
        }
    }
}

/* Activation rows as llama.cpp quantizes them for these products: per block of 32, the scale
   d = max|x| / 127, codes q = round(x / d) (to nearest even, via x * (1 / d); all 0 for a zero
   block) and s = d * sum(q), the block sum the Q4_1 offsets and the Q4_0 shift multiply. */
static void quantize_q8(const float *x, int64_t nblocks, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const float *xb = x + b * QK;
        v8 amax = {0};
        for (int k = 0; k < QK; k += 8) {
            const v8 v = loadv(xb + k);
            amax = vmax(amax, vmax(v, -v));
        }
        float m = 0.f;
        for (int j = 0; j < 8; ++j) m = m > amax[j] ? m : amax[j];
        const float db = m / 127.f, id = m > 0.f ? 1.f / db : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; ++j) {
            const int c = (int)nearbyintf(xb[j] * id);
            q[b * QK + j] = (int8_t)c;
            sum += c;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* One weight block's codes as 32 bytes, code j at byte j: Q4_1's unsigned nibbles, Q4_0's
   nibbles minus 8 and Q8_0's int8. */
#if defined(__AVX2__)
typedef __m256i codes;
#else
typedef struct { int8_t v[QK]; } codes;
#endif

#if defined(__AVX2__)
static inline codes block_codes(int type, const uint8_t *b) {
    if (type == GGUF_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == GGUF_Q4_1 ? 4 : 2)));
    const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    return type == GGUF_Q4_0 ? _mm256_sub_epi8(n, _mm256_set1_epi8(8)) : n;
}

/* The eight int32 partial sums of w . x as floats; Q4_1's w are in [0, 15], so maddubs takes
   them as the unsigned operand directly, signed w lend x their sign and give maddubs |w| (no
   pair of products exceeds 2 * 128 * 127, so nothing saturates). */
static inline v8 block_dot(int type, codes w, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (type != GGUF_Q4_1) {
        x = _mm256_sign_epi8(x, w);
        w = _mm256_sign_epi8(w, w);
    }
    return (v8)_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#else
static inline codes block_codes(int type, const uint8_t *b) {
    codes c;
    if (type == GGUF_Q8_0) {
        memcpy(c.v, b + 2, QK);
        return c;
    }
    const uint8_t *qs = b + (type == GGUF_Q4_1 ? 4 : 2);
    const int off = type == GGUF_Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
        c.v[j] = (int8_t)((qs[j] & 0x0f) - off);
        c.v[j + 16] = (int8_t)((qs[j] >> 4) - off);
    }
    return c;
}

static inline v8 block_dot(int type, codes w, const int8_t *xq) {
    (void)type;
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) s += (int32_t)w.v[j] * xq[j];
    return (v8){(float)s};
}
#endif

/* y[t * ldy] = sum over blocks of d_w * d_x * (w . x) (+ m_w * s_x for Q4_1; Q4_0's shift is in
   its codes) for nt (<= 8) quantized activation rows. */
static inline __attribute__((always_inline)) void dot_rows_q8(
    int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd, const float *xs,
    int nt, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(type);
    v8 acc[8] = {{0}};
    float macc[8] = {0};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        const float d = f16_to_f32(blk);
        const float m = type == GGUF_Q4_1 ? f16_to_f32(blk + 2) : 0.f;
        const codes c = block_codes(type, blk);
        for (int t = 0; t < nt; ++t) {
            const int64_t i = t * nb + b;
            acc[t] += block_dot(type, c, xq + i * QK) * (d * xd[i]);
            if (type == GGUF_Q4_1) macc[t] += m * xs[i];
        }
    }
    for (int t = 0; t < nt; ++t) y[t * ldy] = hsum(acc[t]) + macc[t];
}

static inline __attribute__((always_inline)) void matmul_row_q8(
    int type, const uint8_t *row, int64_t T, int64_t nb, const int8_t *xq, const float *xd,
    const float *xs, float *y, int64_t N) {
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int8_t *q = xq + t0 * nb * QK;
        const float *d = xd + t0 * nb, *s = xs + t0 * nb;
        float *yt = y + t0 * N;
        switch (T - t0 >= 8 ? 8 : (int)(T - t0)) {
            case 8: dot_rows_q8(type, row, nb, q, d, s, 8, yt, N); break;
            case 7: dot_rows_q8(type, row, nb, q, d, s, 7, yt, N); break;
            case 6: dot_rows_q8(type, row, nb, q, d, s, 6, yt, N); break;
            case 5: dot_rows_q8(type, row, nb, q, d, s, 5, yt, N); break;
            case 4: dot_rows_q8(type, row, nb, q, d, s, 4, yt, N); break;
            case 3: dot_rows_q8(type, row, nb, q, d, s, 3, yt, N); break;
            case 2: dot_rows_q8(type, row, nb, q, d, s, 2, yt, N); break;
            default: dot_rows_q8(type, row, nb, q, d, s, 1, yt, N); break;
        }
    }
}

/* As gguf_matmul, with x quantized by quantize_q8 first (by every thread of the team into its
   own buffer: no barrier, and a small share of the product's work) and integer block products. */
void gguf_matmul_q8_body(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                         float *y, int64_t N) {
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(T * K));
    float *xd = malloc(sizeof(float) * (size_t)(2 * T * nb + 1)), *xs = xd + T * nb;
    quantize_q8(x, T * nb, xq, xd, xs);
    #pragma omp for schedule(static)
    for (int64_t o = 0; o < N; ++o) {
        const uint8_t *row = w + o * row_bytes;
        switch (type) {
            case GGUF_Q4_0: matmul_row_q8(GGUF_Q4_0, row, T, nb, xq, xd, xs, y + o, N); break;
            case GGUF_Q4_1: matmul_row_q8(GGUF_Q4_1, row, T, nb, xq, xd, xs, y + o, N); break;
            default: matmul_row_q8(GGUF_Q8_0, row, T, nb, xq, xd, xs, y + o, N); break;
        }
    }
    free(xq);
    free(xd);
}

void gguf_matmul_q8(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t T, int64_t K,
                    float *y, int64_t N) {
    #pragma omp parallel num_threads(omp_get_max_threads())
    gguf_matmul_q8_body(type, w, row_bytes, x, T, K, y, N);
}
