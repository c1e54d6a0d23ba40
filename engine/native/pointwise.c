/* Row-wise steps of a decoder layer, each one pass over its rows instead of one PyTorch
 * operation (and one temporary) per arithmetic step. float32, contiguous rows. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Below this many elements, starting a thread costs more than it saves. */
#define ELEMENTS_PER_THREAD 32768

static int team_size(int64_t elements, int threads) {
    const int64_t useful = elements / ELEMENTS_PER_THREAD;
    return useful < 1 ? 1 : useful < threads ? (int)useful : threads;
}

/* x: [rows, dim]; when `delta` is given, x += delta first (the residual update), in place.
 * out = x / sqrt(mean(x^2) + eps) * weight. */
void tollgate_team_rms_norm(float *x, const float *delta, const float *weight, float *out,
                            int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * dim;
        float squares = 0.f;
        if (delta) {
            const float *add = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                row[i] += add[i];
                squares += row[i] * row[i];
            }
        } else {
            for (int64_t i = 0; i < dim; i++) squares += row[i] * row[i];
        }
        const float scale = 1.f / sqrtf(squares / (float)dim + eps);
        float *dst = out + r * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = row[i] * scale * weight[i];
    }
}

void tollgate_rms_norm(float *x, const float *delta, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps, int threads) {
    const int team = team_size(rows * dim, threads);
#pragma omp parallel num_threads(team) if (team > 1)
    tollgate_team_rms_norm(x, delta, weight, out, rows, dim, eps);
}

/* Rotary position embedding, in place. Row t of x holds `heads` vectors of `head_dim`
 * (queries then keys), starting `stride` floats after row t - 1. Each vector's halves are
 * rotated by the angles of position positions[t]: cos/sin tables are [*, head_dim / 2]. */
void tollgate_team_rotary(float *x, int64_t rows, int64_t stride, int64_t heads,
                          int64_t head_dim, const int64_t *positions, const float *cos_table,
                          const float *sin_table) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *cos = cos_table + positions[t] * half, *sin = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *first = x + t * stride + h * head_dim, *second = first + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = first[i], b = second[i];
                first[i] = a * cos[i] - b * sin[i];
                second[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

void tollgate_rotary(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                     const int64_t *positions, const float *cos_table, const float *sin_table,
                     int threads) {
    const int team = team_size(rows * heads * head_dim, threads);
#pragma omp parallel num_threads(team) if (team > 1)
    tollgate_team_rotary(x, rows, stride, heads, head_dim, positions, cos_table, sin_table);
}

/* gate_up: [rows, 2 * width], gate then up in each row -> out: [rows, width] =
 * silu(gate) * up, silu(g) = g / (1 + e^-g). */
void tollgate_team_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *dst = out + r * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            v8 g, u;
            memcpy(&g, gate + i, 32);
            memcpy(&u, up + i, 32);
            /* Below -88, e^-g overflows float (exp8 saturates): silu(g) rounds to 0. */
            const v8i vanishing = g < -88.f;
            const v8 silu = (v8)((v8i)(g / (1.f + exp8(-g))) & ~vanishing);
            const v8 result = silu * u;
            memcpy(dst + i, &result, 32);
        }
        for (; i < width; i++) dst[i] = gate[i] < -88.f ? 0.f : gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

void tollgate_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width,
                       int threads) {
    const int team = team_size(rows * width, threads);
#pragma omp parallel num_threads(team) if (team > 1)
    tollgate_team_silu_mul(gate_up, out, rows, width);
}
