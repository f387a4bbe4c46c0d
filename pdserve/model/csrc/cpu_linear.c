/* Float32 linear layer on CPU, y = x W^T (+ b), with W packed once into panels of 16 columns.
 *
 * Why our own GEMM: every output element is one chain of fused multiply-adds over k = 0..K-1, in that
 * order, whatever the number of rows M and wherever the element falls in a tile. So a row's numbers do
 * not depend on the batch it shares (P/D output equals colocated output), and one kernel serves M = 1
 * (decode of one stream, bound by reading W) as well as M = 2,048 (prefill, bound by the FMA units).
 * (A NaN result stays NaN, but which NaN, its payload and sign, may change with the tile: x86 returns
 * the first operand's NaN, and the compiler orders the operands of the FMAs and of the bias add
 * differently in different tile copies and builds. Every other value is the same to the bit.)
 * Measured on the 2-core AMD EPYC against oneDNN's packed weights (benchmarks/cpu_gemm_shapes.py,
 * docs/benchmarks.md): 1.1-1.4x at one row, where oneDNN read W at well under the memory's bandwidth,
 * 1.0-1.3x at 64 rows, 0.99-1.1x at 2,048, over the default model's shapes.
 *
 * Packed layout: panel p holds columns 16p..16p+15 of W^T, k-major: packed[p][k][0..15]; columns past
 * N are zero (cpu_kernels.packed_linear_numel sizes the buffer). A tile is up to 6 rows x 16
 * columns: twelve accumulators in the sixteen AVX registers,
 * two panel loads and six broadcasts per k for twelve FMAs.
 */
#include <omp.h>

#include "vec8.h"

#define NR 16
#if defined(__AVX512F__)
/* With AVX-512 a panel's sixteen columns are one register: a tile is up to 12 rows x two panels, 24
 * accumulators of the thirty-two registers, two panel loads and twelve broadcasts per k. Each element is
 * still one FMA chain over k in order, so the numbers are the AVX2 tile's to the bit, on any CPU. */
#define MR 12
#define PANELS_PER_TILE 2
/* From this many rows on, tiles of up to 6 rows x four panels instead: six broadcasts of x per k for
 * twenty-four FMAs, not twelve. On the 2-core Zen 4 EPYC (AVX-512 on 256-bit units) 2.6-4.4 % faster at
 * 128-2,048 rows (benchmarks/cpu_gemm_ab.py, docs/benchmarks.md). Below it, the 12-row tiles stay: a
 * decode batch of 64 rows would be cut into more short 6-row tiles. */
#define MR4 6
#define QUAD_MIN_ROWS 128
#else
#define MR 6
#define MR4 MR   /* (no four-panel tiles without AVX-512) */
#define PANELS_PER_TILE 1
#endif
/* Bytes of x rows and of W panels that one task works on, sized for a core's L2 (512 KiB on the EPYC,
 * 1-2 MiB on recent Xeons). A 64-row decode batch is one row block at K = 576 (W streams from memory
 * once) and two at the down projection's K = 1,536. */
#define ROW_BLOCK_BYTES (256 * 1024)
#define PANEL_BLOCK_BYTES (96 * 1024)
/* Up to this many bytes of x, the tasks go panel block by panel block (each thread's run of them reads
 * every weight panel once, x again from the caches for each panel block); past it, row block by row
 * block (x once, the weights again for each row block). At 256 rows of the default model the panel
 * order measured 12-15 % faster; at 2,048 rows (4.6 MB of x) the two were within 1 %
 * (benchmarks/cpu_gemm_ab.py, docs/benchmarks.md). */
#define X_RESIDENT_BYTES (2 * 1024 * 1024)

void pdserve_pack_linear(const float *w, float *packed, int n, int k) {
    const int panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int col = p * NR + j;
                packed[((int64_t)p * k + kk) * NR + j] = col < n ? w[(int64_t)col * k + kk] : 0.0f;
            }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* ROWS rows of x against PANELS adjacent panels (all full but the last, of which `cols` columns are
 * kept): each broadcast of x feeds PANELS FMAs. One panel is bounded by the loads, not the FMA units;
 * two or four panels per broadcast (MR and MR4 rows) keep the FMA units busy. ROWS and PANELS are
 * constants in each copy, so the loops unroll and the accumulators stay in registers; the arithmetic per
 * element is the same in every copy (and in the AVX2 tile below). */
#define DEFINE_TILE_P(NAME, PANELS, ROWS)                                                                \
static void NAME##_##ROWS(const float *x, int64_t ldx, const float *panel, int k, float *y, int64_t ldy, \
                          int cols, const float *bias, const float *pf) {                                \
    __m512 acc[PANELS][ROWS];                                                                            \
    const int64_t step = (int64_t)k * NR;                                                                \
    for (int j = 0; j < (PANELS); j++)                                                                   \
        for (int i = 0; i < (ROWS); i++) acc[j][i] = _mm512_setzero_ps();                                \
    for (int kk = 0; kk < k; kk++) {                                                                     \
        __m512 b[PANELS];                                                                                \
        for (int j = 0; j < (PANELS); j++) b[j] = _mm512_loadu_ps(panel + j * step + (int64_t)kk * NR);  \
        if (pf)                                                                                          \
            for (int j = 0; j < (PANELS); j++)                                                           \
                _mm_prefetch((const char *)(pf + j * step + (int64_t)kk * NR), _MM_HINT_T1);             \
        for (int i = 0; i < (ROWS); i++) {                                                               \
            const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);                                            \
            for (int j = 0; j < (PANELS); j++) acc[j][i] = _mm512_fmadd_ps(a, b[j], acc[j][i]);          \
        }                                                                                                \
    }                                                                                                    \
    /* straight from the registers into y (a copy through the stack cost 4-7 % at 64 rows, up to 2 % at \
     * 256 and 2,048: benchmarks/cpu_gemm_ab.py, gemm-direct-store-ab.json); the                        \
     * last panel's columns past `cols` neither loaded nor stored */                                     \
    __mmask16 keep[PANELS];                                                                              \
    __m512 bv[PANELS];                                                                                   \
    for (int j = 0; j < (PANELS); j++) {                                                                 \
        keep[j] = j + 1 < (PANELS) ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);                  \
        bv[j] = bias ? _mm512_maskz_loadu_ps(keep[j], bias + j * NR) : _mm512_setzero_ps();               \
    }                                                                                                    \
    for (int i = 0; i < (ROWS); i++)                                                                     \
        for (int j = 0; j < (PANELS); j++)                                                               \
            _mm512_mask_storeu_ps(y + i * ldy + j * NR, keep[j],                                         \
                                  bias ? _mm512_add_ps(acc[j][i], bv[j]) : acc[j][i]);                   \
}
#define DEFINE_TILE(ROWS) DEFINE_TILE_P(tile, 1, ROWS)
#define DEFINE_TILE2(ROWS) DEFINE_TILE_P(tile2, 2, ROWS)
#define DEFINE_TILE4(ROWS) DEFINE_TILE_P(tile4, 4, ROWS)
#else
/* ROWS (<= MR) rows of x against one panel. ROWS is a constant in each copy, so the loops unroll and
 * the accumulators stay in registers; the arithmetic per element is the same in every copy. */
#define DEFINE_TILE(ROWS)                                                                                \
static void tile_##ROWS(const float *x, int64_t ldx, const float *panel, int k, float *y, int64_t ldy,  \
                        int cols, const float *bias, const float *pf) {                                  \
    v8 lo[ROWS], hi[ROWS];                                                                               \
    for (int i = 0; i < (ROWS); i++) { lo[i] = (v8){0}; hi[i] = (v8){0}; }                               \
    for (int kk = 0; kk < k; kk++) {                                                                     \
        const v8 b0 = load8(panel + (int64_t)kk * NR), b1 = load8(panel + (int64_t)kk * NR + 8);         \
        if (pf) __builtin_prefetch(pf + (int64_t)kk * NR, 0, 2);                                         \
        for (int i = 0; i < (ROWS); i++) {                                                               \
            const float a = x[i * ldx + kk];                                                             \
            const v8 av = {a, a, a, a, a, a, a, a};                                                      \
            lo[i] = fma8(av, b0, lo[i]);                                                                 \
            hi[i] = fma8(av, b1, hi[i]);                                                                 \
        }                                                                                                \
    }                                                                                                    \
    if (bias) {   /* (the last panel's bias has only `cols` columns) */                                  \
        float b[NR] = {0};                                                                               \
        memcpy(b, bias, sizeof(float) * cols);                                                           \
        for (int i = 0; i < (ROWS); i++) { lo[i] += load8(b); hi[i] += load8(b + 8); }                   \
    }                                                                                                    \
    for (int i = 0; i < (ROWS); i++) {                                                                   \
        if (cols == NR) {                                                                                \
            store8(y + i * ldy, lo[i]);                                                                  \
            store8(y + i * ldy + 8, hi[i]);                                                              \
        } else {                                                                                         \
            float row[NR];                                                                               \
            store8(row, lo[i]);                                                                          \
            store8(row + 8, hi[i]);                                                                      \
            memcpy(y + i * ldy, row, sizeof(float) * cols);                                              \
        }                                                                                                \
    }                                                                                                    \
}
#endif

/* The tiles of 1 .. MR rows: every copy the same arithmetic per element, ROWS a constant in each. */
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
typedef void (*tile_fn)(const float *, int64_t, const float *, int, float *, int64_t, int, const float *,
                        const float *);
#if defined(__AVX512F__)
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)
DEFINE_TILE2(1)
DEFINE_TILE2(2)
DEFINE_TILE2(3)
DEFINE_TILE2(4)
DEFINE_TILE2(5)
DEFINE_TILE2(6)
DEFINE_TILE2(7)
DEFINE_TILE2(8)
DEFINE_TILE2(9)
DEFINE_TILE2(10)
DEFINE_TILE2(11)
DEFINE_TILE2(12)
static const tile_fn TILES[MR + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8,
                                      tile_9, tile_10, tile_11, tile_12};
static const tile_fn TILES2[MR + 1] = {NULL, tile2_1, tile2_2, tile2_3, tile2_4, tile2_5, tile2_6, tile2_7,
                                       tile2_8, tile2_9, tile2_10, tile2_11, tile2_12};
DEFINE_TILE4(1)
DEFINE_TILE4(2)
DEFINE_TILE4(3)
DEFINE_TILE4(4)
DEFINE_TILE4(5)
DEFINE_TILE4(6)
static const tile_fn TILES4[MR4 + 1] = {NULL, tile4_1, tile4_2, tile4_3, tile4_4, tile4_5, tile4_6};
#else
static const tile_fn TILES[MR + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#endif

/* The row tiles of rows [r, r_end): tiles of mr rows, except that a remainder of fewer than mr / 2 rows is
 * merged with the tile before it and the two split in halves (4 rows after 252 would be a tile that
 * runs at a third of a full one's rate; 8 + 8 run near full). Which tile an element falls in does not
 * change its numbers. */
static void row_tiles(const tile_fn *tiles, int mr, const float *x, int64_t ldx, const float *panel, int k,
                      float *y, int64_t ldy, int cols, const float *bias, int r, int r_end, const float *pf) {
    while (r < r_end) {
        int rows = r_end - r < mr ? r_end - r : mr;
        const int left = r_end - r - rows;
        if (left > 0 && left < mr / 2)
            rows = (rows + left + 1) / 2;
        tiles[rows](x + (int64_t)r * ldx, ldx, panel, k, y + (int64_t)r * ldy, ldy, cols, bias, pf);
        pf = NULL;   /* the first tile brings the next panels in; the rest find them there */
        r += rows;
    }
}

/* 1: the first row tile over each run of panels also asks for the next run's weights, into L2, one line
 * per panel and k as it goes, so that the next run's first tile does not wait on memory for them (the
 * hardware prefetcher follows a panel's stream within a page, not into the next run). Measured on the
 * 2-core Zen 4 EPYC, in-engine ABBA (benchmarks/cpu_step_ab.py --switch prefetch, docs/benchmarks.md):
 * decode steps of 64 sequences 1.02-1.03x in three runs, 256-token prefills 1.00-1.01x, 2,048-token
 * prefill steps 1.01x, one sequence 0.98-1.05x.
 * A prefetch never stores, so no number changes. 0 turns it off (the A/B's other side). */
int pdserve_linear_prefetch = 1;

/* The row at which a task's units (rows r0..r_end x `panels` panels, the first at `before` in the
 * linear order of units) are cut at unit `at`: the nearest multiple of mr rows after r0, r0 before the
 * task and r_end past it. Both threads beside a cut compute it from the same numbers. */
static inline int split_row(int64_t at, int64_t before, int64_t size, int panels, int mr, int r0, int r_end) {
    if (at <= before) return r0;
    if (at >= before + size) return r_end;
    const int64_t unit = (int64_t)panels * mr;
    const int64_t row = r0 + (at - before + unit / 2) / unit * mr;
    return row < r_end ? (int)row : r_end;
}

/* y[i][0..n) = x[i][0..k) . W^T (+ bias) for i < m; x rows ldx floats apart, y rows ldy apart; packed
 * from pdserve_pack_linear(W, ., n, k). Work is cut into (row block, panel block) tasks, each sized for
 * a core's L2, and each of torch's OpenMP threads (cpu_kernels.py) takes a contiguous run of them (in
 * panel or row block order, X_RESIDENT_BYTES) holding an equal share of rows x panels, the task on the
 * border between two shares cut by rows (a plain static split of 256 rows in blocks of 108, 108 and 40
 * gave one thread 63 % of the work). */
void pdserve_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k) {
    if (m < 1 || n < 1 || k < 1) return;   /* nothing to do (and the block arithmetic below divides by m's) */
    const int panels = (n + NR - 1) / NR;
    int rows_per_block = (int)(ROW_BLOCK_BYTES / ((int64_t)k * 4)) / MR * MR;
    if (rows_per_block < MR) rows_per_block = MR;
    const int row_blocks = (m + rows_per_block - 1) / rows_per_block;
    rows_per_block = ((m + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;   /* even blocks */
    /* whole tiles of panels, at least one (at K = 1,536 one panel is 96 KiB, and single-panel tiles
     * run slower than pairs) */
    int tile_panels = PANELS_PER_TILE;
#if defined(__AVX512F__)
    if (m >= QUAD_MIN_ROWS) tile_panels = 4;
#endif
    int panels_per_block = (int)(PANEL_BLOCK_BYTES / ((int64_t)k * 4 * NR)) / tile_panels * tile_panels;
    if (panels_per_block < tile_panels) panels_per_block = tile_panels;
    const int panel_blocks = (panels + panels_per_block - 1) / panels_per_block;
    const int64_t work = (int64_t)m * panels;
    const int panel_major = (int64_t)m * k * 4 <= X_RESIDENT_BYTES;
#pragma omp parallel
    {
        const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t lo = work * thread / threads, hi = work * (thread + 1) / threads;
        for (int64_t task = 0; task < (int64_t)row_blocks * panel_blocks; task++) {
            const int rb = panel_major ? (int)(task % row_blocks) : (int)(task / panel_blocks);
            const int pb = panel_major ? (int)(task / row_blocks) : (int)(task % panel_blocks);
            const int r0 = rb * rows_per_block;
            const int r_end_block = r0 + rows_per_block < m ? r0 + rows_per_block : m;
            const int p0 = pb * panels_per_block;
            const int p_end = p0 + panels_per_block < panels ? p0 + panels_per_block : panels;
            /* Each thread takes the units (rows x panels, in task order) of [lo, hi): a task that straddles
             * two threads' shares is cut between them by rows, at whole tiles, so that no thread waits on
             * another's extra block (at 256 rows of the default model a task is 1-2 % of a GEMM). */
            const int64_t before = panel_major ? (int64_t)p0 * m + (int64_t)(p_end - p0) * r0
                                               : (int64_t)r0 * panels + (int64_t)(r_end_block - r0) * p0;
            const int64_t size = (int64_t)(r_end_block - r0) * (p_end - p0);
            if (before + size <= lo || before >= hi)
                continue;
            const int mr = tile_panels == 4 ? MR4 : MR;
            const int r_begin = split_row(lo, before, size, p_end - p0, mr, r0, r_end_block);
            const int r_end = split_row(hi, before, size, p_end - p0, mr, r0, r_end_block);
            if (r_begin < r_end) {
                for (int p = p0, used; p < p_end; p += used) {
                    const float *panel = packed + (int64_t)p * k * NR;
                    float *out = y + (int64_t)p * NR;
                    const float *b = bias ? bias + p * NR : NULL;
#if defined(__AVX512F__)
                    used = tile_panels == 4 && p + 3 < p_end ? 4 : p + 1 < p_end ? 2 : 1;
                    /* the last panel of the tile may be the last, partial one */
                    const int cols = n - (p + used - 1) * NR < NR ? n - (p + used - 1) * NR : NR;
                    /* (the tile asks for `used` panels after its own: only where they all exist) */
                    const float *pf = pdserve_linear_prefetch && p + 2 * used <= panels
                                      ? panel + (int64_t)used * k * NR : NULL;
                    if (used == 4) row_tiles(TILES4, MR4, x, ldx, panel, k, out, ldy, cols, b, r_begin, r_end, pf);
                    else if (used == 2) row_tiles(TILES2, MR, x, ldx, panel, k, out, ldy, cols, b, r_begin, r_end, pf);
                    else row_tiles(TILES, MR, x, ldx, panel, k, out, ldy, cols, b, r_begin, r_end, pf);
#else
                    used = 1;
                    const int cols = n - p * NR < NR ? n - p * NR : NR;
                    row_tiles(TILES, MR, x, ldx, panel, k, out, ldy, cols, b, r_begin, r_end,
                              pdserve_linear_prefetch && p + 1 < panels ? panel + (int64_t)k * NR : NULL);
#endif
                }
            }
        }
    }
}
