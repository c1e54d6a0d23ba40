/* A whole decode step of a Llama-family decoder in one call: every layer, for a batch of
 * sequences that each add one token, with the library's own kernels.
 *
 * The PyTorch path calls about ten kernels per layer from Python; at one sequence, a step
 * of a small model spends a large part of its time in those calls rather than in the
 * kernels. Here the same kernels run back to back, in the same order on the same values,
 * so the results are the same as that path's.
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

#include "kernels.h"

enum { FLOAT_PANELS = 0, INT8_PANELS = 1, INTEGER_PANELS = 2 };

/* A linear layer's packed weight (native.pack_panels, native.pack_integer_panels). */
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

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, slots;
    int64_t bf16; /* whether the caches hold bfloat16 */
    float eps, scale;
    const DecoderLayer *layers;
    const float *final_norm;
    const float *cos, *sin; /* [positions, head_dim / 2] */
} Decoder;

static int project(const Projection *p, const float *x, float *y, int64_t rows, int threads) {
    const int64_t n = p->out_features, k = p->in_features;
    switch (p->kind) {
    case FLOAT_PANELS:
        tollgate_gemm(x, p->panels, p->bias, y, rows, n, k, threads);
        return 0;
    case INT8_PANELS:
        tollgate_gemm_int8(x, p->panels, p->scale, p->bias, y, rows, n, k, threads);
        return 0;
    case INTEGER_PANELS:
        return tollgate_gemm_w8a8(x, p->panels, p->scale, p->bias, y, rows, n, k, threads);
    default:
        return -1;
    }
}

/* float32 -> bfloat16, rounded to nearest even as PyTorch's conversion does. */
static uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* Each row's keys and values (after the queries in its qkv row) into its cache slot. */
static void store_keys_and_values(const Decoder *m, void *cache, const float *qkv,
                                  int64_t width, int64_t rows, const int64_t *slot_mapping) {
    const int64_t dim = m->head_dim;
    for (int64_t r = 0; r < rows; r++) {
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

/* x: [rows, hidden], the token embeddings, used as the residual stream (overwritten);
 * positions, slot_mapping, lens: [rows]; tables: [rows, max_blocks] block ids; out: [rows,
 * hidden], the final hidden states. Returns 0, or -1 when scratch memory cannot be had or
 * a projection's kernel fails. */
int tollgate_decode_step(const Decoder *m, float *x, int64_t rows, const int64_t *positions,
                         const int64_t *slot_mapping, const int64_t *tables, const int64_t *lens,
                         int64_t max_blocks, float *out, int threads) {
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t attended = m->heads * dim, width = (m->heads + 2 * m->kv_heads) * dim;
    const int64_t sizes[] = {hidden, width, attended, attended, hidden, 2 * m->intermediate,
                             m->intermediate, hidden};
    float *buffers[8];
    size_t total = 0;
    for (int i = 0; i < 8; i++) total += (size_t)(rows * sizes[i]);
    float *scratch = malloc(sizeof(float) * (total ? total : 1));
    if (!scratch) return -1;
    float *next = scratch;
    for (int i = 0; i < 8; i++) {
        buffers[i] = next;
        next += rows * sizes[i];
    }
    float *h = buffers[0], *qkv = buffers[1], *q = buffers[2], *attn = buffers[3];
    float *o = buffers[4], *gate_up = buffers[5], *act = buffers[6], *delta = buffers[7];
    int failed = 0;
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const DecoderLayer *layer = m->layers + l;
        tollgate_rms_norm(x, l ? delta : 0, layer->input_norm, h, rows, hidden, m->eps, threads);
        failed |= project(&layer->qkv, h, qkv, rows, threads);
        tollgate_rotary(qkv, rows, width, m->heads + m->kv_heads, dim, positions, m->cos, m->sin,
                        threads);
        store_keys_and_values(m, layer->cache, qkv, width, rows, slot_mapping);
        for (int64_t r = 0; r < rows; r++)
            memcpy(q + r * attended, qkv + r * width, sizeof(float) * (size_t)attended);
        failed |= tollgate_paged_decode(q, layer->cache, (int)m->bf16, tables, lens, attn, rows,
                                        m->kv_heads, m->heads / m->kv_heads, dim, m->block_size,
                                        max_blocks, m->slots, m->scale, threads) ? -1 : 0;
        failed |= project(&layer->o, attn, o, rows, threads);
        tollgate_rms_norm(x, o, layer->post_attention_norm, h, rows, hidden, m->eps, threads);
        failed |= project(&layer->gate_up, h, gate_up, rows, threads);
        tollgate_silu_mul(gate_up, act, rows, m->intermediate, threads);
        failed |= project(&layer->down, act, delta, rows, threads);
    }
    if (!failed)
        tollgate_rms_norm(x, m->num_layers ? delta : 0, m->final_norm, out, rows, hidden, m->eps,
                          threads);
    free(scratch);
    return failed ? -1 : 0;
}
