/* Matrix multiply for linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * W is packed once, in panels of 16 output features: panels[p, k, j] = W[16 p + j, k], rows
 * past N zero. Weights are float32, or int8 with one float32 scale per output feature
 * (y = (x . Q^T) * scale + bias), widened to float32 in registers. A tile of up to 6 rows
 * of x by one panel (simd.h) keeps its 6 x 16 sums in registers while it walks K: each step
 * loads 16 weights, broadcasts 6 inputs and does 12 vector multiply-adds. So each weight read
 * from memory serves every row of x, which is what decode steps (a few rows against all of a
 * layer's weights) are bound by. While the first tile of rows walks a panel, it asks for the
 * task's next panel: the tiles after it multiply from cache while that panel arrives, and the
 * next panel's first tile finds it there, so reading weights overlaps multiplying them.
 *
 * Threads take the work in tasks, one block of MC rows of x by a chunk of panels, each the
 * next as they finish the last: a thread that the OS takes off its core (for another process
 * on a busy machine) holds up the product by one task, not by its share of it. A task walks
 * K in blocks of KC columns, so the block of x it rereads for each panel stays in L2; the
 * tasks of one row block come one after another, so threads share that block too.
 */
#include "simd.h"

#define KC 512 /* columns of x per block */
#define MC 128 /* rows of x per block */
/* Chunks of panels per thread: threads take the next chunk as they finish one. */
#define CHUNKS_PER_THREAD 8

DEFINE_TILES(float_tile, LOAD_FLOAT)
DEFINE_TILES(int8_tile, LOAD_INT8)

/* How to multiply by one kind of weight: its tiles by row count, and its element size. */
typedef struct {
    TileFn tiles[MR + 1];
    int64_t element_size;
} Weights;

static const Weights FLOAT_WEIGHTS = {TILE_TABLE(float_tile), 4};
static const Weights INT8_WEIGHTS = {TILE_TABLE(int8_tile), 1};

/* `rows` rows of x (one block) by one panel, `width` of whose 16 features are real. */
static void rows_by_panel(const Weights *kind, int64_t rows, int64_t depth, const float *x,
                          int64_t K, const void *panel, float *y, int64_t N, int64_t width,
                          int first, const float *scale, const float *bias, const char *ahead) {
    for (int64_t m = 0; m < rows; m += MR) {
        const int r = (int)(rows - m < MR ? rows - m : MR);
        /* The first tile reads the panel from memory; it fetches the next one meanwhile. */
        const char *fetch = m == 0 ? ahead : 0;
        if (width == NR) {
            kind->tiles[r](depth, x + m * K, K, panel, y + m * N, N, first, scale, bias, fetch);
            continue;
        }
        /* A last panel narrower than 16 goes through a full-width scratch tile. */
        float scratch[MR * NR] = {0}, padded_scale[NR] = {0}, padded_bias[NR] = {0};
        for (int i = 0; i < r; i++)
            if (!first) memcpy(scratch + i * NR, y + (m + i) * N, sizeof(float) * width);
        if (scale) memcpy(padded_scale, scale, sizeof(float) * width);
        if (bias) memcpy(padded_bias, bias, sizeof(float) * width);
        kind->tiles[r](depth, x + m * K, K, panel, scratch, NR, 0, scale ? padded_scale : 0,
                       bias ? padded_bias : 0, 0);
        for (int i = 0; i < r; i++)
            memcpy(y + (m + i) * N, scratch + i * NR, sizeof(float) * width);
    }
}

static void gemm(const Weights *kind, const float *x, const void *panels, const float *scale,
                 const float *bias, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t num_panels = (N + NR - 1) / NR, row_blocks = (M + MC - 1) / MC;
    int64_t chunk = num_panels / ((int64_t)CHUNKS_PER_THREAD * (threads > 1 ? threads : 1));
    chunk = chunk > 0 ? chunk : 1;
    const int64_t chunks = (num_panels + chunk - 1) / chunk;
    const int64_t panel_bytes = K * NR * kind->element_size;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < row_blocks * chunks; task++) {
        const int64_t m0 = task / chunks * MC, rows = M - m0 < MC ? M - m0 : MC;
        const int64_t start = task % chunks * chunk;
        const int64_t stop = start + chunk < num_panels ? start + chunk : num_panels;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t depth = K - k0 < KC ? K - k0 : KC;
            const int last = k0 + depth == K;
            for (int64_t p = start; p < stop; p++) {
                const int64_t n = p * NR, width = N - n < NR ? N - n : NR;
                const char *panel =
                    (const char *)panels + p * panel_bytes + k0 * NR * kind->element_size;
                rows_by_panel(kind, rows, depth, x + m0 * K + k0, K, panel, y + m0 * N + n, N,
                              width, k0 == 0, last && scale ? scale + n : 0,
                              last && bias ? bias + n : 0, p + 1 < stop ? panel + panel_bytes : 0);
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
