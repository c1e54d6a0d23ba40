/* Causal attention of one sequence's chunk of prompt tokens, read from the paged KV cache.
 *
 * The chunk's keys and values are in the cache already, after the positions before it.
 * Each KV head's keys are packed once per call in panels of 16 positions, scaled
 * (kp[p, d, j] = K[16 p + j, d] * scale), and its values in panels of 16 dimensions
 * (vp[j, t, c] = V[t, 16 j + c]). Both products of attention are then the register tiles
 * of the linear layers' matrix multiply (simd.h): a tile of up to 6 query rows of one head
 * scores 16 positions at a time against the key panels, takes the softmax of each row over
 * the positions it may see, and multiplies the probabilities by the value panels.
 *
 * Cache layout: [2 (keys, values), kv_heads, slots, dim] float32 or bfloat16 (widened as it
 * is packed; the chunk's own keys and values are then read rounded, as decode reads them);
 * slot = block * block_size + offset. dim is a multiple of 16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

DEFINE_TILES(attention_tile, LOAD_FLOAT)

static const TileFn TILES[MR + 1] = TILE_TABLE(attention_tile);

/* Below this many score entries per step (query rows by positions, all heads), one thread
 * does it all. */
#define SCORES_PER_THREAD 32768

typedef struct {
    const float *q;
    int64_t ldq;
    const void *cache;
    int bf16;
    const int64_t *blocks;
    float *out;
    int64_t ldo, num_query, context_len, heads, kv_heads, dim, block_size, slots;
    float scale;
    int64_t padded; /* context_len rounded up to a whole panel */
    float *keys;    /* [kv_heads, padded / 16, dim, 16] */
    float *values;  /* [kv_heads, dim / 16, context_len, 16] */
} Job;

/* Row `position` of `head` (keys, or values when `values`) as float32: in the cache, or
 * widened from bfloat16 into `scratch` (dim floats). */
static const float *cache_row(const Job *job, int values, int64_t head, int64_t position,
                              float *scratch) {
    const int64_t slot =
        job->blocks[position / job->block_size] * job->block_size + position % job->block_size;
    const int64_t at = (((values ? job->kv_heads : 0) + head) * job->slots + slot) * job->dim;
    if (!job->bf16) return (const float *)job->cache + at;
    widen_bf16((const uint16_t *)job->cache + at, job->dim, scratch);
    return scratch;
}

/* Packs the keys and values of positions 16 p .. 16 p + 15 of one KV head; `scratch`: 2 dim
 * floats. */
static void pack_panel(const Job *job, int64_t head, int64_t p, float *scratch) {
    const int64_t dim = job->dim, panels = job->padded / NR;
    float *keys = job->keys + (head * panels + p) * dim * NR;
    float *values = job->values + head * (dim / NR) * job->context_len * NR;
    for (int64_t j = 0; j < NR; j++) {
        const int64_t t = p * NR + j;
        if (t >= job->context_len) {
            for (int64_t d = 0; d < dim; d++) keys[d * NR + j] = 0.f;
            continue;
        }
        const float *k = cache_row(job, 0, head, t, scratch);
        const float *v = cache_row(job, 1, head, t, scratch + dim);
        for (int64_t d = 0; d < dim; d++) keys[d * NR + j] = k[d] * job->scale;
        for (int64_t c = 0; c < dim / NR; c++)
            memcpy(values + (c * job->context_len + t) * NR, v + c * NR, sizeof(float) * NR);
    }
}

/* e^(s - max s) for scores[0 .. seen), zeroing scores[seen .. width); returns 1 / their sum,
 * which the row's output is multiplied by: the softmax is never stored. */
static float softmax_row(float *scores, int64_t seen, int64_t width) {
    const float total = exp_minus(scores, seen, max_of(scores, seen));
    for (int64_t t = seen; t < width; t++) scores[t] = 0.f;
    return 1.f / total;
}

/* Query rows first .. first + rows - 1 (rows <= MR) of one head. */
static void attend(const Job *job, int64_t head, int64_t first, int rows, float *scores) {
    const int64_t dim = job->dim, kv_head = head / (job->heads / job->kv_heads);
    const int64_t offset = job->context_len - job->num_query; /* position of query row 0 */
    const int64_t seen_last = offset + first + rows;          /* positions the last row sees */
    const int64_t panels = (seen_last + NR - 1) / NR, width = panels * NR;
    const float *keys = job->keys + kv_head * (job->padded / NR) * dim * NR;
    const float *q = job->q + first * job->ldq + head * dim;
    for (int64_t p = 0; p < panels; p++)
        TILES[rows](dim, q, job->ldq, keys + p * dim * NR, 0, scores + p * NR, job->padded, 1,
                    0, 0, 0);
    float inverse_sums[MR];
    for (int m = 0; m < rows; m++)
        inverse_sums[m] = softmax_row(scores + m * job->padded, offset + first + m + 1, width);
    const float *values = job->values + kv_head * (dim / NR) * job->context_len * NR;
    float *out = job->out + first * job->ldo + head * dim;
    for (int64_t c = 0; c < dim / NR; c++)
        TILES[rows](seen_last, scores, job->padded, values + c * job->context_len * NR, 0,
                    out + c * NR, job->ldo, 1, 0, 0, 0);
    for (int m = 0; m < rows; m++)
        for (int64_t e = 0; e < dim; e++) out[m * job->ldo + e] *= inverse_sums[m];
}

/* q: num_query rows of heads * dim floats, ldq apart; out likewise, ldo apart. Query row i
 * is position context_len - num_query + i and sees positions 0 .. that one. blocks: the
 * sequence's block ids, covering context_len positions. Returns 0 on success, 1 when
 * scratch memory could not be allocated, 2 when dim is not a multiple of 16. */
int tollgate_prefill_attention(const float *q, int64_t ldq, const void *cache, int bf16,
                               const int64_t *blocks, float *out, int64_t ldo, int64_t num_query,
                               int64_t context_len, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, int64_t slots, float scale, int threads) {
    if (dim % NR != 0) return 2;
    if (num_query <= 0) return 0;
    const int64_t padded = (context_len + NR - 1) / NR * NR;
    Job job = {.q = q, .ldq = ldq, .cache = cache, .bf16 = bf16, .blocks = blocks, .out = out,
               .ldo = ldo, .num_query = num_query, .context_len = context_len, .heads = heads,
               .kv_heads = kv_heads, .dim = dim, .block_size = block_size, .slots = slots,
               .scale = scale, .padded = padded};
    job.keys = malloc(sizeof(float) * (size_t)(kv_heads * padded * dim));
    job.values = malloc(sizeof(float) * (size_t)(kv_heads * context_len * dim));
    if (!job.keys || !job.values) {
        free(job.keys), free(job.values);
        return 1;
    }
    const int64_t work = num_query * context_len * heads;
    if (work / SCORES_PER_THREAD + 1 < threads) threads = (int)(work / SCORES_PER_THREAD + 1);
    const int64_t tiles = (num_query + MR - 1) / MR, panels = padded / NR;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(MR * padded + 2 * dim));
        failed = scores == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < kv_heads * panels; i++)
            if (scores) pack_panel(&job, i / panels, i % panels, scores);
        /* The last tiles see the most positions: they go first. */
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < tiles * heads; i++) {
            const int64_t tile = tiles - 1 - i / heads, first = tile * MR;
            const int rows = (int)(num_query - first < MR ? num_query - first : MR);
            if (scores) attend(&job, i % heads, first, rows, scores);
        }
        free(scores);
    }
    free(job.keys), free(job.values);
    return failed;
}
