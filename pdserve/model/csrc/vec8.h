/* Eight-float vectors and the vector math that the C kernels in model/csrc share. */
#ifndef PDSERVE_VEC8_H
#define PDSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

/* Eight floats: GCC's vector extension (AVX2 registers where the CPU has them, SSE pairs otherwise).
 * Loops over them keep independent accumulators where they can, because a single chain of adds waits
 * on its own latency: the decode attention's first, plain-loop version ran at a quarter of the memory
 * bandwidth. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The eight sums of eight vectors: out[i] = the sum of a[i]'s lanes, in pairs, then fours, then halves. */
static inline v8 sum8x8(const v8 a[8]) {
    typedef int32_t idx8 __attribute__((vector_size(32)));
    const idx8 evens = {0, 2, 8, 10, 4, 6, 12, 14}, odds = {1, 3, 9, 11, 5, 7, 13, 15};
    v8 pairs[4], fours[2];
    for (int i = 0; i < 4; i++)
        pairs[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], evens) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odds);
    for (int i = 0; i < 2; i++)
        fours[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], evens)
                   + __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], odds);
    const idx8 low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(fours[0], fours[1], low) + __builtin_shuffle(fours[0], fours[1], high);
}

#if defined(__FMA__)
#include <immintrin.h>
/* Spelled out rather than left to the compiler's contraction, so every copy of a loop rounds the same. */
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

typedef int32_t v8i __attribute__((vector_size(32)));
/* Sixteen lanes: one AVX-512 register, a pair of AVX2 ones elsewhere. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* e^x, a vector at a time: exp8 and exp16, lane for lane the same numbers. glibc's expf is scalar unless
 * -ffast-math, which we do not use, so as not to let the compiler reorder the sums (vectorized, a
 * 64-sequence step's attention went from 62.4 to 55.2 ms, docs/benchmarks.md). Cephes' method:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 polynomial, 2^n put in the exponent bits.
 * Within 1 ulp of the exact e^x over [-87.3, 88.3]. Outside, the ends: below -87.3 (e^x under the
 * smallest normal float) e^-87.3, not 0 (next to a softmax row's maximum term, e^0 = 1, far below a
 * rounding error; in SiLU, x / (1 + e^-x) is then x to the last bit); above 88.3, e^88.3 = 2.2e38, not
 * infinity (SiLU's x / (1 + e^-x) is then -0 to 1e-36). The NaN that arithmetic produces stays NaN. */
/* The reduction's and the polynomial's constants, shared with the softmax's e^x below. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define DEFINE_EXP(NAME, VT, VI)                                                                         \
static inline VT NAME(VT x) {                                                                            \
    const VT zero = {0};                                                                                 \
    const VT lo = zero - 87.3f, hi = zero + 88.3f;                                                       \
    const VI below = x < lo, above = x > hi;                                                             \
    x = (VT)(((VI)lo & below) | ((VI)x & ~below));                                                       \
    x = (VT)(((VI)hi & above) | ((VI)x & ~above));                                                       \
    /* Rounding to the nearest integer by adding 1.5 * 2^23: the sum's low mantissa bits are n. */       \
    const VT shifter = zero + 0x1.8p23f;                                                                 \
    const VT shifted = x * EXP_LOG2E + shifter;                                                          \
    const VT n = shifted - shifter;                                                                      \
    const VT r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;                                                  \
    VT p = r * EXP_P0 + EXP_P1;                                                                          \
    p = p * r + EXP_P2;                                                                                  \
    p = p * r + EXP_P3;                                                                                  \
    p = p * r + EXP_P4;                                                                                  \
    p = p * r + EXP_P5;                                                                                  \
    p = p * (r * r) + r + 1.0f;                                                                          \
    const VI ni = (VI)shifted - (VI)shifter;                                                             \
    return (VT)((VI)p + (ni << 23));                                                                     \
}
DEFINE_EXP(exp8, v8, v8i)
DEFINE_EXP(exp16, v16, v16i)

/* e^x for x <= 0, as a softmax takes it (x - its maximum): the method above in fused multiply-adds, the
 * last step as 1 + r (1 + r p), and no clamp above, which x <= 0 never reaches. Within 1 ulp over
 * [-87.3, 0] and e^0 = 1 exactly (tests/model/test_cpu_prefill_attention.py); a NaN that arithmetic made
 * stays NaN. Half the instructions of the one above, whose operations -ffp-contract=off keeps apart. */
#define DEFINE_EXP_NONPOSITIVE(NAME, VT, VI, FMA)                                                       \
static inline VT NAME(VT x) {                                                                            \
    const VT zero = {0};                                                                                 \
    const VT lo = zero - 87.3f;                                                                          \
    const VI below = x < lo;                                                                             \
    x = (VT)(((VI)lo & below) | ((VI)x & ~below));                                                       \
    const VT shifter = zero + 0x1.8p23f;                                                                 \
    const VT shifted = FMA(x, zero + EXP_LOG2E, shifter);                                                \
    const VT n = shifted - shifter;                                                                      \
    const VT r = FMA(n, zero - EXP_LN2_LO, FMA(n, zero - EXP_LN2_HI, x));                                \
    VT p = FMA(r, zero + EXP_P0, zero + EXP_P1);                                                         \
    p = FMA(p, r, zero + EXP_P2);                                                                        \
    p = FMA(p, r, zero + EXP_P3);                                                                        \
    p = FMA(p, r, zero + EXP_P4);                                                                        \
    p = FMA(p, r, zero + EXP_P5);                                                                        \
    p = FMA(r, FMA(r, p, zero + 1.0f), zero + 1.0f);                                                     \
    const VI ni = (VI)shifted - (VI)shifter;                                                             \
    return (VT)((VI)p + (ni << 23));                                                                     \
}
DEFINE_EXP_NONPOSITIVE(exp8_nonpositive, v8, v8i, fma8)
#if defined(__AVX512F__)
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
DEFINE_EXP_NONPOSITIVE(exp16_nonpositive, v16, v16i, fma16)
#endif

#endif
