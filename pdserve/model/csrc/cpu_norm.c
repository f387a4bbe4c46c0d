/* The elementwise chains of a Llama layer on CPU, float32, one pass over each row: RMSNorm (with the
 * residual add before it) and SwiGLU's silu(gate) * up.
 *
 * Why: in eager PyTorch an RMSNorm is five elementwise ops and SwiGLU three, each a pass over the
 * activations and a dispatch (microseconds each, 200 of them in a decode step of the default model,
 * where one sequence's whole step is ~40 ms). Same arithmetic as layers._rms_norm and _silu_and_mul, op
 * for op, except that the sum of squares is added up in eight lanes (torch's reduction order differs
 * too), the square root is 1 / sqrtf, and e^x is vec8.h's exp8: equal to torch within float32
 * rounding (tests/model/test_cpu_norm.py). Every row is computed alone, so its numbers do not depend on
 * the batch it shares.
 */
#include <math.h>

#include "vec8.h"

/* Rows past this many go to the OpenMP threads; a decode step's few rows are done inline. */
#define PARALLEL_ROWS 32

static void norm_row(const float *x, const float *residual, float *residual_out, const float *weight, float *out,
                     int h, float eps) {
    v8 acc0 = {0}, acc1 = {0};
    float tail = 0.0f;
    int j = 0;
    /* s = x + residual, kept in residual_out (or read from x when there is no residual) */
    const float *s = x;
    if (residual) {
        for (j = 0; j + 8 <= h; j += 8) store8(residual_out + j, load8(x + j) + load8(residual + j));
        for (; j < h; j++) residual_out[j] = x[j] + residual[j];
        s = residual_out;
    }
    for (j = 0; j + 16 <= h; j += 16) {
        const v8 a = load8(s + j), b = load8(s + j + 8);
        acc0 += a * a;
        acc1 += b * b;
    }
    for (; j + 8 <= h; j += 8) {
        const v8 a = load8(s + j);
        acc0 += a * a;
    }
    for (; j < h; j++) tail += s[j] * s[j];
    const float mean = (sum8(acc0 + acc1) + tail) / (float)h;
    const float inv = 1.0f / sqrtf(mean + eps);
    const v8 inv8 = {inv, inv, inv, inv, inv, inv, inv, inv};
    for (j = 0; j + 8 <= h; j += 8) store8(out + j, load8(weight + j) * (load8(s + j) * inv8));
    for (; j < h; j++) out[j] = weight[j] * (s[j] * inv);
}

/* out[i] = weight * s / rms(s) with s = x[i] (+ residual[i], then written to residual_out[i]); rows
 * ldx / ldr / ldo floats apart (residual_out and out dense as ldo). residual may be NULL. */
void pdserve_rms_norm(const float *x, int64_t ldx, const float *residual, int64_t ldr, float *residual_out,
                      const float *weight, float *out, int64_t ldo, int rows, int h, float eps) {
#pragma omp parallel for schedule(static) if (rows > PARALLEL_ROWS)
    for (int i = 0; i < rows; i++)
        norm_row(x + i * ldx, residual ? residual + i * ldr : NULL, residual ? residual_out + i * ldo : NULL,
                 weight, out + i * ldo, h, eps);
}

/* out[i][j] = silu(gate_up[i][j]) * gate_up[i][half + j], silu(g) = g / (1 + e^-g); rows ld floats apart
 * in gate_up, half apart in out. */
void pdserve_silu_and_mul(const float *gate_up, int64_t ld, float *out, int rows, int half) {
#pragma omp parallel for schedule(static) if (rows > PARALLEL_ROWS)
    for (int i = 0; i < rows; i++) {
        const float *g = gate_up + i * ld, *u = g + half;
        float *o = out + (int64_t)i * half;
        int j = 0;
        const v8 one = {1, 1, 1, 1, 1, 1, 1, 1};
        /* sixteen lanes where they fit (lane for lane the eight-lane numbers; in a 256-token prefill 5.0-6.9
         * -> 3.4-3.5 ms on the AVX-512 EPYC, benchmarks/cpu_step_breakdown.py) */
        for (; j + 16 <= half; j += 16) {
            v16 gv, uv;
            memcpy(&gv, g + j, sizeof gv);
            memcpy(&uv, u + j, sizeof uv);
            const v16 ov = gv / (1.0f + exp16(-gv)) * uv;
            memcpy(o + j, &ov, sizeof ov);
        }
        for (; j + 8 <= half; j += 8) {
            const v8 gv = load8(g + j);
            store8(o + j, gv / (one + exp8(-gv)) * load8(u + j));
        }
        if (j < half) {
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + j, sizeof(float) * (half - j));
            memcpy(ut, u + j, sizeof(float) * (half - j));
            const v8 gv = load8(gt);
            store8(ot, gv / (one + exp8(-gv)) * load8(ut));
            memcpy(o + j, ot, sizeof(float) * (half - j));
        }
    }
}
