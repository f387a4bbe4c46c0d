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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Query heads per KV head, and query heads per task (a sequence's): the bounds the kernel takes. */
#define MAX_GROUP 16
#define MAX_TASK_ROWS 256

#include "vec8.h"

/* The next block's rows of the task's heads (width floats from row, every slot), asked for while this block
 * is computed: blocks lie anywhere in the cache, so the hardware prefetcher, which follows streams within a
 * page, starts each block cold. Into L2, not L1: into L1 the kernel ran 1.5x slower on the 2-core Zen 4
 * EPYC (benchmarks/cpu_attention_kernel.py, docs/benchmarks.md), likely because a prefetch into L1 holds
 * one of the core's few L1 miss buffers until its line arrives, so the prefetches queued behind each other
 * and the loads. A line is used once per block, so the loads that follow pay L2's latency, not memory's. */
static inline void prefetch_row(const float *row, int width) {
    for (int d = 0; d < width; d += 16) __builtin_prefetch(row + d, 0, 1);
}

/* The largest of n >= 1 scores, eight lanes at a time (a scalar loop waited on each compare: 11 % of the
 * kernel's time). The maximum of finite numbers does not depend on the order it is taken in. */
static inline float max_of(const float *row, int32_t n) {
    v8 m = {row[0], row[0], row[0], row[0], row[0], row[0], row[0], row[0]};
    int32_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const v8 x = load8(row + t);
        const v8i above = x > m;
        m = (v8)(((v8i)x & above) | ((v8i)m & ~above));
    }
    float max = m[0];
    for (int i = 1; i < 8; i++) max = m[i] > max ? m[i] : max;
    for (; t < n; t++) max = row[t] > max ? row[t] : max;
    return max;
}

/* One task for head_dim = 8 * CHUNKS: one sequence's KV heads [h0, h1), each with its group of query heads,
 * against every key, softmax, then the weighted values; keys and values read once, in place, block by block.
 * A task of all the sequence's KV heads reads each block's keys, then its values, as one dense run (a task
 * per KV head read a third of every row and left the rest to another thread: 1.45x one pass over the cache);
 * the engine splits a sequence per KV head only when sequences are too few to keep the threads busy. Either
 * way each query head's sums run in the same order, so the split does not change a bit.
 * Scores are made eight keys at a time: each key's products stay in eight lanes, and one transposing sum
 * turns the eight keys' lanes into their eight scores (a horizontal sum per key cost more than its
 * products). The values' partial sums wait in acc between blocks. */
#define DEFINE_TASK(CHUNKS)                                                                              \
static void task_##CHUNKS(const float *q, const float *kv, const int32_t *block_table, int32_t seq_len,  \
                          int64_t block_stride, int64_t kv_stride, int block_size, int64_t slot_stride,   \
                          int h0, int h1, int group, float scale, float *scores, float *acc_buf,          \
                          float *out) {                                                                  \
    const int head_dim = 8 * (CHUNKS);                                                                   \
    const int rows_per_task = (h1 - h0) * group;                                                         \
    const int width = (h1 - h0) * head_dim;                                                              \
    const int32_t num_blocks = (seq_len + block_size - 1) / block_size;                                  \
    const float *keys = kv + (int64_t)h0 * head_dim;                                                     \
    const v8 scale8 = {scale, scale, scale, scale, scale, scale, scale, scale};                          \
    int32_t b = 0, slot = 0;                                                                             \
    const float *k = keys + (int64_t)block_table[0] * block_stride;                                      \
    const float *ahead = num_blocks > 1 ? keys + (int64_t)block_table[1] * block_stride : NULL;          \
    for (int32_t t = 0; t < seq_len; t += 8) {                                                           \
        const int n = seq_len - t < 8 ? seq_len - t : 8;                                                 \
        const float *rows[8];                                                                            \
        for (int i = 0; i < n; i++) {                                                                    \
            rows[i] = k;                                                                                 \
            if (ahead != NULL) prefetch_row(ahead + (int64_t)slot * slot_stride, width);                 \
            k += slot_stride;                                                                            \
            if (++slot == block_size && ++b < num_blocks) {                                              \
                slot = 0;                                                                                \
                k = keys + (int64_t)block_table[b] * block_stride;                                       \
                ahead = b + 1 < num_blocks ? keys + (int64_t)block_table[b + 1] * block_stride : NULL;   \
            }                                                                                            \
        }                                                                                                \
        for (int i = n; i < 8; i++) rows[i] = rows[0];                                                   \
        for (int r = 0; r < rows_per_task; r++) {                                                        \
            const float *qg = q + (int64_t)r * head_dim;                                                 \
            const int64_t head_offset = (int64_t)(r / group) * head_dim;                                 \
            v8 part[8];                                                                                  \
            for (int i = 0; i < 8; i++) {                                                                \
                const float *key = rows[i] + head_offset;                                                \
                v8 even = load8(qg) * load8(key), odd = load8(qg + 8) * load8(key + 8);                  \
                for (int c = 2; c + 1 < (CHUNKS); c += 2) {                                              \
                    even = fma8(load8(qg + 8 * c), load8(key + 8 * c), even);                            \
                    odd = fma8(load8(qg + 8 * c + 8), load8(key + 8 * c + 8), odd);                      \
                }                                                                                        \
                part[i] = even + odd;                                                                    \
            }                                                                                            \
            const v8 s = sum8x8(part) * scale8;                                                          \
            float *row = scores + (int64_t)r * seq_len + t;                                              \
            if (n == 8) store8(row, s);                                                                  \
            else memcpy(row, &s, sizeof(float) * n);                                                     \
        }                                                                                                \
    }                                                                                                    \
    float sums[MAX_TASK_ROWS];                                                                           \
    for (int r = 0; r < rows_per_task; r++) {                                                            \
        float *row = scores + (int64_t)r * seq_len;                                                      \
        const float max = max_of(row, seq_len);                                                          \
        const v8 max8 = {max, max, max, max, max, max, max, max};                                        \
        v8 total = {0};                                                                                  \
        int32_t t = 0;                                                                                   \
        for (; t + 8 <= seq_len; t += 8) {                                                               \
            const v8 p = exp8(load8(row + t) - max8);                                                    \
            store8(row + t, p);                                                                          \
            total += p;                                                                                  \
        }                                                                                                \
        float tail[8] = {0};                                                                             \
        const int32_t rest = seq_len - t;                                                                \
        memcpy(tail, row + t, sizeof(float) * rest);                                                     \
        const v8 p = exp8(load8(tail) - max8);                                                           \
        memcpy(row + t, &p, sizeof(float) * rest);                                                       \
        float sum = sum8(total);                                                                         \
        for (int32_t i = 0; i < rest; i++) sum += p[i];                                                  \
        sums[r] = sum;                                                                                   \
        memset(acc_buf + (int64_t)r * head_dim, 0, sizeof(float) * head_dim);                            \
    }                                                                                                    \
    const float *values = kv + kv_stride + (int64_t)h0 * head_dim;                                       \
    for (int32_t bb = 0, start = 0; bb < num_blocks; bb++, start += block_size) {                        \
        const float *block_values = values + (int64_t)block_table[bb] * block_stride;                    \
        const int32_t end = start + block_size < seq_len ? start + block_size : seq_len;                 \
        const float *ahead_v = bb + 1 < num_blocks ? values + (int64_t)block_table[bb + 1] * block_stride : NULL; \
        for (int r = 0; r < rows_per_task; r++) {                                                        \
            if (ahead_v != NULL)                                                                         \
                for (int sl = r * block_size / rows_per_task; sl < (r + 1) * block_size / rows_per_task; sl++) \
                    prefetch_row(ahead_v + (int64_t)sl * slot_stride, width);                            \
            const float *row = scores + (int64_t)r * seq_len;                                            \
            const float *v = block_values + (int64_t)(r / group) * head_dim;                             \
            float *a = acc_buf + (int64_t)r * head_dim;                                                  \
            v8 acc[CHUNKS];                                                                              \
            for (int c = 0; c < (CHUNKS); c++) acc[c] = load8(a + 8 * c);                                \
            for (int32_t tt = start; tt < end; tt++, v += slot_stride) {                                 \
                const v8 pt = {row[tt], row[tt], row[tt], row[tt], row[tt], row[tt], row[tt], row[tt]};  \
                for (int c = 0; c < (CHUNKS); c++) acc[c] = fma8(pt, load8(v + 8 * c), acc[c]);           \
            }                                                                                            \
            for (int c = 0; c < (CHUNKS); c++) store8(a + 8 * c, acc[c]);                                \
        }                                                                                                \
    }                                                                                                    \
    for (int r = 0; r < rows_per_task; r++) {                                                            \
        const float inv = 1.0f / sums[r];                                                                \
        for (int c = 0; c < (CHUNKS); c++)                                                               \
            store8(out + (int64_t)r * head_dim + 8 * c, load8(acc_buf + (int64_t)r * head_dim + 8 * c) * inv); \
    }                                                                                                    \
}

DEFINE_TASK(2)    /* head_dim 16: tiny test models */
DEFINE_TASK(4)    /* head_dim 32 */
DEFINE_TASK(8)    /* head_dim 64: the default model */
DEFINE_TASK(16)   /* head_dim 128: the 8B shapes */

typedef void (*task_fn)(const float *, const float *, const int32_t *, int32_t, int64_t, int64_t, int, int64_t,
                        int, int, int, float, float *, float *, float *);

/* q, out: [num_seqs][num_heads][head_dim], dense. block_tables: [num_seqs][max_blocks] int32.
 * seq_lens: [num_seqs] int32, each >= 1; every block id they cover below num_blocks.
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 * Returns 0, or -1 when a shape is outside what the kernel handles (head_dim 16, 32, 64 or 128, at most 16
 * query heads per KV head and 256 in all) or a length or block id is out of range, or memory ran out: the
 * caller then runs plain torch. */
int pdserve_decode_attention(const float *q, const float *kv, const int32_t *block_tables,
                             const int32_t *seq_lens, float *out, int num_seqs, int max_blocks,
                             int num_blocks, int64_t block_stride, int64_t kv_stride, int block_size, int num_heads,
                             int num_kv_heads, int head_dim, float scale) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads > MAX_TASK_ROWS) return -1;
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
    /* A task per sequence, unless there are too few sequences to keep every thread busy (one long
     * stream): then a task per (sequence, KV head). */
    const int split = num_seqs >= 4 * omp_get_max_threads() ? 1 : num_kv_heads;
    const int heads_per_task = num_kv_heads / split;
    const int64_t scores_len = (int64_t)max_len * heads_per_task * group;
    const int64_t acc_len = (int64_t)heads_per_task * group * head_dim;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (scores_len + acc_len));
        /* Every thread must reach the worksharing loop, also one whose allocation failed. */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int s = 0; s < num_seqs; s++) {
            for (int part = 0; part < split; part++) {
                if (scores == NULL) {
                    failed = 1;
                    continue;
                }
                const int h0 = part * heads_per_task;
                const int64_t row = (int64_t)s * num_heads + (int64_t)h0 * group;
                task(q + row * head_dim, kv, block_tables + (int64_t)s * max_blocks, seq_lens[s], block_stride,
                     kv_stride, block_size, (int64_t)num_kv_heads * head_dim, h0, h0 + heads_per_task, group,
                     scale, scores, scores + scores_len, out + row * head_dim);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
