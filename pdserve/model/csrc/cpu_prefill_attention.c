/* Paged prefill attention on CPU, float32: the prompt chunks of a step (one token or many), each query
 * token against every key up to its own position, read straight from the paged KV cache.
 *
 * Why a kernel: torch's SDPA took 1 ms a layer for one 256-token prompt of the default model on the
 * 2-core AVX-512 EPYC (33-39 ms of a 208-241 ms prefill, docs/benchmarks.md), after two index_select gathers
 * of the cache; its matmuls run at ATen's GEMM rate there, under half of what the FMA units give.
 *
 * A task is one sequence's KV head and a block of its query positions: the rows are (position, query
 * head of that KV head's group), so each key and value read serves every head that shares it. Keys come
 * in tiles of KT in position order; per tile: scores of all rows (a GEMM-like tile: broadcasts of q
 * against the tile's keys, transposed once per tile into Kt), then the online softmax (running maximum
 * m, sum l, output O rescaled by e^(m_old - m_new)), then O += P V (broadcasts of P against value rows).
 *
 * Every row's numbers are the same whatever else is in its task, its step or its chunk: a row goes
 * through the tiles 0, 1, ... in order, each score is one FMA chain over the head dimension, and a tile
 * past the row's position changes nothing (its probabilities are exactly 0, its maximum is -inf, so
 * the rescale factor is e^0 = 1, exactly; O never holds -0, so adding 0 V leaves it as it was). So
 * chunked prefill gives the bits unchunked prefill gives, and P's prefill the bits of a colocated one.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#define KT 32            /* keys per tile: one online-softmax rescale per tile */
#define TASK_ROWS 96     /* query rows a task aims for (positions x heads of the group) */
#define MAX_ROWS TASK_ROWS   /* whole positions of a group of up to 16 heads fit in TASK_ROWS */
#define MAX_DIM 128

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define LANES 16
#define S_ROWS 12        /* score tile: 12 rows x 32 keys, 24 accumulators of 32 registers */
#define ACC_REGS 24
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
#else
typedef v8 vf;
#define LANES 8
#define S_ROWS 3         /* 3 rows x 32 keys, 12 accumulators of 16 registers */
#define ACC_REGS 12
static inline vf vload(const float *p) { return load8(p); }
static inline void vstore(float *p, vf v) { store8(p, v); }
static inline vf vset1(float a) { return (v8){a, a, a, a, a, a, a, a}; }
static inline vf vfma(vf a, vf b, vf c) { return fma8(a, b, c); }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vzero(void) { return (v8){0}; }
#endif
#define KV (KT / LANES)  /* vectors per tile row of keys */

/* Scores of S_ROWS rows (rows[i]: the query row, head_dim floats) against the tile's keys, kt [dim][KT]
 * with rows ldk floats apart: s[i][j] = sum over d, in order, of rows[i][d] * key_j[d]. Rows past n point
 * at a real row and are computed but not stored. */
static inline __attribute__((always_inline)) void score_tile(const float *const *rows, int n, const float *kt,
                                                           int64_t ldk, int dim, float *s) {
    vf acc[S_ROWS][KV];
    for (int i = 0; i < S_ROWS; i++)
        for (int c = 0; c < KV; c++) acc[i][c] = vzero();
    for (int d = 0; d < dim; d++) {
        vf b[KV];
        for (int c = 0; c < KV; c++) b[c] = vload(kt + d * ldk + c * LANES);
        for (int i = 0; i < S_ROWS; i++) {
            const vf a = vset1(rows[i][d]);
            for (int c = 0; c < KV; c++) acc[i][c] = vfma(a, b[c], acc[i][c]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int c = 0; c < KV; c++) vstore(s + i * KT + c * LANES, acc[i][c]);
}

static inline v16 max16(v16 a, v16 b) {
    const v16i greater = a > b;
    return (v16)(((v16i)a & greater) | ((v16i)b & ~greater));
}

/* Every lane the largest of v's, or their sum (in one fixed order): halves, quarters, eighths, pairs. */
static inline v16 all_max16(v16 v) {
    const v16i swaps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                           {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                           {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                           {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
    for (int i = 0; i < 4; i++) v = max16(v, __builtin_shuffle(v, swaps[i]));
    return v;
}

static inline float sum16(v16 v) {
    const v16i swaps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                           {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                           {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                           {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
    for (int i = 0; i < 4; i++) v = v + __builtin_shuffle(v, swaps[i]);
    return v[0];
}

/* Which of a row's tile keys it sees: the first `visible` (none when visible <= 0). */
static inline void shown_keys(int visible, v16i shown[KT / 16]) {
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int c = 0; c < KT / 16; c++) shown[c] = lane + (float)(16 * c) < (float)visible;
}

/* The online softmax over one tile for every row of a task: s [rows][KT] scores in, probabilities out
 * (exactly 0 for keys past a row's position); m and l the rows' running maxima and sums; alpha out,
 * the factor each row's O must be scaled by before this tile's values are added. A row at position
 * `first + r / group` sees the tile's keys k0 .. its position. Sixteen lanes at a time, and the rescale
 * factors sixteen rows at a time: the exponentials are a large share of the kernel's work. */
static void softmax_tile(float *s, int rows, int group, int first, int k0, int nk, float scale, float *m,
                         float *l, float *alpha) {
    const v16 ninf = (v16){0} - INFINITY;
    for (int r = 0; r < rows; r++) {
        const int visible = first + r / group - k0 + 1;
        v16i shown[KT / 16];
        shown_keys(visible < nk ? visible : nk, shown);
        v16 top = ninf;
        for (int c = 0; c < KT / 16; c++) {
            v16 x;
            memcpy(&x, s + r * KT + 16 * c, sizeof x);
            x = (v16)(((v16i)(x * scale) & shown[c]) | ((v16i)ninf & ~shown[c]));
            memcpy(s + r * KT + 16 * c, &x, sizeof x);
            top = max16(top, x);
        }
        const float tile_max = all_max16(top)[0];   /* the maximum does not depend on the order */
        alpha[r] = m[r];                            /* m_old, until the pass below */
        m[r] = tile_max > m[r] ? tile_max : m[r];
    }
    /* e^(m_old - m_new): exactly 1 when the maximum stays (e^0 is 1 in exp16); 0 on the first tile, where
     * O and l are still 0 */
    for (int r = 0; r < rows; r += 16) {
        v16 old, new;
        memcpy(&old, alpha + r, sizeof old);   /* alpha and m hold MAX_ROWS + 16 floats */
        memcpy(&new, m + r, sizeof new);
        const v16i started = old > ninf;
        v16 factor = (v16)((v16i)exp16(old - new) & started);
        memcpy(alpha + r, &factor, sizeof factor);
    }
    for (int r = 0; r < rows; r++) {
        const int visible = first + r / group - k0 + 1;
        v16i shown[KT / 16];
        shown_keys(visible < nk ? visible : nk, shown);
        const v16 top = (v16){0} + m[r];
        v16 total = {0};
        for (int c = 0; c < KT / 16; c++) {
            v16 x;
            memcpy(&x, s + r * KT + 16 * c, sizeof x);
            const v16 p = (v16)((v16i)exp16(x - top) & shown[c]);
            memcpy(s + r * KT + 16 * c, &p, sizeof p);
            total += p;
        }
        l[r] = l[r] * alpha[r] + sum16(total);
    }
}

/* O rows [r0, r0 + n) (dim floats each) scaled by their alpha, plus p[r][j] * value_j over the tile's nk
 * keys, in key order. PV_ROWS rows at a time, so each value row loaded serves them all. */
#define DEFINE_PV(DIM)                                                                                   \
static void pv_##DIM(float *o, const float *p, const float *alpha, const float *const *values, int nk,  \
                     int rows) {                                                                         \
    enum { VD = DIM / LANES > 0 ? DIM / LANES : 1, PV_ROWS = ACC_REGS / VD > 0 ? ACC_REGS / VD : 1 };    \
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {                                                         \
        const int n = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;                                         \
        vf acc[PV_ROWS][VD];                                                                             \
        for (int i = 0; i < PV_ROWS; i++) {                                                              \
            const int r = r0 + (i < n ? i : 0);                                                          \
            const vf a = vset1(alpha[r]);                                                                \
            for (int c = 0; c < VD; c++) acc[i][c] = vmul(vload(o + r * DIM + c * LANES), a);            \
        }                                                                                                \
        for (int j = 0; j < nk; j++) {                                                                   \
            vf v[VD];                                                                                    \
            for (int c = 0; c < VD; c++) v[c] = vload(values[j] + c * LANES);                            \
            for (int i = 0; i < PV_ROWS; i++) {                                                          \
                const vf pj = vset1(p[(r0 + (i < n ? i : 0)) * KT + j]);                                 \
                for (int c = 0; c < VD; c++) acc[i][c] = vfma(pj, v[c], acc[i][c]);                      \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < n; i++)                                                                      \
            for (int c = 0; c < VD; c++) vstore(o + (r0 + i) * DIM + c * LANES, acc[i][c]);              \
    }                                                                                                    \
}
DEFINE_PV(16)
DEFINE_PV(32)
DEFINE_PV(64)
DEFINE_PV(128)

/* Keys [k0, k0 + KT) of KV head g, transposed into kt [dim][ldk] from column 0; positions past `end`
 * (exclusive) are zeros. */
static void transpose_keys(const float *kv, const int32_t *block_table, int64_t block_stride, int block_size,
                           int64_t slot_stride, int g, int dim, int k0, int end, float *kt, int64_t ldk) {
    const int nk = end - k0 < KT ? end - k0 : KT;
    const float *keys[KT];
    for (int j = 0; j < nk; j++) {
        const int pos = k0 + j;
        keys[j] = kv + (int64_t)block_table[pos / block_size] * block_stride + (int64_t)(pos % block_size) * slot_stride
                  + (int64_t)g * dim;
    }
    for (int d = 0; d < dim; d++) {
        for (int j = 0; j < nk; j++) kt[d * ldk + j] = keys[j][d];
        for (int j = nk; j < KT; j++) kt[d * ldk + j] = 0.0f;
    }
}

/* One task: KV head g of a sequence, query positions [first, last] (absolute positions; the chunk's query
 * token t sits at position `start + t`). q rows of token t: q + t * ldq, heads dense; out the same
 * tokens, [heads][dim] dense per token. keys_t: the head's keys transposed once for every task,
 * [dim][ldk] (pdserve_prefill_attention), or NULL: each tile is transposed here into kt. A tile's keys
 * past `last` are then real keys, not zeros, but their scores are masked to -inf before they are used,
 * so a row's numbers are the same either way. */
static void task(const float *q, int64_t ldq, const float *kv, const int32_t *block_table, int64_t block_stride,
                 int64_t kv_stride, int block_size, int num_kv_heads, int group, int dim, int g, int start,
                 int first, int last, float scale, float *out, const float *keys_t, int64_t ldk, float *kt,
                 float *s, float *o, float *m, float *l, float *alpha) {
    const int positions = last - first + 1, rows = positions * group;
    const int64_t slot_stride = (int64_t)num_kv_heads * dim;
    const float *row_ptr[MAX_ROWS + S_ROWS];
    for (int r = 0; r < rows; r++)
        row_ptr[r] = q + (int64_t)(first - start + r / group) * ldq + (int64_t)(g * group + r % group) * dim;
    for (int r = rows; r < rows + S_ROWS; r++) row_ptr[r] = row_ptr[0];
    for (int r = 0; r < rows + 16; r++) { m[r] = -INFINITY; l[r] = 0.0f; alpha[r] = 0.0f; }
    memset(o, 0, sizeof(float) * rows * dim);
    for (int k0 = 0; k0 <= last; k0 += KT) {
        const int nk = last + 1 - k0 < KT ? last + 1 - k0 : KT;
        const float *values[KT];
        for (int j = 0; j < nk; j++) {
            const int pos = k0 + j;
            values[j] = kv + (int64_t)block_table[pos / block_size] * block_stride
                        + (int64_t)(pos % block_size) * slot_stride + (int64_t)g * dim + kv_stride;
        }
        const float *tile = keys_t ? keys_t + k0 : kt;
        if (!keys_t)
            transpose_keys(kv, block_table, block_stride, block_size, slot_stride, g, dim, k0, last + 1, kt, KT);
        for (int r = 0; r < rows; r += S_ROWS)
            score_tile(row_ptr + r, rows - r < S_ROWS ? rows - r : S_ROWS, tile, keys_t ? ldk : KT, dim,
                       s + r * KT);
        softmax_tile(s, rows, group, first, k0, nk, scale, m, l, alpha);
        switch (dim) {
            case 16: pv_16(o, s, alpha, values, nk, rows); break;
            case 32: pv_32(o, s, alpha, values, nk, rows); break;
            case 64: pv_64(o, s, alpha, values, nk, rows); break;
            default: pv_128(o, s, alpha, values, nk, rows); break;
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + (int64_t)(first - start + r / group) * group * num_kv_heads * dim
                     + (int64_t)(g * group + r % group) * dim;
        for (int d = 0; d < dim; d++) dst[d] = o[r * dim + d] * inv;
    }
}

/* The most bytes of transposed keys one call shares between its tasks; 0: every task transposes its own
 * tiles (the A/B's other side, and the path taken past this size). */
int64_t pdserve_prefill_shared_keys_max_bytes = (int64_t)256 << 20;
/* Calls that shared transposed keys (read by the tests: the shared path did run) */
int64_t pdserve_prefill_shared_keys_calls = 0;

/* The prefill sequences of a step. Sequence i's query tokens are rows [query_start[i], query_start[i+1])
 * of q (row stride ldq floats; [heads][dim] dense in a row) and of out ([T][heads][dim] dense); they are
 * its positions [seq_lens[i] - query_len, seq_lens[i]), their K and V already in the cache (kv: the
 * layer's view [blocks][k|v][slot][kv_head][dim], block_stride and kv_stride in elements).
 * Returns 0, or -1 when a shape is outside what the kernel handles (head_dim 16, 32, 64 or 128, at most
 * 16 query heads per KV head), a length or block id is out of range, or memory ran out: the caller then
 * runs torch. */
int pdserve_prefill_attention(const float *q, int64_t ldq, const float *kv, const int32_t *block_tables,
                              const int32_t *query_start, const int32_t *seq_lens, float *out, int num_seqs,
                              int max_blocks, int num_blocks, int64_t block_stride, int64_t kv_stride,
                              int block_size, int num_heads, int num_kv_heads, int head_dim, float scale) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads < 1 || num_heads % num_kv_heads != 0 || block_size < 1)
        return -1;
    const int group = num_heads / num_kv_heads;
    if (group > 16 || !(head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128)) return -1;
    const int per_task = TASK_ROWS / group > 0 ? TASK_ROWS / group : 1;   /* positions per task */
    int64_t tasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t query_len = query_start[s + 1] - query_start[s], len = seq_lens[s];
        if (query_len < 1 || len < query_len || len > (int64_t)max_blocks * block_size) return -1;
        /* A block id outside the cache would read another process's memory, not raise: refuse it. */
        /* (in 64 bits: len + block_size - 1 passes 2^31 near the longest lengths) */
        for (int64_t b = 0; b < ((int64_t)len + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[(int64_t)s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return -1;
        }
        tasks += (int64_t)((query_len + per_task - 1) / per_task) * num_kv_heads;
    }
    /* (sequence, position block, KV head) in a list, the blocks late in each sequence (most keys) first,
     * so the threads' last tasks are short ones */
    int32_t *list = malloc(sizeof(int32_t) * 3 * (tasks > 0 ? tasks : 1));
    if (list == NULL) return -1;
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t query_len = query_start[s + 1] - query_start[s];
        for (int b = (query_len + per_task - 1) / per_task - 1; b >= 0; b--)
            for (int g = 0; g < num_kv_heads; g++) {
                list[3 * n] = s;
                list[3 * n + 1] = b;
                list[3 * n + 2] = g;
                n++;
            }
    }
    /* Each sequence's keys, transposed once per KV head for all its tasks ([dim][len rounded up to KT],
     * zeros past len): a task per block of query positions transposed every tile it read, again for each
     * task (9 % of the kernel's time at 2,048 tokens). A sequence of one task per head (a short chunk) is
     * left out, its task's tiles staying in its own small buffer; past
     * pdserve_prefill_shared_keys_max_bytes in all, every task transposes its own tiles. */
    int64_t *keys_off = malloc(sizeof(int64_t) * 2 * ((int64_t)num_seqs + 1));
    if (keys_off == NULL) {
        free(list);
        return -1;
    }
    int64_t *units_before = keys_off + num_seqs + 1;   /* (KV head, tile) units of the sequences before s */
    keys_off[0] = units_before[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t query_len = query_start[s + 1] - query_start[s];
        const int64_t tiles = query_len > per_task ? ((int64_t)seq_lens[s] + KT - 1) / KT : 0;
        keys_off[s + 1] = keys_off[s] + (int64_t)num_kv_heads * head_dim * tiles * KT;
        units_before[s + 1] = units_before[s] + num_kv_heads * tiles;
    }
    float *keys_t = keys_off[num_seqs] > 0 && keys_off[num_seqs] * (int64_t)sizeof(float)
                                               <= pdserve_prefill_shared_keys_max_bytes
                    ? malloc(sizeof(float) * keys_off[num_seqs]) : NULL;
    if (keys_t) pdserve_prefill_shared_keys_calls++;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        if (keys_t) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units_before[num_seqs]; u++) {
                int lo = 0, hi = num_seqs - 1;   /* the sequence whose tiles hold unit u */
                while (lo < hi) {
                    const int mid = (lo + hi + 1) / 2;
                    if (units_before[mid] <= u) lo = mid;
                    else hi = mid - 1;
                }
                const int64_t tiles = (units_before[lo + 1] - units_before[lo]) / num_kv_heads;
                const int64_t i = u - units_before[lo];
                const int g = (int)(i / tiles), k0 = (int)(i % tiles) * KT;
                float *head_keys = keys_t + keys_off[lo] + (int64_t)g * head_dim * tiles * KT;
                transpose_keys(kv, block_tables + (int64_t)lo * max_blocks, block_stride, block_size, slot_stride, g,
                               head_dim, k0, seq_lens[lo], head_keys + k0, tiles * KT);
            }
        }
        float *buf = malloc(sizeof(float) * ((int64_t)MAX_DIM * KT + (int64_t)MAX_ROWS * KT
                                             + (int64_t)MAX_ROWS * MAX_DIM + 3 * (MAX_ROWS + 16)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (buf == NULL) {
                failed = 1;
                continue;
            }
            const int s = list[3 * t], b = list[3 * t + 1], g = list[3 * t + 2];
            const int32_t query_len = query_start[s + 1] - query_start[s];
            const int start = seq_lens[s] - query_len;
            const int first = start + b * per_task;
            const int last = first + per_task - 1 < seq_lens[s] - 1 ? first + per_task - 1 : seq_lens[s] - 1;
            float *kt = buf, *sc = kt + MAX_DIM * KT, *o = sc + MAX_ROWS * KT, *m = o + MAX_ROWS * MAX_DIM;
            const int64_t ldk = ((int64_t)seq_lens[s] + KT - 1) / KT * KT;
            const int shared = keys_t && keys_off[s + 1] > keys_off[s];
            task(q + (int64_t)query_start[s] * ldq, ldq, kv, block_tables + (int64_t)s * max_blocks, block_stride,
                 kv_stride, block_size, num_kv_heads, group, head_dim, g, start, first, last, scale,
                 out + (int64_t)query_start[s] * num_heads * head_dim,
                 shared ? keys_t + keys_off[s] + (int64_t)g * head_dim * ldk : NULL, ldk, kt, sc, o, m,
                 m + MAX_ROWS + 16, m + 2 * (MAX_ROWS + 16));
        }
        free(buf);
    }
    free(keys_t);
    free(keys_off);
    free(list);
    return failed ? -1 : 0;
}
