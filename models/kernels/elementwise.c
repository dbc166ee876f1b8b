/* zserve CPU elementwise kernels for the decoder: one call where torch needs a chain of
 * small ops (each a dispatch, an allocation and a pass over memory): AVX-512, and AVX2
 * versions at the end (the same arithmetic 8 lanes at a time).
 *
 * Numerics are transformers' modeling_llama, rounding where it rounds (bf = the model
 * dtype: float32, or bfloat16 rounded to nearest even):
 *   add_rms_norm   h = bf(x + r);  y = bf(w * bf(h * rsqrt(mean(h^2) + eps)))   (float32 sums)
 *   rope           out1 = bf(bf(x1 c) - bf(x2 s)),  out2 = bf(bf(x2 c) + bf(x1 s))
 *   silu_mul       y = bf(bf(silu(g)) * u)
 * Compiled with -ffp-contract=off: a * b - c * d must not become one fused multiply-add.
 * All tensors are contiguous row-major unless a row stride is passed.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* The one driver loop of every kernel here, either instruction set: row_fn(bf16, i, ...)
 * for each row i < M, in parallel where `parallel` holds. The dtype is picked inside the
 * loop: see simd.h. */
#define EACH_ROW(parallel, row_fn, ...)                                                 \
    {                                                                                   \
        const int many = (parallel);                                                    \
        _Pragma("omp parallel for schedule(static) if (many)")                          \
        for (int64_t i = 0; i < M; i++) {                                               \
            if (bf16) row_fn(1, i, __VA_ARGS__);                                        \
            else row_fn(0, i, __VA_ARGS__);                                             \
        }                                                                               \
    }

/* ---- add_rms_norm: rows of D; r (the residual) may be NULL (then h = x, not written) --- */

INLINE TARGET void norm_row(const int bf16, int64_t i, const void *xs, const void *rs,
                            void *hs, const void *w, float eps, int64_t D, void *ys) {
    const int64_t esz = bf16 ? 2 : 4;
    const int64_t at = i * D * esz;                  /* row i of each */
    const char *x = (const char *)xs + at, *r = rs ? (const char *)rs + at : 0;
    char *h = hs ? (char *)hs + at : 0, *y = (char *)ys + at;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {           /* pass 1: h and sum of squares */
        __mmask16 m = tail_mask(D - d);
        __m512 v = load16(bf16, (const char *)x + d * esz, m);
        if (r) {
            v = round_bf(bf16, _mm512_add_ps(v, load16(bf16, (const char *)r + d * esz, m)));
            store16(bf16, (char *)h + d * esz, m, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps);
    const void *src = r ? h : x;
    for (int64_t d = 0; d < D; d += 16) {           /* pass 2: scale */
        __mmask16 m = tail_mask(D - d);
        __m512 v = round_bf(bf16, _mm512_mul_ps(load16(bf16, (const char *)src + d * esz, m),
                                                _mm512_set1_ps(inv)));
        v = _mm512_mul_ps(load16(bf16, (const char *)w + d * esz, m), v);
        store16(bf16, (char *)y + d * esz, m, v);
    }
}

TARGET void zs_add_rms_norm(int bf16, const void *x, const void *r, void *h, const void *w,
                            float eps, int64_t M, int64_t D, void *y)
    EACH_ROW(M >= 64, norm_row, x, r, h, w, eps, D, y)

/* ---- rope: rotate, in place, heads [0, heads) of each row of x (row stride `stride`
 *      elements, head h at h * D), at position pos[i]; cos_sin: [*, D] rows, cos in the
 *      first D/2 columns, sin in the last; D even. ------------------------------------ */

/* A RoPE row, for both instruction sets: `rotate` (rotate16 / rotate8) turns `lanes`
 * columns of one head, from column d of each half on. */
#define ROPE_ROW(rotate, lanes)                                                         \
    {                                                                                   \
        const int64_t esz = bf16 ? 2 : 4, half = D / 2;                                 \
        const char *cs = (const char *)cos_sin + pos[i] * D * esz;                      \
        for (int64_t hd = 0; hd < heads; hd++) {                                        \
            char *x1 = (char *)x + (i * stride + hd * D) * esz, *x2 = x1 + half * esz;  \
            for (int64_t d = 0; d < half; d += (lanes))                                 \
                rotate(bf16, cs + d * esz, cs + (half + d) * esz, x1 + d * esz,         \
                       x2 + d * esz, half - d);                                         \
        }                                                                               \
    }

INLINE TARGET void rotate16(const int bf16, const char *cp, const char *sp, char *x1p,
                            char *x2p, int64_t left) {
    const __mmask16 m = tail_mask(left);
    __m512 c = load16(bf16, cp, m), s = load16(bf16, sp, m);
    __m512 x1 = load16(bf16, x1p, m), x2 = load16(bf16, x2p, m);
    __m512 o1 = _mm512_sub_ps(round_bf(bf16, _mm512_mul_ps(x1, c)),
                              round_bf(bf16, _mm512_mul_ps(x2, s)));
    __m512 o2 = _mm512_add_ps(round_bf(bf16, _mm512_mul_ps(x2, c)),
                              round_bf(bf16, _mm512_mul_ps(x1, s)));
    store16(bf16, x1p, m, o1);
    store16(bf16, x2p, m, o2);
}

INLINE TARGET void rope_row(const int bf16, int64_t i, void *x, int64_t stride,
                            int64_t heads, int64_t D, const void *cos_sin,
                            const int64_t *pos)
    ROPE_ROW(rotate16, 16)

TARGET void zs_rope(int bf16, void *x, int64_t M, int64_t stride, int64_t heads, int64_t D,
                    const void *cos_sin, const int64_t *pos)
    EACH_ROW(M >= 64, rope_row, x, stride, heads, D, cos_sin, pos)

/* ---- silu_mul: gu [M, 2I] (gate | up) -> y [M, I] ---------------------------------------- */

INLINE TARGET void silu_row(const int bf16, int64_t i, const void *gu, int64_t I, void *y) {
    const int64_t esz = bf16 ? 2 : 4;
    const char *g = (const char *)gu + i * 2 * I * esz, *u = g + I * esz;
    char *o = (char *)y + i * I * esz;
    for (int64_t d = 0; d < I; d += 16) {
        __mmask16 m = tail_mask(I - d);
        __m512 gv = load16(bf16, g + d * esz, m);
        __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(
            _mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store16(bf16, o + d * esz, m,
                _mm512_mul_ps(round_bf(bf16, sv), load16(bf16, u + d * esz, m)));
    }
}

TARGET void zs_silu_mul(int bf16, const void *gu, int64_t M, int64_t I, void *y)
    EACH_ROW(M * I >= 65536, silu_row, gu, I, y)

/* ---- AVX2: the same three for CPUs without AVX-512, same arguments, the same rounding
 *      points. Tails go through load8 / store8 (lanes past the end untouched). ---- */

/* sum(x[i] * x[i], i < n) over x upcast to float32, rounded exactly as torch 2.13's CPU
 * `x.float().pow(2).sum(-1)` rounds it with 8-lane vectors (ATen SumKernel.cpp:
 * vectorized_inner_sum -> row_sum -> multi_row_sum, a 4-level cascade over groups of 4
 * vectors), so add_rms_norm below gives transformers' RMSNorm bit for bit
 * (tests/test_ops.py checks it on many widths). Any other order moved the tiny test models'
 * logits by up to 4e-4. */
INLINE TARGET_AVX2 float torch_sum_squares(const int bf16, const void *x, int64_t n) {
    const int64_t esz = bf16 ? 2 : 4, vecs = n / 8, rows = vecs / 4;   /* rows of 4 vectors */
    const char *xb = x;
    int64_t log2 = 0;
    while ((int64_t)1 << log2 < rows) log2++;             /* CeilLog2(rows) */
    const int64_t power = log2 / 4 > 4 ? log2 / 4 : 4, step = (int64_t)1 << power;
    const int64_t mask = step - 1;
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
#define SQ(v) ({ __m256 v_ = (v); _mm256_mul_ps(v_, v_); })
#define VEC(e) load8(bf16, xb + (e) * esz, 8)
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                acc[0][k] = _mm256_add_ps(acc[0][k], SQ(VEC((4 * i + k) * 8)));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++)
            acc[0][k] = _mm256_add_ps(acc[0][k], SQ(VEC((4 * i + k) * 8)));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = rows * 4; v < vecs; v++)             /* vectors past the last row */
        acc[0][0] = _mm256_add_ps(acc[0][0], SQ(VEC(v * 8)));
#undef VEC
#undef SQ
    for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float total = 0.0f, tail[8], lanes[8];
    _mm256_storeu_ps(tail, load8(bf16, xb + vecs * 8 * esz, n - vecs * 8));
    for (int64_t e = 0; e < n - vecs * 8; e++)           /* the scalar tail first */
        total += tail[e] * tail[e];
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int k = 0; k < 8; k++) total += lanes[k];
    return total;
}

INLINE TARGET_AVX2 void norm_row8(const int bf16, int64_t i, const void *xs, const void *rs,
                                  void *hs, const void *w, float eps, int64_t D, void *ys) {
    const int64_t esz = bf16 ? 2 : 4;
    const int64_t at = i * D * esz;                  /* row i of each */
    const char *x = (const char *)xs + at, *r = rs ? (const char *)rs + at : 0;
    char *h = hs ? (char *)hs + at : 0, *y = (char *)ys + at;
    if (r)                                               /* h = x + residual, rounded */
        for (int64_t d = 0; d < D; d += 8)
            store8(bf16, (char *)h + d * esz, D - d,
                   _mm256_add_ps(load8(bf16, (const char *)x + d * esz, D - d),
                                 load8(bf16, (const char *)r + d * esz, D - d)));
    const void *src = r ? h : x;
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(torch_sum_squares(bf16, src, D) / (float)D
                                                   + eps));
    for (int64_t d = 0; d < D; d += 8) {                 /* w * (x / rms in float32, rounded) */
        __m256 v = round8(bf16, _mm256_mul_ps(load8(bf16, (const char *)src + d * esz, D - d),
                                              inv));
        store8(bf16, (char *)y + d * esz, D - d,
               _mm256_mul_ps(load8(bf16, (const char *)w + d * esz, D - d), v));
    }
}

TARGET_AVX2 void zs_add_rms_norm_avx2(int bf16, const void *x, const void *r, void *h,
                                      const void *w, float eps, int64_t M, int64_t D,
                                      void *y)
    EACH_ROW(M >= 64, norm_row8, x, r, h, w, eps, D, y)

INLINE TARGET_AVX2 void rotate8(const int bf16, const char *cp, const char *sp, char *x1p,
                                char *x2p, int64_t left) {
    __m256 c = load8(bf16, cp, left), s = load8(bf16, sp, left);
    __m256 x1 = load8(bf16, x1p, left), x2 = load8(bf16, x2p, left);
    __m256 o1 = _mm256_sub_ps(round8(bf16, _mm256_mul_ps(x1, c)),
                              round8(bf16, _mm256_mul_ps(x2, s)));
    __m256 o2 = _mm256_add_ps(round8(bf16, _mm256_mul_ps(x2, c)),
                              round8(bf16, _mm256_mul_ps(x1, s)));
    store8(bf16, x1p, left, o1);
    store8(bf16, x2p, left, o2);
}

INLINE TARGET_AVX2 void rope_row8(const int bf16, int64_t i, void *x, int64_t stride,
                                  int64_t heads, int64_t D, const void *cos_sin,
                                  const int64_t *pos)
    ROPE_ROW(rotate8, 8)

TARGET_AVX2 void zs_rope_avx2(int bf16, void *x, int64_t M, int64_t stride, int64_t heads,
                              int64_t D, const void *cos_sin, const int64_t *pos)
    EACH_ROW(M >= 64, rope_row8, x, stride, heads, D, cos_sin, pos)

INLINE TARGET_AVX2 void silu_row8(const int bf16, int64_t i, const void *gu, int64_t I,
                                  void *y) {
    const int64_t esz = bf16 ? 2 : 4;
    const char *g = (const char *)gu + i * 2 * I * esz, *u = g + I * esz;
    char *o = (char *)y + i * I * esz;
    for (int64_t d = 0; d < I; d += 8) {                 /* silu(g), rounded, times u */
        __m256 gv = load8(bf16, g + d * esz, I - d);
        __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(
            _mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        /* where torch's e^-g overflows to inf, its silu is g / inf = -0 (exp8 stops at e^88;
         * for -88.72 < g <= -88 both give ~1e-36, not the same one) */
        sv = _mm256_blendv_ps(sv, _mm256_mul_ps(gv, _mm256_setzero_ps()),
                              _mm256_cmp_ps(gv, _mm256_set1_ps(-88.72284f), _CMP_LT_OQ));
        store8(bf16, o + d * esz, I - d,
               _mm256_mul_ps(round8(bf16, sv), load8(bf16, u + d * esz, I - d)));
    }
}

TARGET_AVX2 void zs_silu_mul_avx2(int bf16, const void *gu, int64_t M, int64_t I, void *y)
    EACH_ROW(M * I >= 65536, silu_row8, gu, I, y)
