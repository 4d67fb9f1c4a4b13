/* The bfloat16 recurrent cohort's elementwise work in single passes: one time step of the LSTM /
CIFG cell forward and backward, the output layer's softmax cross-entropy, and a bfloat16 gradient
added into float32 weights.

Why C: on the bfloat16 path at the Gboard size (edge/cohort_lstm.py) the GEMMs are fast and the
elementwise ops are memory-bound torch ops, one pass per op over tensors of several MB: the cell's
forward was 5 ops per step, its backward 4 per step plus the local derivatives (9 passes over
[T, k, B, H] tensors), the softmax 4 passes over the logits. Here each is one loop over the step's
rows (the local derivatives made where they are used) or over a row of logits. Built at first use
with the machine's C compiler (edge/native_cell.py); without one the torch ops run.

Layout: per client j a block of `rows` contiguous rows; a row of gates is G = (3|4) * hidden floats
in the kernel's order (o, f[, i], g); `*_cs` is a tensor's client stride in elements.
exp is Cephes' single-precision polynomial (relative error ~1e-7, written to vectorize: no
library call in the loop), sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 2 sigmoid(2x) - 1 (absolute
error ~1e-7). NaN propagates (no fminf, which would turn NaN into a bound). */

#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

static inline float tanh_poly(float x) { return 2.0f / (1.0f + exp_poly(-2.0f * x)) - 1.0f; }

/* round to nearest even, NaN kept a (quiet) NaN: torch's float -> bfloat16 */
static inline uint16_t to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    uint32_t nan = ((b >> 16) | 0x40u);
    return (uint16_t)(((b & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static inline float from_bf16(uint16_t x) {
    uint32_t b = (uint32_t)x << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* The gates' pre-activations are x_pre + rec + bias (bfloat16 GEMM outputs: the input projection
   and the recurrent product, zeros at t = 0; the client's float32 bias), summed in float32; a gets
   the activations (what backward reads). c = g + f (c' - g) (coupled) or f c' + i g (c_prev
   zeros at t = 0); tc = tanh(c); m = o tc in bfloat16 (the operand of the projection's GEMM and
   of its weight gradient's). */
void cell_forward(int64_t k, int64_t rows, int64_t hidden, int coupled,
                  const uint16_t *x_pre, int64_t x_cs, const uint16_t *rec, int64_t rec_cs,
                  const float *bias, int64_t b_cs, float *a, int64_t a_cs,
                  const float *c_prev, int64_t cp_cs, float *c, int64_t c_cs, float *tc, int64_t tc_cs,
                  uint16_t *m_low, int64_t ml_cs) {
    const int64_t gates = (coupled ? 3 : 4) * hidden;
    for (int64_t j = 0; j < k; j++) {
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *restrict xr = x_pre + j * x_cs + r * gates;
            const uint16_t *restrict rr = rec + j * rec_cs + r * gates;
            const float *restrict br = bias + j * b_cs;
            float *restrict ar = a + j * a_cs + r * gates;
            const float *restrict cp = c_prev + j * cp_cs + r * hidden;
            float *restrict cr = c + j * c_cs + r * hidden;
            float *restrict tcr = tc + j * tc_cs + r * hidden;
            uint16_t *restrict mlr = m_low + j * ml_cs + r * hidden;
            for (int64_t h = 0; h < gates - hidden; h++)
                ar[h] = sigmoid(from_bf16(xr[h]) + from_bf16(rr[h]) + br[h]);
            for (int64_t h = gates - hidden; h < gates; h++)
                ar[h] = tanh_poly(from_bf16(xr[h]) + from_bf16(rr[h]) + br[h]);
            const float *restrict o = ar, *restrict f = ar + hidden, *restrict i = ar + 2 * hidden;
            const float *restrict g = ar + gates - hidden;
            if (coupled) {
                for (int64_t h = 0; h < hidden; h++) cr[h] = g[h] + f[h] * (cp[h] - g[h]);
            } else {
                for (int64_t h = 0; h < hidden; h++) cr[h] = f[h] * cp[h] + i[h] * g[h];
            }
            for (int64_t h = 0; h < hidden; h++) {
                float t = tanh_poly(cr[h]);
                tcr[h] = t;
                mlr[h] = to_bf16(o[h] * t);
            }
        }
    }
}

static void backward_row_coupled(int64_t hidden, const uint16_t *restrict dm, const float *restrict o,
                                 const float *restrict f, const float *restrict g,
                                 const float *restrict tc, const float *restrict cp,
                                 float *restrict dc, uint16_t *restrict dz_o,
                                 uint16_t *restrict dz_f, uint16_t *restrict dz_g) {
    for (int64_t h = 0; h < hidden; h++) {
        float t = tc[h], ov = o[h], fv = f[h], gv = g[h], dmv = from_bf16(dm[h]);
        float d = dc[h] + dmv * ov * (1.0f - t * t);
        dz_o[h] = to_bf16(dmv * ov * (1.0f - ov) * t);
        dz_f[h] = to_bf16(d * (cp[h] - gv) * fv * (1.0f - fv));
        dz_g[h] = to_bf16(d * (1.0f - fv) * (1.0f - gv * gv));
        dc[h] = d * fv;
    }
}

static void backward_row(int64_t hidden, const uint16_t *restrict dm, const float *restrict o,
                         const float *restrict f, const float *restrict i, const float *restrict g,
                         const float *restrict tc, const float *restrict cp, float *restrict dc,
                         uint16_t *restrict dz_o, uint16_t *restrict dz_f, uint16_t *restrict dz_i,
                         uint16_t *restrict dz_g) {
    for (int64_t h = 0; h < hidden; h++) {
        float t = tc[h], ov = o[h], fv = f[h], gv = g[h], iv = i[h], dmv = from_bf16(dm[h]);
        float d = dc[h] + dmv * ov * (1.0f - t * t);
        dz_o[h] = to_bf16(dmv * ov * (1.0f - ov) * t);
        dz_f[h] = to_bf16(d * cp[h] * fv * (1.0f - fv));
        dz_i[h] = to_bf16(d * gv * iv * (1.0f - iv));
        dz_g[h] = to_bf16(d * iv * (1.0f - gv * gv));
        dc[h] = d * fv;
    }
}

/* dm = dL/dm_t (bfloat16: the projection's bfloat16 GEMM's product); dc carries dL/dc_t in and
   f dL/dc_t out (dL/dc_{t-1}: meaningless after t = 0, where nothing reads it); dz (bfloat16) gets
   the gates' pre-activation gradients. c_prev zeros at t = 0. */
void cell_backward(int64_t k, int64_t rows, int64_t hidden, int coupled,
                   const uint16_t *dm, int64_t dm_cs, const float *a, int64_t a_cs,
                   const float *tc, int64_t tc_cs, const float *c_prev, int64_t cp_cs,
                   float *dc, int64_t dc_cs, uint16_t *dz, int64_t dz_cs) {
    const int64_t gates = (coupled ? 3 : 4) * hidden;
    for (int64_t j = 0; j < k; j++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *o = a + j * a_cs + r * gates;
            const uint16_t *dmr = dm + j * dm_cs + r * hidden;
            const float *tcr = tc + j * tc_cs + r * hidden;
            const float *cp = c_prev + j * cp_cs + r * hidden;
            float *dcr = dc + j * dc_cs + r * hidden;
            uint16_t *dzr = dz + j * dz_cs + r * gates;
            if (coupled) {
                backward_row_coupled(hidden, dmr, o, o + hidden, o + 2 * hidden, tcr, cp, dcr, dzr,
                                     dzr + hidden, dzr + 2 * hidden);
            } else {
                backward_row(hidden, dmr, o, o + hidden, o + 2 * hidden, o + 3 * hidden, tcr, cp, dcr,
                             dzr, dzr + hidden, dzr + 2 * hidden, dzr + 3 * hidden);
            }
        }
    }
}



/* 16 floats: GCC's and clang's vector extension, lowered to the target's widest vectors (the
   max loops below written with scalars did not vectorize) */
typedef float f16v __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i16v __attribute__((vector_size(LANES * sizeof(int32_t))));

/* x = l + b (float32) and its maximum (16 partial maxima; NaN is skipped here, as a comparison
   with NaN is false, and propagates through the sum) */
static float shifted_max(int64_t vocab, const uint16_t *restrict l, const float *restrict b,
                         float *restrict x) {
    for (int64_t v = 0; v < vocab; v++) x[v] = from_bf16(l[v]) + b[v];
    f16v top;
    for (int q = 0; q < LANES; q++) top[q] = -3.402823466e38f;
    int64_t v = 0;
    for (; v + LANES <= vocab; v += LANES) {
        f16v xv;
        memcpy(&xv, x + v, sizeof xv);
        i16v more = xv > top;
        top = (f16v)(((i16v)xv & more) | ((i16v)top & ~more));
    }
    float out = top[0];
    for (int q = 1; q < LANES; q++) out = top[q] > out ? top[q] : out;
    for (; v < vocab; v++) out = x[v] > out ? x[v] : out;
    return out;
}

/* x = exp(x - top) and its sum (16 partial sums, added in a fixed order: the same bits each run) */
static float exp_sum(int64_t vocab, float top, float *restrict x) {
    float acc[LANES] = {0};
    int64_t v = 0;
    for (; v + LANES <= vocab; v += LANES) {
        for (int q = 0; q < LANES; q++) {
            x[v + q] = exp_poly(x[v + q] - top);
            acc[q] += x[v + q];
        }
    }
    for (; v < vocab; v++) {
        x[v] = exp_poly(x[v] - top);
        acc[0] += x[v];
    }
    float out = 0.0f;
    for (int q = 0; q < LANES; q++) out += acc[q];
    return out;
}

/* The output layer's softmax cross-entropy at bfloat16, for a group of m clients of n rows each:
   row r of client j has logits l (bfloat16, without the bias) + bias_j (float32), target t_r and
   weight w_r (1 / n_j, 0 on a fill row). grad_r = softmax(l + b) - onehot(t_r) (bfloat16, each
   value rounded once), nll_r = log(sum exp(x - max)) + max - x_t (float32, exact where the
   target's probability underflows), bias_grad_j = sum_r w_r grad_r (float32, before rounding).
   scratch: vocab floats. */
void softmax_xent(int64_t m, int64_t n, int64_t vocab, const uint16_t *logits, const float *bias,
                  const int64_t *target, const float *weight, uint16_t *grad, float *nll,
                  float *bias_grad, float *scratch) {
    for (int64_t j = 0; j < m; j++) {
        const float *restrict b = bias + j * vocab;
        float *restrict bg = bias_grad + j * vocab;
        for (int64_t v = 0; v < vocab; v++) bg[v] = 0.0f;
        for (int64_t r = j * n; r < (j + 1) * n; r++) {
            const uint16_t *restrict l = logits + r * vocab;
            uint16_t *restrict g = grad + r * vocab;
            float *restrict x = scratch;
            float top = shifted_max(vocab, l, b, x);
            int64_t t = target[r];
            float x_t = x[t];
            float sum = exp_sum(vocab, top, x);
            float inv = 1.0f / sum, w = weight[r];
            nll[r] = __builtin_logf(sum) + top - x_t;
            x[t] -= sum;  /* p_t - 1 = (e_t - sum) / sum */
            for (int64_t v = 0; v < vocab; v++) {
                float p = x[v] * inv;
                g[v] = to_bf16(p);
                bg[v] += w * p;
            }
        }
    }
}

/* dst += alpha * src over [a, r, c] blocks (row-major, unit column stride), dst float32 and src
   bfloat16: an SGD step or gradient sum from a bfloat16 GEMM's product in one pass (torch converts
   the product to a float32 temporary first, then adds). */
void axpy_bf16(int64_t a, int64_t r, int64_t c, float *dst, int64_t d_sa, int64_t d_sr,
               const uint16_t *src, int64_t s_sa, int64_t s_sr, float alpha) {
    for (int64_t i = 0; i < a; i++) {
        for (int64_t j = 0; j < r; j++) {
            float *restrict d = dst + i * d_sa + j * d_sr;
            const uint16_t *restrict s = src + i * s_sa + j * s_sr;
            for (int64_t q = 0; q < c; q++) d[q] += alpha * from_bf16(s[q]);
        }
    }
}

/* dst = bfloat16(src), n contiguous floats (the output layer's weights, cast once per step) */
void cast_bf16(int64_t n, const float *restrict src, uint16_t *restrict dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}
