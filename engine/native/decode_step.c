/* A whole decode step of a Llama-family decoder in one call: every layer, for a batch of
 * sequences that each add one token, with the library's own kernels.
 *
 * The PyTorch path calls about ten kernels per layer from Python; at one sequence, a step
 * of a small model spends a large part of its time in those calls rather than in the
 * kernels. Here the same kernels run back to back, in the same order on the same values,
 * so the results are the same as that path's; and in one OpenMP parallel region, their
 * team versions (kernels.h), so the threads start once a step, not once a kernel.
 *
 * Per layer, for rows x [rows, hidden] (the residual stream, updated in place):
 *   h = rms_norm(x + delta) where delta is the last layer's MLP output (none for the first)
 *   qkv = h . Wqkv; rotate queries and keys; store keys and values in the paged cache
 *   attention of each row's query over its sequence's cache -> o_proj
 *   h = rms_norm(x += o); delta = down(silu(gate) * up), gate and up = h . Wgate_up
 * and out = rms_norm(x + delta) with the final norm's weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

enum { FLOAT_PANELS = 0, INT8_PANELS = 1, INTEGER_PANELS = 2 };

/* A linear layer's packed weight (native.pack_panels, native.pack_integer_panels). The
 * ctypes mirrors of these structs are in engine/models/native_decoder.py. */
typedef struct {
    int64_t kind;         /* FLOAT_PANELS, INT8_PANELS or INTEGER_PANELS */
    const void *panels;
    const float *scale;   /* [out_features] for int8 kinds, else NULL */
    const float *bias;    /* [out_features] or NULL */
    int64_t out_features, in_features;
} Projection;

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] */
    Projection qkv, o, gate_up, down;
    void *cache; /* [2, kv_heads, slots, head_dim], float32 or bfloat16 */
} DecoderLayer;

typedef struct Decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, slots;
    int64_t bf16; /* whether the caches hold bfloat16 */
    float eps, scale;
    const DecoderLayer *layers;
    const float *final_norm;
    const float *cos, *sin; /* [positions, head_dim / 2] */
} Decoder;

/* The scratch of a step: activations, the integer product's quantized rows, and each
 * thread's attention scores. */
typedef struct {
    float *h, *qkv, *q, *attn, *o, *gate_up, *act, *delta;
    int8_t *xq;
    float *xs;
    int32_t *offsets;
    float *scores;
    int64_t scores_per_thread;
} Scratch;

static void project(const Projection *p, const float *x, float *y, int64_t rows,
                    const Scratch *s, int threads) {
    const int64_t n = p->out_features, k = p->in_features;
    if (p->kind == FLOAT_PANELS)
        tollgate_team_gemm(x, p->panels, p->bias, y, rows, n, k, threads);
    else if (p->kind == INT8_PANELS)
        tollgate_team_gemm_int8(x, p->panels, p->scale, p->bias, y, rows, n, k, threads);
    else
        tollgate_team_gemm_w8a8(x, p->panels, p->scale, p->bias, y, rows, n, k, s->xq, s->xs,
                                s->offsets, threads);
}

/* float32 -> bfloat16, rounded to nearest even as PyTorch's conversion does. */
static uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* Each row's keys and values (after the queries in its qkv row) into its cache slot, and
 * its queries into q, contiguous; rows shared among the team. */
static void store_row_heads(const Decoder *m, void *cache, const float *qkv, float *q,
                            int64_t rows, const int64_t *slot_mapping) {
    const int64_t dim = m->head_dim, attended = m->heads * dim;
    const int64_t width = (m->heads + 2 * m->kv_heads) * dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        memcpy(q + r * attended, qkv + r * width, sizeof(float) * (size_t)attended);
        for (int64_t which = 0; which < 2; which++) {
            for (int64_t h = 0; h < m->kv_heads; h++) {
                const float *src = qkv + r * width + (m->heads + which * m->kv_heads + h) * dim;
                const int64_t at = ((which * m->kv_heads + h) * m->slots + slot_mapping[r]) * dim;
                if (!m->bf16) {
                    memcpy((float *)cache + at, src, sizeof(float) * (size_t)dim);
                    continue;
                }
                uint16_t *dst = (uint16_t *)cache + at;
                for (int64_t i = 0; i < dim; i++) dst[i] = to_bf16(src[i]);
            }
        }
    }
}

/* The step, run by every thread of the region. */
static void run_layers(const Decoder *m, float *x, int64_t rows, const int64_t *positions,
                       const int64_t *slot_mapping, const int64_t *tables, const int64_t *lens,
                       int64_t max_blocks, float *out, const Scratch *s, int threads) {
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t width = (m->heads + 2 * m->kv_heads) * dim;
#ifdef _OPENMP
    float *scores = s->scores + omp_get_thread_num() * s->scores_per_thread;
#else
    float *scores = s->scores;
#endif
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecoderLayer *layer = m->layers + l;
        tollgate_team_rms_norm(x, l ? s->delta : 0, layer->input_norm, s->h, rows, hidden,
                               m->eps);
        project(&layer->qkv, s->h, s->qkv, rows, s, threads);
        tollgate_team_rotary(s->qkv, rows, width, m->heads + m->kv_heads, dim, positions, m->cos,
                             m->sin);
        store_row_heads(m, layer->cache, s->qkv, s->q, rows, slot_mapping);
        tollgate_team_paged_decode(s->q, layer->cache, (int)m->bf16, tables, lens, s->attn, rows,
                                   m->kv_heads, m->heads / m->kv_heads, dim, m->block_size,
                                   max_blocks, m->slots, m->scale, scores);
        project(&layer->o, s->attn, s->o, rows, s, threads);
        tollgate_team_rms_norm(x, s->o, layer->post_attention_norm, s->h, rows, hidden, m->eps);
        project(&layer->gate_up, s->h, s->gate_up, rows, s, threads);
        tollgate_team_silu_mul(s->gate_up, s->act, rows, m->intermediate);
        project(&layer->down, s->act, s->delta, rows, s, threads);
    }
    tollgate_team_rms_norm(x, m->num_layers ? s->delta : 0, m->final_norm, out, rows, hidden,
                           m->eps);
}

/* x: [rows, hidden], the token embeddings, used as the residual stream (overwritten);
 * positions, slot_mapping, lens: [rows]; tables: [rows, max_blocks] block ids; out: [rows,
 * hidden], the final hidden states. Integer panels only where tollgate_has_w8a8(). Returns
 * 0, or -1 when scratch memory cannot be had. */
int tollgate_decode_step(const Decoder *m, float *x, int64_t rows, const int64_t *positions,
                         const int64_t *slot_mapping, const int64_t *tables, const int64_t *lens,
                         int64_t max_blocks, float *out, int threads) {
    threads = threads > 1 ? threads : 1;
    const int64_t hidden = m->hidden, dim = m->head_dim, attended = m->heads * dim;
    const int64_t width = (m->heads + 2 * m->kv_heads) * dim;
    /* The deepest product's rows, for the integer kernel's quantized copy of them. */
    int64_t depth = hidden > attended ? hidden : attended;
    depth = depth > m->intermediate ? depth : m->intermediate;
    int64_t max_len = 1;
    for (int64_t r = 0; r < rows; r++) max_len = lens[r] > max_len ? lens[r] : max_len;
    Scratch s;
    s.scores_per_thread = m->heads / m->kv_heads * max_len + dim;
    const int64_t sizes[] = {hidden, width, attended, attended, hidden, 2 * m->intermediate,
                             m->intermediate, hidden};
    float **buffers[] = {&s.h, &s.qkv, &s.q, &s.attn, &s.o, &s.gate_up, &s.act, &s.delta};
    const int64_t blocks = rows * (depth / 32 + 1); /* scales of the quantized rows */
    size_t floats = (size_t)(threads * s.scores_per_thread + blocks);
    for (int i = 0; i < 8; i++) floats += (size_t)(rows * sizes[i]);
    float *block = malloc(sizeof(float) * floats);
    s.xq = malloc((size_t)(rows * depth) + 1);
    s.offsets = malloc(sizeof(int32_t) * (size_t)blocks);
    if (!block || !s.xq || !s.offsets) {
        free(block), free(s.xq), free(s.offsets);
        return -1;
    }
    float *next = block;
    for (int i = 0; i < 8; i++) {
        *buffers[i] = next;
        next += rows * sizes[i];
    }
    s.xs = next;
    s.scores = next + blocks;
#pragma omp parallel num_threads(threads) if (threads > 1)
    run_layers(m, x, rows, positions, slot_mapping, tables, lens, max_blocks, out, &s, threads);
    free(block), free(s.xq), free(s.offsets);
    return 0;
}
