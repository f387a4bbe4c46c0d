/* Paged decode attention on CPU, float32: one query token per sequence, read straight from the paged
 * KV cache (no gather into a contiguous copy, no padding, no mask).
 *
 * Why a kernel: in plain torch every sequence of every layer costs two index_select gathers and one
 * SDPA call (64 sequences x 30 layers = 5,760 ops per decode step of the default model), and the
 * gathers copy the whole context before SDPA reads it again. Here each (sequence, KV head) task reads
 * its keys and values once, in place, for all the query heads that share that KV head (GQA).
 *
 * Compiled at first use by pdserve/model/cpu_kernels.py with -fopenmp; the shared library then takes
 * the libgomp torch already loaded (same soname), so it runs on torch's OpenMP threads and obeys
 * torch.set_num_threads instead of starting a second pool that would fight it for the cores.
 *
 * Layout (model/attention.py): the layer's view kv_layer[block][k|v][slot][kv_head][dim], with
 * block_stride and kv_stride in elements; slots, heads and dims are dense.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The scores of one task: the context length times its query heads, on the heap when large. */
#define STACK_SCORES 4096
#define MAX_GROUP 16

#include "vec8.h"

/* One (sequence, KV head) task for head_dim = 8 * CHUNKS: its group of query heads against every key,
 * softmax, then the weighted values; keys and values read once, in place. */
#define DEFINE_TASK(CHUNKS)                                                                              \
static void task_##CHUNKS(const float *q, const float *kv, const int32_t *block_table, int32_t seq_len,  \
                          int64_t block_stride, int64_t kv_stride, int block_size, int64_t slot_stride,   \
                          int kv_head, int group, float scale, float *scores, float *out) {              \
    const int head_dim = 8 * (CHUNKS);                                                                   \
    float maxes[MAX_GROUP], sums[MAX_GROUP];                                                             \
    for (int g = 0; g < group; g++) { maxes[g] = -INFINITY; sums[g] = 0.0f; }                            \
    for (int32_t t = 0; t < seq_len; t++) {                                                              \
        const float *k = kv + (int64_t)block_table[t / block_size] * block_stride                        \
                         + (int64_t)(t % block_size) * slot_stride + (int64_t)kv_head * head_dim;        \
        v8 kc[CHUNKS];                                                                                   \
        for (int c = 0; c < (CHUNKS); c++) kc[c] = load8(k + 8 * c);                                     \
        for (int g = 0; g < group; g++) {                                                                \
            const float *qg = q + (int64_t)g * head_dim;                                                 \
            v8 even = {0}, odd = {0};                                                                    \
            for (int c = 0; c + 1 < (CHUNKS); c += 2) {                                                  \
                even += load8(qg + 8 * c) * kc[c];                                                       \
                odd += load8(qg + 8 * c + 8) * kc[c + 1];                                                \
            }                                                                                            \
            if ((CHUNKS) % 2) even += load8(qg + 8 * ((CHUNKS) - 1)) * kc[(CHUNKS) - 1];                 \
            float score = sum8(even + odd) * scale;                                                      \
            scores[(int64_t)g * seq_len + t] = score;                                                      \
            if (score > maxes[g]) maxes[g] = score;                                                      \
        }                                                                                                \
    }                                                                                                    \
    for (int g = 0; g < group; g++) {                                                                    \
        float *row = scores + (int64_t)g * seq_len;                                                      \
        const v8 max = {maxes[g], maxes[g], maxes[g], maxes[g], maxes[g], maxes[g], maxes[g], maxes[g]};  \
        v8 total = {0};                                                                                  \
        int32_t t = 0;                                                                                   \
        for (; t + 8 <= seq_len; t += 8) {                                                               \
            const v8 p = exp8(load8(row + t) - max);                                                     \
            store8(row + t, p);                                                                          \
            total += p;                                                                                  \
        }                                                                                                \
        float tail[8] = {0};                                                                             \
        const int32_t rest = seq_len - t;                                                                \
        memcpy(tail, row + t, sizeof(float) * rest);                                                     \
        const v8 p = exp8(load8(tail) - max);                                                            \
        memcpy(row + t, &p, sizeof(float) * rest);                                                       \
        sums[g] = sum8(total);                                                                           \
        for (int32_t i = 0; i < rest; i++) sums[g] += p[i];                                              \
    }                                                                                                    \
    for (int g = 0; g < group; g++) {                                                                    \
        v8 acc[CHUNKS];                                                                                  \
        for (int c = 0; c < (CHUNKS); c++) acc[c] = (v8){0};                                             \
        for (int32_t t = 0; t < seq_len; t++) {                                                          \
            const float *v = kv + (int64_t)block_table[t / block_size] * block_stride + kv_stride        \
                             + (int64_t)(t % block_size) * slot_stride + (int64_t)kv_head * head_dim;    \
            const float p = scores[(int64_t)g * seq_len + t];                                              \
            for (int c = 0; c < (CHUNKS); c++) acc[c] += p * load8(v + 8 * c);                           \
        }                                                                                                \
        const float inv = 1.0f / sums[g];                                                                \
        for (int c = 0; c < (CHUNKS); c++) store8(out + (int64_t)g * head_dim + 8 * c, acc[c] * inv);    \
    }                                                                                                    \
}

DEFINE_TASK(2)    /* head_dim 16: tiny test models */
DEFINE_TASK(4)    /* head_dim 32 */
DEFINE_TASK(8)    /* head_dim 64: the default model */
DEFINE_TASK(16)   /* head_dim 128: the 8B shapes */

typedef void (*task_fn)(const float *, const float *, const int32_t *, int32_t, int64_t, int64_t, int, int64_t,
                        int, int, float, float *, float *);

/* q, out: [num_seqs][num_heads][head_dim], dense. block_tables: [num_seqs][max_blocks] int32.
 * seq_lens: [num_seqs] int32, each >= 1; every block id they cover below num_blocks.
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 * Returns 0, or -1 when a shape is outside what the kernel handles (head_dim 16, 32, 64 or 128, at most 16
 * query heads per KV head) or a length or block id is out of range: the caller then runs plain torch. */
int pdserve_decode_attention(const float *q, const float *kv, const int32_t *block_tables,
                             const int32_t *seq_lens, float *out, int num_seqs, int max_blocks,
                             int num_blocks, int64_t block_stride, int64_t kv_stride, int block_size, int num_heads,
                             int num_kv_heads, int head_dim, float scale) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return -1;
    task_fn task = head_dim == 16 ? task_2 : head_dim == 32 ? task_4 : head_dim == 64 ? task_8
                 : head_dim == 128 ? task_16 : NULL;
    if (task == NULL) return -1;
    int32_t max_len = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t len = seq_lens[s];
        if (len < 1 || len > (int64_t)max_blocks * block_size) return -1;
        if (len > max_len) max_len = len;
        /* A block id outside the cache would read another process's memory, not raise: refuse it. */
        for (int32_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[(int64_t)s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return -1;
        }
    }
    const int64_t scores_len = (int64_t)max_len * group;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float stack_scores[STACK_SCORES];
        float *scores = scores_len <= STACK_SCORES ? stack_scores : malloc(sizeof(float) * scores_len);
        /* Every thread must reach the worksharing loop, also one whose allocation failed. */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int s = 0; s < num_seqs; s++) {
            for (int h = 0; h < num_kv_heads; h++) {
                if (scores == NULL) {
                    failed = 1;
                    continue;
                }
                const int64_t row = (int64_t)s * num_heads + (int64_t)h * group;
                task(q + row * head_dim, kv, block_tables + (int64_t)s * max_blocks, seq_lens[s], block_stride,
                     kv_stride, block_size, (int64_t)num_kv_heads * head_dim, h, group, scale, scores,
                     out + row * head_dim);
            }
        }
        if (scores != stack_scores) free(scores);
    }
    return failed ? -1 : 0;
}
