/* float8 (e4m3fn, e5m2) to float32, eight values at a time, in integer arithmetic on the bits
   (no lookup table, no F16C): a normal number's exponent and mantissa bits shift into float32's
   place and the exponent is rebiased; a subnormal (exponent field 0) becomes the float32 normal
   with the format's smallest exponent, minus that exponent's power of two. Exact for every
   finite value; the caches never hold NaN (writes clamp). */
#pragma once
#include "vec.h"

enum { KV_F32 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

typedef uint8_t v8u8 __attribute__((vector_size(8)));

typedef struct {
    int shift;          /* 23 - mantissa bits */
    v8i bias, sub_bias; /* (127 - format bias) << 23, and one exponent step more */
    v8 sub_off;         /* 2^(1 - format bias): the smallest normal */
    v8i sub_below;      /* exponent-and-mantissa fields below this are subnormal */
} fp8_format;

static inline fp8_format fp8_format_of(int kind) {
    const int mbits = kind == KV_E4M3 ? 3 : 2, ebias = kind == KV_E4M3 ? 7 : 15;
    fp8_format f;
    f.shift = 23 - mbits;
    f.bias = (v8i){0} + ((127 - ebias) << 23);
    f.sub_bias = f.bias + (1 << 23);
    f.sub_off = splat(1.f / (float)(1 << (ebias - 1)));
    f.sub_below = (v8i){0} + (1 << mbits);
    return f;
}

static inline v8 fp8_load(const uint8_t *p, fp8_format f) {
    v8u8 b;
    memcpy(&b, p, sizeof b);
    const v8i x = __builtin_convertvector(b, v8i);
    const v8i em = x & 0x7F, bits = em << f.shift;
    const v8i normal = bits + f.bias;
    const v8i sub = (v8i)((v8)(bits + f.sub_bias) - f.sub_off);
    const v8i is_sub = em < f.sub_below;
    return (v8)((is_sub & sub) | (~is_sub & normal) | ((x & 0x80) << 24));
}

/* n (a multiple of 8) float8 values from src into dst as float32. */
static inline void fp8_to_f32(float *dst, const uint8_t *src, int64_t n, fp8_format f) {
    for (int64_t i = 0; i < n; i += 8) storev(dst + i, fp8_load(src + i, f));
}
