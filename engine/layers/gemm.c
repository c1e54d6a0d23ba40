/* Matrix multiply for linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * W is packed once, in panels of 16 output features: panels[p, k, j] = W[16 p + j, k], rows
 * past N zero. Weights are float32, or int8 with one float32 scale per output feature
 * (y = (x . Q^T) * scale + bias), widened to float32 in registers. A tile of up to 6 rows of x by one panel keeps its 6 x 16 sums in registers
 * while it walks K: each step loads 16 weights, broadcasts 6 inputs and does 12 vector
 * multiply-adds. So each weight read from memory serves every row of x, which is what
 * decode steps (a few rows against all of a layer's weights) are bound by.
 *
 * Threads split the panels; x is walked in blocks of MC rows by KC columns, so the block of
 * x a thread rereads for each panel stays in its L2 cache.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* v8 at any float's address */
typedef int8_t v8c __attribute__((vector_size(8), aligned(1)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define NR 16  /* output features per panel: two vectors of 8 */
#define MR 6   /* rows of x per tile: 12 sums, 2 weight vectors and 1 input in 16 registers */
#define KC 512 /* columns of x per block */
#define MC 128 /* rows of x per block */

/* 8 int8 weights at p as floats. Written generically, GCC widens one element at a time. */
static inline v8 widen(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const v8c *)p, v8i), v8);
#endif
}

/* The weights of panel row k as two vectors of 8 floats. */
#define LOAD_FLOAT(panel, k, w0, w1)                                                           \
    const v8 w0 = ((const v8u *)(panel))[2 * (k)], w1 = ((const v8u *)(panel))[2 * (k) + 1]
#define LOAD_INT8(panel, k, w0, w1)                                                            \
    const v8 w0 = widen((const int8_t *)(panel) + 16 * (k)),                                   \
             w1 = widen((const int8_t *)(panel) + 16 * (k) + 8)

/* Adds the tile's product over `depth` columns into y (or stores it, when `first`), then
 * multiplies by `scale` and adds `bias`, each when given (the last block of columns). */
#define DEFINE_TILE(NAME, R, LOAD)                                                             \
    static void NAME(int64_t depth, const float *x, int64_t ldx, const void *panel, float *y,   \
                     int64_t ldy, int first, const float *scale, const float *bias) {          \
        v8 sums[R][2];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) sums[m][0] = sums[m][1] = (v8){0}; \
        for (int64_t k = 0; k < depth; k++) {                                                  \
            LOAD(panel, k, w0, w1);                                                            \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                              \
                const v8 a = (v8){0} + x[m * ldx + k];                                         \
                sums[m][0] += a * w0;                                                          \
                sums[m][1] += a * w1;                                                          \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                  \
            float *row = y + m * ldy;                                                          \
            v8 lo = sums[m][0], hi = sums[m][1], other;                                        \
            if (!first) {                                                                      \
                memcpy(&other, row, 32), lo += other;                                          \
                memcpy(&other, row + 8, 32), hi += other;                                      \
            }                                                                                  \
            if (scale) {                                                                       \
                memcpy(&other, scale, 32), lo *= other;                                        \
                memcpy(&other, scale + 8, 32), hi *= other;                                    \
            }                                                                                  \
            if (bias) {                                                                        \
                memcpy(&other, bias, 32), lo += other;                                         \
                memcpy(&other, bias + 8, 32), hi += other;                                     \
            }                                                                                  \
            memcpy(row, &lo, 32);                                                              \
            memcpy(row + 8, &hi, 32);                                                          \
        }                                                                                      \
    }

#define DEFINE_TILES(KIND, LOAD)                                                               \
    DEFINE_TILE(KIND##_1, 1, LOAD)                                                             \
    DEFINE_TILE(KIND##_2, 2, LOAD)                                                             \
    DEFINE_TILE(KIND##_3, 3, LOAD)                                                             \
    DEFINE_TILE(KIND##_4, 4, LOAD)                                                             \
    DEFINE_TILE(KIND##_5, 5, LOAD)                                                             \
    DEFINE_TILE(KIND##_6, 6, LOAD)

DEFINE_TILES(float_tile, LOAD_FLOAT)
DEFINE_TILES(int8_tile, LOAD_INT8)

typedef void (*TileFn)(int64_t, const float *, int64_t, const void *, float *, int64_t, int,
                       const float *, const float *);

/* How to multiply by one kind of weight: its tiles by row count, and its element size. */
typedef struct {
    TileFn tiles[MR + 1];
    int64_t element_size;
} Weights;

static const Weights FLOAT_WEIGHTS = {{0, float_tile_1, float_tile_2, float_tile_3, float_tile_4,
                                       float_tile_5, float_tile_6},
                                      4};
static const Weights INT8_WEIGHTS = {{0, int8_tile_1, int8_tile_2, int8_tile_3, int8_tile_4,
                                      int8_tile_5, int8_tile_6},
                                     1};

/* `rows` rows of x (one block) by one panel, `width` of whose 16 features are real. */
static void rows_by_panel(const Weights *kind, int64_t rows, int64_t depth, const float *x,
                          int64_t K, const void *panel, float *y, int64_t N, int64_t width,
                          int first, const float *scale, const float *bias) {
    for (int64_t m = 0; m < rows; m += MR) {
        const int r = (int)(rows - m < MR ? rows - m : MR);
        if (width == NR) {
            kind->tiles[r](depth, x + m * K, K, panel, y + m * N, N, first, scale, bias);
            continue;
        }
        /* A last panel narrower than 16 goes through a full-width scratch tile. */
        float scratch[MR * NR] = {0}, padded_scale[NR] = {0}, padded_bias[NR] = {0};
        for (int i = 0; i < r; i++)
            if (!first) memcpy(scratch + i * NR, y + (m + i) * N, sizeof(float) * width);
        if (scale) memcpy(padded_scale, scale, sizeof(float) * width);
        if (bias) memcpy(padded_bias, bias, sizeof(float) * width);
        kind->tiles[r](depth, x + m * K, K, panel, scratch, NR, 0, scale ? padded_scale : 0,
                       bias ? padded_bias : 0);
        for (int i = 0; i < r; i++)
            memcpy(y + (m + i) * N, scratch + i * NR, sizeof(float) * width);
    }
}

static void gemm(const Weights *kind, const float *x, const void *panels, const float *scale,
                 const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t start = 0, stop = num_panels;
#ifdef _OPENMP
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        start = num_panels * me / team;
        stop = num_panels * (me + 1) / team;
#endif
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t depth = K - k0 < KC ? K - k0 : KC;
            const int last = k0 + depth == K;
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t rows = M - m0 < MC ? M - m0 : MC;
                for (int64_t p = start; p < stop; p++) {
                    const int64_t n = p * NR, width = N - n < NR ? N - n : NR;
                    const char *panel =
                        (const char *)panels + (p * K + k0) * NR * kind->element_size;
                    rows_by_panel(kind, rows, depth, x + m0 * K + k0, K, panel, y + m0 * N + n,
                                  N, width, k0 == 0, last && scale ? scale + n : 0,
                                  last && bias ? bias + n : 0);
                }
            }
        }
    }
}

/* x: [M, K], panels: [ceil(N / 16), K, 16], bias: [N] or NULL, y: [M, N]; all contiguous
 * float32. */
void tollgate_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t M,
                   int64_t N, int64_t K, int threads) {
    gemm(&FLOAT_WEIGHTS, x, panels, 0, bias, y, M, N, K, threads);
}

/* As tollgate_gemm, with int8 panels and scale: [N] float32. */
void tollgate_gemm_int8(const float *x, const int8_t *panels, const float *scale,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                        int threads) {
    gemm(&INT8_WEIGHTS, x, panels, scale, bias, y, M, N, K, threads);
}
