/* Decode attention read straight from the paged KV cache.
 *
 * One query token per sequence. Each (sequence, KV head) pair is one work item: its
 * `group` query heads score every cached position of the sequence, block by block, then
 * sum the values under the softmax. Keys and values are read once, where they lie, with
 * no gathered copy; the next block is prefetched row by row while one is read. Common head
 * sizes get code compiled for that size.
 *
 * Cache layout: [2 (keys, values), kv_heads, slots, dim]; slot = block * block_size + offset.
 * Queries and output: [n, kv_heads * group, dim], float32. The cache is float32 or bfloat16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Below this many cached rows per step, starting a thread costs more than it saves. */
#define ROWS_PER_THREAD 16384
#define CACHE_LINE 64

typedef struct {
    const float *q;
    const void *cache;
    int bf16;
    const int64_t *tables; /* [n, max_blocks] block ids */
    const int64_t *lens;   /* [n] positions in view */
    float *out;
    int64_t n, kv_heads, group, dim, block_size, max_blocks, slots, max_len;
    float scale;
} Job;

typedef void (*AttendFn)(const Job *, int64_t, int64_t, float *, float *);

static inline int64_t row_offset(const Job *job, int64_t head, int64_t slot, int values,
                                 int64_t dim) {
    return (((values ? job->kv_heads : 0) + head) * job->slots + slot) * dim;
}

/* Row `slot` of `head` (keys, or values when `values`) as float32. */
static inline const float *cache_row(const Job *job, int64_t head, int64_t slot, int values,
                                     int64_t dim, float *scratch) {
    const int64_t offset = row_offset(job, head, slot, values, dim);
    if (!job->bf16) return (const float *)job->cache + offset;
    const uint16_t *src = (const uint16_t *)job->cache + offset;
    for (int64_t e = 0; e < dim; e++) {
        const uint32_t bits = (uint32_t)src[e] << 16;
        memcpy(&scratch[e], &bits, sizeof(float));
    }
    return scratch;
}

/* Prefetches row `slot` of `head` into L2 while another row is read: one row of the next
 * block per row of the current one, so the next block's lines are asked for evenly, not in a
 * burst of 64 at the start of each block. Into L2, not L1: on the machines measured, L1 holds
 * few misses in flight, and a prefetch into L1 left reads of scattered blocks as slow as none. */
static inline void prefetch_row(const Job *job, int64_t head, int64_t slot, int values,
                                int64_t dim) {
    const int64_t element = job->bf16 ? 2 : 4;
    const char *start = (const char *)job->cache + row_offset(job, head, slot, values, dim) * element;
    for (int64_t byte = 0; byte < dim * element; byte += CACHE_LINE)
        __builtin_prefetch(start + byte, 0, 2);
}

static inline void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t j = 0; j < rows; j++) {
        float *s = scores + j * len;
        const float inv = 1.f / exp_minus(s, len, max_of(s, len));
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
}

/* `dim` is a constant in the specialised copies below, so the inner loops unroll. */
static inline __attribute__((always_inline)) void attend(const Job *job, int64_t seq,
                                                         int64_t head, float *scores,
                                                         float *scratch, const int64_t dim) {
    const int64_t g = job->group, bs = job->block_size, len = job->lens[seq];
    const int64_t blocks = (len + bs - 1) / bs;
    const int64_t *table = job->tables + seq * job->max_blocks;
    const int64_t first_row = (seq * job->kv_heads + head) * g;
    const float *q = job->q + first_row * dim;
    float *out = job->out + first_row * dim;

    for (int values = 0; values < 2; values++) {
        for (int64_t b = 0; b < blocks; b++) {
            /* What is read next: the following block, or after the last block of keys the
             * first block of values. It is prefetched unless it follows this one in memory,
             * where the hardware's own prefetcher already streams it. */
            const int last = b + 1 == blocks, next_values = values || last;
            const int64_t next = last ? table[0] : table[b + 1];
            const int ahead = (!last || !values) && (last || next != table[b] + 1);
            const int64_t end = (b + 1) * bs < len ? (b + 1) * bs : len;
            for (int64_t t = b * bs; t < end; t++) {
                const int64_t offset = t - b * bs;
                if (ahead) prefetch_row(job, head, next * bs + offset, next_values, dim);
                const float *row = cache_row(job, head, table[b] * bs + offset, values, dim, scratch);
                for (int64_t j = 0; j < g; j++) {
                    if (values) {
                        const float p = scores[j * len + t];
                        float *o = out + j * dim;
                        for (int64_t e = 0; e < dim; e++) o[e] += p * row[e];
                    } else {
                        const float *qj = q + j * dim;
                        float dot = 0.f;
                        for (int64_t e = 0; e < dim; e++) dot += qj[e] * row[e];
                        scores[j * len + t] = dot * job->scale;
                    }
                }
            }
        }
        if (!values) {
            softmax_rows(scores, g, len);
            memset(out, 0, (size_t)(g * dim) * sizeof(float));
        }
    }
}

static void attend_32(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, 32);
}

static void attend_64(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, 64);
}

static void attend_128(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, 128);
}

static void attend_any(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, job->dim);
}

static Job make_job(const float *q, const void *cache, int bf16, const int64_t *tables,
                    const int64_t *lens, float *out, int64_t n, int64_t kv_heads, int64_t group,
                    int64_t dim, int64_t block_size, int64_t max_blocks, int64_t slots,
                    float scale) {
    Job job = {q, cache, bf16, tables, lens, out, n, kv_heads, group, dim, block_size,
               max_blocks, slots, 1, scale};
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > job.max_len) job.max_len = lens[i];
    return job;
}

/* The (sequence, KV head) items, shared among the threads of the enclosing parallel region;
 * `scores` is this thread's scratch (group * max_len + dim floats), or NULL: then it skips
 * its items (its caller reports the failure). */
static void attend_items(const Job *job, float *scores) {
    const AttendFn fn = job->dim == 32    ? attend_32
                        : job->dim == 64  ? attend_64
                        : job->dim == 128 ? attend_128
                                          : attend_any;
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < job->n * job->kv_heads; i++)
        if (scores)
            fn(job, i / job->kv_heads, i % job->kv_heads, scores,
               scores + job->group * job->max_len);
}

/* Returns 0 on success, 1 when a thread could not allocate its scratch memory. Threads come
 * from the process's OpenMP runtime: inside PyTorch, the same pool its own operators use.
 * Built without OpenMP, the pragmas are ignored and the kernel runs on the calling thread. */
int tollgate_paged_decode(const float *q, const void *cache, int bf16, const int64_t *tables,
                          const int64_t *lens, float *out, int64_t n, int64_t kv_heads,
                          int64_t group, int64_t dim, int64_t block_size, int64_t max_blocks,
                          int64_t slots, float scale, int threads) {
    const Job job = make_job(q, cache, bf16, tables, lens, out, n, kv_heads, group, dim,
                             block_size, max_blocks, slots, scale);
    const int64_t rows = n * kv_heads * job.max_len;
    if (rows / ROWS_PER_THREAD + 1 < threads) threads = (int)(rows / ROWS_PER_THREAD + 1);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * job.max_len + dim));
        failed = scores == NULL;
        attend_items(&job, scores);
        free(scores);
    }
    return failed;
}

void tollgate_team_paged_decode(const float *q, const void *cache, int bf16,
                                const int64_t *tables, const int64_t *lens, float *out,
                                int64_t n, int64_t kv_heads, int64_t group, int64_t dim,
                                int64_t block_size, int64_t max_blocks, int64_t slots,
                                float scale, float *scores) {
    const Job job = make_job(q, cache, bf16, tables, lens, out, n, kv_heads, group, dim,
                             block_size, max_blocks, slots, scale);
    attend_items(&job, scores);
}
