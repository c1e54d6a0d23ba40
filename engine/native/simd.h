/* What the kernels share: 8-float vectors, the register tiles of a matrix multiply over
 * weights packed in panels of 16 columns, a vectorized exponential, and the two passes of
 * a softmax over a row. */
#ifndef TOLLGATE_SIMD_H
#define TOLLGATE_SIMD_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* v8 at any float's address */
typedef int8_t v8c __attribute__((vector_size(8), aligned(1)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* v16 at any float's address */
#define NR 16 /* columns per panel: one vector of 16 (two of 8 where the CPU has no wider) */
#ifdef __AVX512F__
#define MR 8 /* rows of x per tile: 8 sums, a weight vector and an input in 32 registers */
#else
#define MR 6 /* rows of x per tile: 12 sums, 2 weight vectors and 1 input in 16 registers */
#endif

/* 8 int8 weights at p as floats. Written generically, GCC widens one element at a time. */
static inline v8 widen(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const v8c *)p, v8i), v8);
#endif
}

/* 16 int8 weights at p as floats. */
static inline v16 widen16(const int8_t *p) {
#ifdef __AVX512F__
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    const v8 lo = widen(p), hi = widen(p + 8);
    v16 both;
    memcpy(&both, &lo, 32);
    memcpy((char *)&both + 32, &hi, 32);
    return both;
#endif
}

/* dst[0 .. n) = the bfloat16 values at src as floats (a bfloat16 is a float's upper half). */
static inline void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t e = 0; e < n; e++) {
        const uint32_t bits = (uint32_t)src[e] << 16;
        memcpy(dst + e, &bits, sizeof(float));
    }
}

/* The weights of panel row k as one vector of 16 floats; the bytes of one panel row. */
#define LOAD_FLOAT_ROW_BYTES 64
#define LOAD_INT8_ROW_BYTES 16
#define LOAD_FLOAT(panel, k, w) const v16 w = ((const v16u *)(panel))[k]
#define LOAD_INT8(panel, k, w) const v16 w = widen16((const int8_t *)(panel) + 16 * (k))

/* y[R, 16 P] = x[R, depth] . P panels[depth, 16], each `next` bytes after the one before
 * (1 to 3 panels; `next` is unused for one): the tile's sums stay in registers while it
 * walks `depth`, and each input is broadcast once for all P panels. The sums are added into
 * y (or stored, when `first`), then multiplied by `scale` and `bias` added, each when given.
 * Rows of x and y are ldx and ldy floats apart. Given `ahead`, P panels of the same depth
 * and spacing, the tile asks for them (into L2) row by row as it walks. */
#define DEFINE_TILE(NAME, R, P, LOAD)                                                          \
    static void NAME(int64_t depth, const float *x, int64_t ldx, const void *panel,           \
                     int64_t next, float *y, int64_t ldy, int first, const float *scale,      \
                     const float *bias, const char *ahead) {                                   \
        v16 sums[R][P];                                                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++)                                    \
            _Pragma("GCC unroll 3") for (int g = 0; g < P; g++) sums[m][g] = (v16){0};         \
        for (int64_t k = 0; k < depth; k++) {                                                  \
            v16 w[P];                                                                          \
            _Pragma("GCC unroll 3") for (int g = 0; g < P; g++) {                              \
                if (ahead) __builtin_prefetch(ahead + g * next + k * LOAD##_ROW_BYTES, 0, 2);  \
                LOAD((const char *)panel + g * next, k, one);                                  \
                w[g] = one;                                                                    \
            }                                                                                  \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                              \
                const v16 a = (v16){0} + x[m * ldx + k];                                       \
                _Pragma("GCC unroll 3") for (int g = 0; g < P; g++) sums[m][g] += a * w[g];    \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                  \
            _Pragma("GCC unroll 3") for (int g = 0; g < P; g++) {                              \
                float *row = y + m * ldy + 16 * g;                                             \
                v16 sum = sums[m][g], more;                                                    \
                if (!first) memcpy(&more, row, 64), sum += more;                               \
                if (scale) memcpy(&more, scale + 16 * g, 64), sum *= more;                     \
                if (bias) memcpy(&more, bias + 16 * g, 64), sum += more;                       \
                memcpy(row, &sum, 64);                                                         \
            }                                                                                  \
        }                                                                                      \
    }

/* Tiles of P panels and 1 to 6 (or 8) rows, NAME_1 .. NAME_8, and a table of them by row
 * count; DEFINE_TILES and TILE_TABLE: one panel, 1 to MR rows. */
#define DEFINE_TILES_6(NAME, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_1, 1, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_2, 2, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_3, 3, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_4, 4, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_5, 5, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_6, 6, P, LOAD)
#define DEFINE_TILES_8(NAME, P, LOAD)                                                          \
    DEFINE_TILES_6(NAME, P, LOAD)                                                              \
    DEFINE_TILE(NAME##_7, 7, P, LOAD)                                                          \
    DEFINE_TILE(NAME##_8, 8, P, LOAD)
#define TILE_TABLE_6(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6}
#define TILE_TABLE_8(NAME)                                                                     \
    {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8}
#if MR == 8
#define DEFINE_TILES(NAME, LOAD) DEFINE_TILES_8(NAME, 1, LOAD)
#define TILE_TABLE(NAME) TILE_TABLE_8(NAME)
#else
#define DEFINE_TILES(NAME, LOAD) DEFINE_TILES_6(NAME, 1, LOAD)
#define TILE_TABLE(NAME) TILE_TABLE_6(NAME)
#endif

typedef void (*TileFn)(int64_t, const float *, int64_t, const void *, int64_t, float *, int64_t,
                       int, const float *, const float *, const char *);

/* e^x, 8 at a time: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by a degree-6
 * polynomial (relative error about 2e-7 over the range that does not overflow). */
static inline v8 exp8(v8 x) {
    const v8 hi = (v8){0} + 88.3762626647949f, lo = (v8){0} - 87.3365447504019f;
    v8i above = x > hi, below = x < lo;
    x = (v8)(((v8i)x & ~above) | ((v8i)hi & above));
    x = (v8)(((v8i)x & ~below) | ((v8i)lo & below));
    const v8 y = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(y, v8i);  /* toward zero */
    n += __builtin_convertvector(n, v8) > y;  /* floor: true is -1 */
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (v8)((n + 127) << 23);
}

/* The largest of s[0 .. n), n >= 1. */
static inline float max_of(const float *s, int64_t n) {
    const int64_t whole = n / 8 * 8;
    v8 tops = (v8){0} + s[0];
    for (int64_t t = 0; t < whole; t += 8) {
        v8 x;
        memcpy(&x, s + t, 32);
        const v8i greater = x > tops;
        tops = (v8)(((v8i)x & greater) | ((v8i)tops & ~greater));
    }
    float top = tops[0];
    for (int i = 1; i < 8; i++) top = tops[i] > top ? tops[i] : top;
    for (int64_t t = whole; t < n; t++) top = s[t] > top ? s[t] : top;
    return top;
}

/* s[t] = e^(s[t] - top) for t < n, in place (top >= every s[t]: no overflow); returns their
 * sum. The softmax of s, once divided by it. */
static inline float exp_minus(float *s, int64_t n, float top) {
    const int64_t whole = n / 8 * 8;
    v8 totals = (v8){0};
    for (int64_t t = 0; t < whole; t += 8) {
        v8 x;
        memcpy(&x, s + t, 32);
        x = exp8(x - top);
        totals += x;
        memcpy(s + t, &x, 32);
    }
    if (whole < n) { /* the last few, as one vector padded with zeros */
        v8 x = (v8){0};
        memcpy(&x, s + whole, sizeof(float) * (size_t)(n - whole));
        x = exp8(x - top);
        for (int i = n - whole; i < 8; i++) x[i] = 0.f;
        memcpy(s + whole, &x, sizeof(float) * (size_t)(n - whole));
        totals += x;
    }
    float total = 0.f;
    for (int i = 0; i < 8; i++) total += totals[i];
    return total;
}

#endif
