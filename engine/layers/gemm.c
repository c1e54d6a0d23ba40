/* Matrix multiply for linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * W is packed once, in panels of 16 output features: panels[p, k, j] = W[16 p + j, k], rows
 * past N zero. A tile of up to 6 rows of x by one panel keeps its 6 x 16 sums in registers
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

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* v8 at any float's address */
#define NR 16  /* output features per panel: two vectors of 8 */
#define MR 6   /* rows of x per tile: 12 sums, 2 weight vectors and 1 input in 16 registers */
#define KC 512 /* columns of x per block */
#define MC 128 /* rows of x per block */

/* Adds the tile's product over `depth` columns into y (or stores it, when `first`), plus
 * `bias` when given. */
#define DEFINE_TILE(R)                                                                         \
    static void tile_##R(int64_t depth, const float *x, int64_t ldx, const float *panel,        \
                         float *y, int64_t ldy, int first, const float *bias) {                 \
        v8 sums[R][2];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) sums[m][0] = sums[m][1] = (v8){0}; \
        const v8u *w = (const v8u *)panel;                                                       \
        for (int64_t k = 0; k < depth; k++) {                                                  \
            const v8 w0 = w[2 * k], w1 = w[2 * k + 1];                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                              \
                const v8 a = (v8){0} + x[m * ldx + k];                                         \
                sums[m][0] += a * w0;                                                          \
                sums[m][1] += a * w1;                                                          \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                  \
            float *row = y + m * ldy;                                                          \
            v8 lo = sums[m][0], hi = sums[m][1], add;                                          \
            if (!first) {                                                                      \
                memcpy(&add, row, 32), lo += add;                                              \
                memcpy(&add, row + 8, 32), hi += add;                                          \
            }                                                                                  \
            if (bias) {                                                                        \
                memcpy(&add, bias, 32), lo += add;                                             \
                memcpy(&add, bias + 8, 32), hi += add;                                         \
            }                                                                                  \
            memcpy(row, &lo, 32);                                                              \
            memcpy(row + 8, &hi, 32);                                                          \
        }                                                                                      \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

typedef void (*TileFn)(int64_t, const float *, int64_t, const float *, float *, int64_t, int,
                       const float *);
static const TileFn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* `rows` rows of x (one block) by one panel, `width` of whose 16 features are real. */
static void rows_by_panel(int64_t rows, int64_t depth, const float *x, int64_t K,
                          const float *panel, float *y, int64_t N, int64_t width, int first,
                          const float *bias) {
    for (int64_t m = 0; m < rows; m += MR) {
        const int r = (int)(rows - m < MR ? rows - m : MR);
        if (width == NR) {
            TILES[r](depth, x + m * K, K, panel, y + m * N, N, first, bias);
            continue;
        }
        /* A last panel narrower than 16 goes through a full-width scratch tile. */
        float scratch[MR * NR] = {0}, padded_bias[NR] = {0};
        for (int i = 0; i < r; i++)
            if (!first) memcpy(scratch + i * NR, y + (m + i) * N, sizeof(float) * width);
        if (bias) memcpy(padded_bias, bias, sizeof(float) * width);
        TILES[r](depth, x + m * K, K, panel, scratch, NR, 0, bias ? padded_bias : 0);
        for (int i = 0; i < r; i++)
            memcpy(y + (m + i) * N, scratch + i * NR, sizeof(float) * width);
    }
}

/* x: [M, K], panels: [ceil(N / 16), K, 16], bias: [N] or NULL, y: [M, N]; all contiguous
 * float32. */
void tollgate_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t M,
                   int64_t N, int64_t K, int threads) {
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
            const float *block_bias = k0 + depth == K ? bias : 0;
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t rows = M - m0 < MC ? M - m0 : MC;
                for (int64_t p = start; p < stop; p++) {
                    const int64_t n = p * NR, width = N - n < NR ? N - n : NR;
                    rows_by_panel(rows, depth, x + m0 * K + k0, K, panels + (p * K + k0) * NR,
                                  y + m0 * N + n, N, width, k0 == 0,
                                  block_bias ? block_bias + n : 0);
                }
            }
        }
    }
}
