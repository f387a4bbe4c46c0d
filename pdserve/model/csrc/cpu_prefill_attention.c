/* Paged prefill attention on CPU, float32: the prompt chunks of a step (one token or many), each query
 * token against every key up to its own position, read straight from the paged KV cache.
 *
 * Why a kernel: torch's SDPA took 1 ms a layer for one 256-token prompt of the default model on the
 * 2-core AVX-512 EPYC (33-39 ms of a 208-241 ms prefill, docs/benchmarks.md), after two index_select gathers
 * of the cache; its matmuls run at ATen's GEMM rate there, under half of what the FMA units give.
 *
 * A task is one sequence's KV head and a block of its query positions: the rows are (position, query
 * head of that KV head's group), so each key and value read serves every head that shares it. The task
 * holds its rows transposed, a row per vector lane: Q^T [dim][rows], the scores S^T [key][rows] and
 * O^T [dim][rows]. Keys come in tiles of KT in position order; per tile: the scores (a GEMM tile: Q^T
 * vectors against broadcasts of the keys, read in place from the cache), then the online softmax (running
 * maximum m, sum l, O rescaled by e^(m_old - m_new)), then O^T += V^T P^T (P^T vectors against broadcasts
 * of the values). With rows in the lanes, the softmax's maxima and sums over a tile's keys are vector
 * operations, not reductions across one register's lanes, and a broadcast serves three vectors of rows.
 *
 * Every row's numbers are the same whatever else is in its task, its step or its chunk: a row goes
 * through the tiles 0, 1, ... in order, each score is one FMA chain over the head dimension, a tile's sum
 * of probabilities is taken in one fixed order, and a tile past the row's position changes nothing (its
 * probabilities are exactly 0, its maximum is -inf, so the rescale factor is e^0 = 1, exactly; adding
 * 0 V leaves O as it was, but for a -0, which a product too small for a float rounds to and which a later
 * masked key's +0 turns into +0: the output is written as O / l + 0, a +0 either way). So chunked prefill
 * gives the bits unchunked prefill gives, and P's prefill the bits of a colocated one.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#define KT 64            /* keys per tile: one online-softmax rescale per tile (1.02-1.06x faster than 32) */
#define TASK_ROWS 96     /* query rows a task aims for (positions x heads of the group) */
#define MAX_DIM 128
/* The longest sequence served: positions stay far from int's end in the tile loops (a key tile's start
 * past a sequence of 2^31 - 1 would wrap around), and no model serves a billion tokens. */
#define MAX_SEQ_LEN (1 << 30)

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
typedef v16 vv;          /* the same register, for the softmax's lane-wise arithmetic */
typedef v16i vvi;
#define LANES 16
#define vexp_nonpositive exp16_nonpositive   /* the softmax's e^x (vec8.h) */
/* Micro-tiles: SK keys x SC row vectors of scores, SD dimensions x SC row vectors of O: 24 accumulators
 * and the SC row vectors in registers, eleven loads and broadcasts per 24 FMAs. (At 4 keys x 6 row
 * vectors GCC left the row vectors in memory, reloading each for every key: slower.) */
#define SK 8
#define SC 3
#define SD 8
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
#else
typedef v8 vf;
typedef v8 vv;
typedef v8i vvi;
#define LANES 8
#define vexp_nonpositive exp8_nonpositive
#define SK 4             /* 12 accumulators and 3 row vectors of the sixteen registers */
#define SC 3
#define SD 4
static inline vf vload(const float *p) { return load8(p); }
static inline void vstore(float *p, vf v) { store8(p, v); }
static inline vf vset1(float a) { return (v8){a, a, a, a, a, a, a, a}; }
static inline vf vfma(vf a, vf b, vf c) { return fma8(a, b, c); }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vzero(void) { return (v8){0}; }
#endif
_Static_assert(KT % SK == 0 && 16 % SD == 0 && SC == 3, "a tile's keys in whole micro-tiles, head sizes in whole SD");
#define MAX_VECS (TASK_ROWS / LANES)   /* row vectors of a task: whole positions of a group of up to 16 heads fit */

/* Scores of row vectors [0, NC) of qt (Q^T, [dim][ld]) against SK keys (keys[j]: dim floats):
 * st[j][rows] = sum over d, in order, of q_row[d] * key_j[d], one FMA chain. */
#define DEFINE_SCORE(NC)                                                                                 \
static void score_##NC(const float *qt, int ld, const float *const *keys, int dim, float *st) {         \
    vf acc[SK][NC];                                                                                      \
    for (int j = 0; j < SK; j++)                                                                         \
        for (int c = 0; c < NC; c++) acc[j][c] = vzero();                                                \
    for (int d = 0; d < dim; d++) {                                                                      \
        vf a[NC];                                                                                        \
        for (int c = 0; c < NC; c++) a[c] = vload(qt + d * ld + c * LANES);                              \
        for (int j = 0; j < SK; j++) {                                                                   \
            const vf b = vset1(keys[j][d]);                                                              \
            for (int c = 0; c < NC; c++) acc[j][c] = vfma(a[c], b, acc[j][c]);                           \
        }                                                                                                \
    }                                                                                                    \
    for (int j = 0; j < SK; j++)                                                                         \
        for (int c = 0; c < NC; c++) vstore(st + j * ld + c * LANES, acc[j][c]);                         \
}

/* O^T rows [d0, d0 + SD), row vectors [0, NC): scaled by their alpha (0 when `fresh`, the task's first
 * tile: O^T is not read then, and 0 * 0 was +0 too), plus p[j][rows] * value_j[d] over the tile's nk
 * keys, in key order. */
#define DEFINE_PV(NC)                                                                                    \
static void pv_##NC(float *ot, int ld, const float *st, const float *alpha, const float *const *values,  \
                    int d0, int nk, int fresh) {                                                         \
    vf acc[SD][NC];                                                                                      \
    for (int c = 0; c < NC; c++) {                                                                       \
        const vf a = vload(alpha + c * LANES);                                                           \
        for (int i = 0; i < SD; i++)                                                                     \
            acc[i][c] = fresh ? vzero() : vmul(vload(ot + (d0 + i) * ld + c * LANES), a);                \
    }                                                                                                    \
    for (int j = 0; j < nk; j++) {                                                                       \
        vf p[NC];                                                                                        \
        for (int c = 0; c < NC; c++) p[c] = vload(st + j * ld + c * LANES);                              \
        for (int i = 0; i < SD; i++) {                                                                   \
            const vf b = vset1(values[j][d0 + i]);                                                       \
            for (int c = 0; c < NC; c++) acc[i][c] = vfma(p[c], b, acc[i][c]);                           \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < SD; i++)                                                                         \
        for (int c = 0; c < NC; c++) vstore(ot + (d0 + i) * ld + c * LANES, acc[i][c]);                  \
}

DEFINE_SCORE(1)
DEFINE_SCORE(2)
DEFINE_SCORE(3)
DEFINE_PV(1)
DEFINE_PV(2)
DEFINE_PV(3)

static void scores(const float *qt, int ld, int nv, const float *const *keys, int nk, int dim, float *st) {
    for (int j = 0; j < nk; j += SK)
        for (int c = 0; c < nv; c += SC) {
            const float *a = qt + c * LANES;
            float *s = st + j * ld + c * LANES;
            switch (nv - c < SC ? nv - c : SC) {
                case 1: score_1(a, ld, keys + j, dim, s); break;
                case 2: score_2(a, ld, keys + j, dim, s); break;
                default: score_3(a, ld, keys + j, dim, s); break;
            }
        }
}

static void accumulate_values(float *ot, int ld, int nv, const float *st, const float *alpha,
                              const float *const *values, int nk, int dim, int fresh) {
    for (int d0 = 0; d0 < dim; d0 += SD)
        for (int c = 0; c < nv; c += SC) {
            float *o = ot + c * LANES;
            const float *s = st + c * LANES, *a = alpha + c * LANES;
            switch (nv - c < SC ? nv - c : SC) {
                case 1: pv_1(o, ld, s, a, values, d0, nk, fresh); break;
                case 2: pv_2(o, ld, s, a, values, d0, nk, fresh); break;
                default: pv_3(o, ld, s, a, values, d0, nk, fresh); break;
            }
        }
}

static inline vv vload_vv(const float *p) {
    vv v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore_vv(float *p, vv v) { memcpy(p, &v, sizeof v); }

static inline vv vmax(vv a, vv b) {
    const vvi greater = a > b;
    return (vv)(((vvi)a & greater) | ((vvi)b & ~greater));
}

/* The online softmax over one tile, a vector of rows at a time: st [key][ld] scores in, probabilities
 * out (exactly 0 for keys past a row's position), for the tile's keys k0 .. k0 + nk - 1; pos the rows'
 * positions; m and l the rows' running maxima and sums; alpha out, the factor each row's O must be scaled
 * by before this tile's values are added. `all_seen`: every row sees every key of the tile (no masks). */
static void softmax_tile(float *st, int ld, int nv, const int32_t *pos, int k0, int nk, int all_seen,
                         float scale, float *m, float *l, float *alpha) {
    const vv ninf = (vv){0} - INFINITY, zero = {0};
    for (int c = 0; c < nv; c++) {
        float *s = st + c * LANES;
        vvi row_pos;
        memcpy(&row_pos, pos + c * LANES, sizeof row_pos);
        vv top = ninf;
        for (int j = 0; j < nk; j++) {
            vv x = vload_vv(s + j * ld) * scale;
            if (!all_seen) {
                const vvi seen = (vvi){0} + (k0 + j) <= row_pos;
                x = (vv)(((vvi)x & seen) | ((vvi)ninf & ~seen));
            }
            vstore_vv(s + j * ld, x);
            top = vmax(top, x);
        }
        const vv old = vload_vv(m + c * LANES);
        const vv new = vmax(top, old);   /* top where it is greater, else the old maximum */
        /* e^(m_old - m_new): exactly 1 when the maximum stays (e^0 is 1 in vexp_nonpositive); 0 on the first tile,
         * where O and l are still 0 */
        const vvi started = old > ninf;
        const vv factor = (vv)((vvi)vexp_nonpositive(old - new) & started);
        vstore_vv(m + c * LANES, new);
        vstore_vv(alpha + c * LANES, factor);
        for (int j = 0; j < nk; j++) {
            vv p = vexp_nonpositive(vload_vv(s + j * ld) - new);
            if (!all_seen) {
                const vvi seen = (vvi){0} + (k0 + j) <= row_pos;
                p = (vv)((vvi)p & seen);
            }
            vstore_vv(s + j * ld, p);
        }
        /* The tile's sum, in one fixed order: of every sixteenth key from j in key order, for j < 16, then
         * those sixteen halved (pairs 8 apart, 4 apart, 2, 1); keys past nk add nothing. */
        vv t[16];
        for (int j = 0; j < 16; j++) {
            vv a = zero;
            for (int h = j; h < nk; h += 16) a = a + vload_vv(s + h * ld);
            t[j] = a;
        }
        for (int half = 8; half >= 1; half /= 2)
            for (int j = 0; j < half; j++) t[j] = t[j] + t[j + half];
        vstore_vv(l + c * LANES, vload_vv(l + c * LANES) * factor + t[0]);
    }
}

/* One task: KV head g of a sequence, query positions [first, last] (absolute positions; the chunk's query
 * token t sits at position `start + t`). q rows of token t: q + t * ldq, heads dense; out the same
 * tokens, [heads][dim] dense per token. The buffers: qt and ot [dim][ld], st [KT][ld], m, l, alpha [ld],
 * pos [ld], ld = MAX_VECS * LANES. */
static void task(const float *q, int64_t ldq, const float *kv, const int32_t *block_table, int64_t block_stride,
                 int64_t kv_stride, int block_size, int num_kv_heads, int group, int dim, int g, int start,
                 int first, int last, float scale, float *out, float *qt, float *st, float *ot, float *m, float *l,
                 float *alpha, int32_t *pos) {
    const int positions = last - first + 1, rows = positions * group;
    const int nv = (rows + LANES - 1) / LANES, ld = nv * LANES;
    const int64_t slot_stride = (int64_t)num_kv_heads * dim;
    const float *row_ptr[MAX_VECS * LANES];
    for (int r = 0; r < ld; r++) {
        /* lanes past the rows: zeros, at the last row's position (computed, never stored) */
        row_ptr[r] = r < rows ? q + (int64_t)(first - start + r / group) * ldq + (int64_t)(g * group + r % group) * dim
                              : NULL;
        pos[r] = first + (r < rows ? r : rows - 1) / group;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int d = 0; d < dim; d++) {   /* (rows read across, Q^T written along: stores in order) */
        for (int r = 0; r < rows; r++) qt[d * ld + r] = row_ptr[r][d];
        for (int r = rows; r < ld; r++) qt[d * ld + r] = 0.0f;
    }
    for (int k0 = 0; k0 <= last; k0 += KT) {
        const int nk = last + 1 - k0 < KT ? last + 1 - k0 : KT;
        const float *keys[KT + SK], *values[KT];
        for (int j = 0; j < nk; j++) {
            const int p = k0 + j;
            keys[j] = kv + (int64_t)block_table[p / block_size] * block_stride + (int64_t)(p % block_size) * slot_stride
                      + (int64_t)g * dim;
            values[j] = keys[j] + kv_stride;
        }
        for (int j = nk; j < KT + SK; j++) keys[j] = keys[0];   /* a micro-tile's keys past nk: scored, never used */
        scores(qt, ld, nv, keys, nk, dim, st);
        softmax_tile(st, ld, nv, pos, k0, nk, k0 + KT - 1 <= first, scale, m, l, alpha);
        accumulate_values(ot, ld, nv, st, alpha, values, nk, dim, k0 == 0);
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + (int64_t)(first - start + r / group) * group * num_kv_heads * dim
                     + (int64_t)(g * group + r % group) * dim;
        for (int d = 0; d < dim; d++) dst[d] = ot[d * ld + r] * inv + 0.0f;   /* (-0 as +0: see the top) */
    }
}

/* The prefill sequences of a step. Sequence i's query tokens are rows [query_start[i], query_start[i+1])
 * of q (row stride ldq floats; [heads][dim] dense in a row) and of out ([T][heads][dim] dense); they are
 * its positions [seq_lens[i] - query_len, seq_lens[i]), their K and V already in the cache (kv: the
 * layer's view [blocks][k|v][slot][kv_head][dim], block_stride and kv_stride in elements).
 * Returns 0, or -1 when a shape is outside what the kernel handles (head_dim 16, 32, 64 or 128, at most
 * 16 query heads per KV head, sequences of at most MAX_SEQ_LEN), a length or block id is out of range, or
 * memory ran out: the caller then runs torch. */
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
        if (query_len < 1 || len < query_len || len > MAX_SEQ_LEN || len > (int64_t)max_blocks * block_size)
            return -1;
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
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t ld = MAX_VECS * LANES;
        float *buf = malloc(sizeof(float) * (2 * (int64_t)MAX_DIM * ld + (int64_t)KT * ld + 4 * ld));
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
            float *qt = buf, *ot = qt + MAX_DIM * ld, *st = ot + MAX_DIM * ld, *m = st + KT * ld, *l = m + ld,
                  *alpha = l + ld;
            task(q + (int64_t)query_start[s] * ldq, ldq, kv, block_tables + (int64_t)s * max_blocks, block_stride,
                 kv_stride, block_size, num_kv_heads, group, head_dim, g, start, first, last, scale,
                 out + (int64_t)query_start[s] * num_heads * head_dim, qt, st, ot, m, l, alpha,
                 (int32_t *)(alpha + ld));
        }
        free(buf);
    }
    free(list);
    return failed ? -1 : 0;
}
