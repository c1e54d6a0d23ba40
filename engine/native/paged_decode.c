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
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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
    widen_bf16((const uint16_t *)job->cache + offset, dim, scratch);
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

#ifndef __AVX512F__ /* else the wide versions below */
static void attend_64(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, 64);
}

static void attend_128(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, 128);
}
#endif

static void attend_any(const Job *job, int64_t seq, int64_t head, float *scores, float *scratch) {
    attend(job, seq, head, scores, scratch, job->dim);
}

#ifdef __AVX512F__
/* The same work for head sizes of 64 and 128 with 16-float vectors, the query heads of a
 * chunk of the group in registers: each cached row is loaded (and widened from bfloat16)
 * once for the chunk, keys' dot products are summed across the vector once per score, and
 * the chunk's outputs stay in registers while the values are walked, where the portable
 * loop stores each output back for every row. The block two on is always fetched, also
 * where it follows the one read in memory: the hardware's prefetcher stops at each 4 KiB
 * page, which one block of a head's keys (16 rows of 64 floats) fills. */
#define WIDE_CHUNK 4 /* query heads per pass over the cache */
#define WIDE_AHEAD 2 /* blocks between the one read and the one fetched */

static inline __attribute__((always_inline)) __m512 load_row16(const Job *job, int64_t head,
                                                               int64_t slot, int values,
                                                               int64_t dim, int64_t c) {
    const int64_t offset = row_offset(job, head, slot, values, dim) + 16 * c;
    if (!job->bf16) return _mm512_loadu_ps((const float *)job->cache + offset);
    const uint16_t *row = (const uint16_t *)job->cache + offset;
    const __m256i half = _mm256_loadu_si256((const __m256i *)row);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* One pass over a sequence's cached keys (scores of `n` query heads) or values (their
 * outputs); n and the vectors per row are constants where this is inlined, so the queries
 * and the sums stay in registers. */
static inline __attribute__((always_inline)) void wide_pass(const Job *job, int64_t seq,
                                                            int64_t head, const float *q,
                                                            float *out, float *scores,
                                                            int64_t len, int values, int ahead_ok,
                                                            const int64_t n, const int64_t vecs) {
    enum { MAX_VECS = 8 };
    const int64_t bs = job->block_size, dim = 16 * vecs, blocks = (len + bs - 1) / bs;
    const int64_t *table = job->tables + seq * job->max_blocks;
    __m512 held[WIDE_CHUNK][MAX_VECS]; /* queries, or the outputs' sums */
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < vecs; c++)
            held[j][c] = values ? _mm512_setzero_ps() : _mm512_loadu_ps(q + j * dim + 16 * c);
    for (int64_t b = 0; b < blocks; b++) {
        /* The block WIDE_AHEAD on, or past the last block of keys the values' first. */
        const int64_t far = b + WIDE_AHEAD, wraps = far >= blocks, at = wraps ? far - blocks : far;
        const int next_values = values || wraps;
        const int ahead = ahead_ok && at < blocks && !(wraps && values);
        const int64_t next = ahead ? table[at] : 0;
        const int64_t end = (b + 1) * bs < len ? (b + 1) * bs : len;
        for (int64_t t = b * bs; t < end; t++) {
            const int64_t slot = table[b] * bs + t - b * bs;
            if (ahead) prefetch_row(job, head, next * bs + t - b * bs, next_values, dim);
            __m512 row[MAX_VECS];
            for (int64_t c = 0; c < vecs; c++) row[c] = load_row16(job, head, slot, values, dim, c);
            for (int64_t j = 0; j < n; j++) {
                if (values) {
                    const __m512 p = _mm512_set1_ps(scores[j * len + t]);
                    for (int64_t c = 0; c < vecs; c++)
                        held[j][c] = _mm512_fmadd_ps(p, row[c], held[j][c]);
                    continue;
                }
                __m512 even = _mm512_mul_ps(held[j][0], row[0]);
                __m512 odd = _mm512_mul_ps(held[j][1], row[1]);
                for (int64_t c = 2; c < vecs; c += 2) {
                    even = _mm512_fmadd_ps(held[j][c], row[c], even);
                    odd = _mm512_fmadd_ps(held[j][c + 1], row[c + 1], odd);
                }
                scores[j * len + t] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) * job->scale;
            }
        }
    }
    if (values)
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < vecs; c++)
                _mm512_storeu_ps(out + j * dim + 16 * c, held[j][c]);
}

static inline __attribute__((always_inline)) void attend_wide(const Job *job, int64_t seq,
                                                              int64_t head, float *scores,
                                                              const int64_t vecs) {
    const int64_t dim = 16 * vecs, chunk = vecs <= 4 ? WIDE_CHUNK : WIDE_CHUNK / 2;
    const int64_t g = job->group, len = job->lens[seq];
    const int64_t first_row = (seq * job->kv_heads + head) * g;
    for (int values = 0; values < 2; values++) {
        for (int64_t j0 = 0; j0 < g; j0 += chunk) {
            const float *q = job->q + (first_row + j0) * dim;
            float *out = job->out + (first_row + j0) * dim;
            float *s = scores + j0 * len;
            const int ahead = j0 + chunk >= g; /* the chunk's last pass fetches the next's rows */
            switch (g - j0 < chunk ? g - j0 : chunk) {
            case 1: wide_pass(job, seq, head, q, out, s, len, values, ahead, 1, vecs); break;
            case 2: wide_pass(job, seq, head, q, out, s, len, values, ahead, 2, vecs); break;
            case 3: wide_pass(job, seq, head, q, out, s, len, values, ahead, 3, vecs); break;
            default: wide_pass(job, seq, head, q, out, s, len, values, ahead, 4, vecs); break;
            }
        }
        if (!values) softmax_rows(scores, g, len);
    }
}

static void attend_64_wide(const Job *job, int64_t seq, int64_t head, float *scores,
                           float *scratch) {
    (void)scratch;
    attend_wide(job, seq, head, scores, 4);
}

static void attend_128_wide(const Job *job, int64_t seq, int64_t head, float *scores,
                            float *scratch) {
    (void)scratch;
    attend_wide(job, seq, head, scores, 8);
}
#endif

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
#ifdef __AVX512F__
    const AttendFn fn = job->dim == 32    ? attend_32
                        : job->dim == 64  ? attend_64_wide
                        : job->dim == 128 ? attend_128_wide
                                          : attend_any;
#else
    const AttendFn fn = job->dim == 32    ? attend_32
                        : job->dim == 64  ? attend_64
                        : job->dim == 128 ? attend_128
                                          : attend_any;
#endif
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
