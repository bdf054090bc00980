/* Eight-float vectors in GCC/Clang vector extensions: on x86-64 one AVX2 register with FMA
   contraction (the baseline: the build stops without AVX2 and FMA, and the kernels fall back to
   torch ops), with AVX-512 (-march=native on such a CPU, or TOKENMILL_CPU_ISA=avx512) the EVEX
   encodings and 32 registers; NEON pairs on Arm, plain loops elsewhere. Loads and stores go
   through memcpy, so nothing needs to be aligned. */
#pragma once
#if defined(__x86_64__) && !(defined(__AVX2__) && defined(__FMA__))
#error "the CPU kernels need AVX2 and FMA on x86-64"
#endif
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 loadv(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat(float c) { return (v8){0} + c; }
/* Lane-wise max / min that keep a NaN in a. */
static inline v8 vmax(v8 a, v8 b) { v8i m = b > a; return (v8)((m & (v8i)b) | (~m & (v8i)a)); }
static inline v8 vmin(v8 a, v8 b) { v8i m = b < a; return (v8)((m & (v8i)b) | (~m & (v8i)a)); }

static inline float hsum(v8 v) {
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s += v[j];
    return s;
}

/* The horizontal sums of a0..a3 into out[0..3]. */
static inline void hsum4(v8 a0, v8 a1, v8 a2, v8 a3, float *out) {
#if defined(__clang__) || __GNUC__ >= 12
    v8 h01 = __builtin_shufflevector(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14)
           + __builtin_shufflevector(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    v8 h23 = __builtin_shufflevector(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14)
           + __builtin_shufflevector(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    v8 h = __builtin_shufflevector(h01, h23, 0, 1, 8, 9, 4, 5, 12, 13)
         + __builtin_shufflevector(h01, h23, 2, 3, 10, 11, 6, 7, 14, 15);
    for (int k = 0; k < 4; ++k) out[k] = h[k] + h[k + 4];
#else
    out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
#endif
}

/* exp(x): Cephes-style range reduction and degree-6 polynomial, within about 2 ulp of expf.
   Inputs are clamped to [-87, 88]; below -87 the result is 0. */
static inline v8 vexp(v8 x) {
    const v8i tiny = x < -87.f;
    x = vmax(vmin(x, splat(88.f)), splat(-88.f));
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 fl = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
    fl -= (v8)((v8i)(fl > fx) & (v8i)splat(1.f));
    x = x - fl * 0.693359375f + fl * 2.12194440e-4f;
    const v8 z = x * x;
    v8 y = splat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.f;
    const v8i e = (__builtin_convertvector(fl, v8i) + 127) << 23;
    return (v8)((v8i)(y * (v8)e) & ~tiny);
}
