/* The library's functions, declared once: each source that defines one includes this, so
 * the compiler checks the definition against it. The first group is what bindings.py
 * binds, with the types signatures.py reads from here; decode_step.c calls the team
 * versions below. */
#ifndef TOLLGATE_KERNELS_H
#define TOLLGATE_KERNELS_H

#include <stdint.h>

int tollgate_paged_decode(const float *q, const void *cache, int bf16, const int64_t *tables,
                          const int64_t *lens, float *out, int64_t n, int64_t kv_heads,
                          int64_t group, int64_t dim, int64_t block_size, int64_t max_blocks,
                          int64_t slots, float scale, int threads);
int tollgate_prefill_attention(const float *q, int64_t ldq, const void *cache, int bf16,
                               const int64_t *blocks, float *out, int64_t ldo, int64_t num_query,
                               int64_t context_len, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, int64_t slots, float scale, int threads);
void tollgate_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t M,
                   int64_t N, int64_t K, int threads);
void tollgate_gemm_int8(const float *x, const int8_t *panels, const float *scale,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                        int threads);
int tollgate_has_w8a8(void);
int tollgate_gemm_w8a8(const float *x, const uint8_t *panels, const float *scale,
                       const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int threads);
void tollgate_rms_norm(float *x, const float *delta, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps, int threads);
void tollgate_rotary(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                     const int64_t *positions, const float *cos_table, const float *sin_table,
                     int threads);
void tollgate_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width,
                       int threads);
/* A model's decoder as decode_step.c lays it out. */
struct Decoder;
int tollgate_decode_step(const struct Decoder *m, float *x, int64_t rows,
                         const int64_t *positions, const int64_t *slot_mapping,
                         const int64_t *tables, const int64_t *lens, int64_t max_blocks,
                         float *out, int threads);

/* Team versions, for decode_step.c: each is called by every thread of an enclosing OpenMP
 * parallel region of `threads` threads, shares its work out among them, and returns on the
 * region's barrier. Each computes what its function above does, bit for bit. The integer
 * product takes its scratch (M * K bytes, and M * K / 32 scales and offsets), the decode
 * attention each thread's own (group * max(lens) + dim floats). */
void tollgate_team_gemm(const float *x, const float *panels, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int threads);
void tollgate_team_gemm_int8(const float *x, const int8_t *panels, const float *scale,
                             const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                             int threads);
void tollgate_team_gemm_w8a8(const float *x, const uint8_t *panels, const float *scale,
                             const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                             int8_t *xq, float *s, int32_t *offsets, int threads);
void tollgate_team_paged_decode(const float *q, const void *cache, int bf16,
                                const int64_t *tables, const int64_t *lens, float *out,
                                int64_t n, int64_t kv_heads, int64_t group, int64_t dim,
                                int64_t block_size, int64_t max_blocks, int64_t slots,
                                float scale, float *scores);
void tollgate_team_rms_norm(float *x, const float *delta, const float *weight, float *out,
                            int64_t rows, int64_t dim, float eps);
void tollgate_team_rotary(float *x, int64_t rows, int64_t stride, int64_t heads,
                          int64_t head_dim, const int64_t *positions, const float *cos_table,
                          const float *sin_table);
void tollgate_team_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width);

#endif
