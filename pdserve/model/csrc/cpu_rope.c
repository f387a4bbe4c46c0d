/* Rotary embedding and the KV cache write of one layer on CPU, float32, in one pass over the step's rows:
 * q rotated in place, k rotated straight into its cache slot, v copied into its slot.
 *
 * Why: in eager torch these are about a dozen ops a layer (chunk, four muls, a sub, an add, a cat, for q
 * and for k, then the slot arithmetic and two index_put), each a dispatch and a pass over the rows; in a
 * 64-sequence decode step of the default model they were a tenth of the step's main-thread time
 * (py-spy, docs/benchmarks.md). Same arithmetic as layers.apply_rotary, op for op and in the same order
 * (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded before the sum: compiled without FMA
 * contraction), so the numbers are torch's bit for bit.
 */
#include <stdint.h>
#include <string.h>

/* Rows past this many go to the OpenMP threads; a decode step's few rows are done inline. */
#define PARALLEL_ROWS 32

static void rotate(const float *x, float *out, const float *cos, const float *sin, int half) {
    /* the same sums as the in-place loop below, into another row */
    for (int j = 0; j < half; j++) {
        const float x1 = x[j], x2 = x[half + j];
        out[j] = x1 * cos[j] - x2 * sin[j];
        out[half + j] = x2 * cos[j] + x1 * sin[j];
    }
}

/* q [rows][heads][dim] (row stride ldq), k and v [rows][kv_heads][dim] (ldk, ldv), heads and dims dense;
 * cos, sin [rows][dim / 2] dense; kv: the layer's view [blocks][k|v][slot][kv_head][dim] with block_stride
 * and kv_stride in elements; slots[i] = block * block_size + offset. Returns 0, or -1 (nothing written)
 * when a slot is outside the cache or the head size is odd: the caller then runs torch. */
int pdserve_rope_write_kv(float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                          const float *cos, const float *sin, float *kv, int64_t block_stride, int64_t kv_stride,
                          const int64_t *slots, int rows, int heads, int kv_heads, int dim, int block_size,
                          int64_t num_blocks) {
    if (dim % 2) return -1;
    for (int i = 0; i < rows; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return -1;
    const int half = dim / 2;
    const int64_t row_width = (int64_t)kv_heads * dim;
#pragma omp parallel for schedule(static) if (rows > PARALLEL_ROWS)
    for (int i = 0; i < rows; i++) {
        const float *c = cos + (int64_t)i * half, *s = sin + (int64_t)i * half;
        float *qi = q + i * ldq;
        for (int h = 0; h < heads; h++) {   /* in place: each pair (j, half + j) is read before it is written */
            float *x = qi + (int64_t)h * dim;
            for (int j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[half + j];
                x[j] = x1 * c[j] - x2 * s[j];
                x[half + j] = x2 * c[j] + x1 * s[j];
            }
        }
        float *slot = kv + (slots[i] / block_size) * block_stride + (slots[i] % block_size) * row_width;
        for (int h = 0; h < kv_heads; h++)
            rotate(k + i * ldk + (int64_t)h * dim, slot + (int64_t)h * dim, c, s, half);
        memcpy(slot + kv_stride, v + i * ldv, sizeof(float) * row_width);
    }
    return 0;
}
