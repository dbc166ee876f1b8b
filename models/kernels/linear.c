/* zserve CPU linear kernels: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), AVX-512.
 *
 * W is laid out once, at load time (cpu_linear.py), in panels of 16 output rows:
 *   float32:  P[N/16][K][16]          P[p][k][j]    = W[16p + j][k]
 *   bfloat16: P[N/16][K/2][16][2]     P[p][k][j][t] = W[16p + j][2k + t]   (vdpbf16ps pairs)
 * with N padded to a multiple of 16 and (bfloat16) K to a multiple of 2, the padding zero.
 * A panel is contiguous, so every call streams the weights front to back exactly once,
 * whatever M is: a tile of up to MR rows of x times NR panels keeps its MR x NR
 * accumulators in registers, and the next tile of rows finds the same panels in cache.
 * That one layout serves decode (M = 1: a bandwidth-bound matrix-vector product) and
 * batched decode / prefill (M >= 8: compute-bound, 8 x 3 zmm accumulators).
 *
 * Sums run over k in order, in float32; bfloat16 outputs are rounded once, to nearest even,
 * after the bias is added (as oneDNN does). Threads (OpenMP: the libgomp that torch has
 * already loaded, so torch.set_num_threads applies) split the panels.
 *
 * x and y are contiguous row-major; nothing here allocates or checks: CpuLinear checks
 * x's dtype and width and makes it contiguous.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MR 8    /* rows of x per tile */
#define NR 3    /* panels (of 16 outputs) per tile */

INLINE TARGET_F32 void zero_tile(const int mr, const int nr, __m512 acc[MR][NR]) {
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 3
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
}

/* ---- float32 ------------------------------------------------------------------------- */

INLINE TARGET_F32 void tile_f32(const int mr, const int nr, const float *x, int64_t K,
                                const float *p, int64_t pstride, const float *bias,
                                float *y, int64_t N, int64_t n0) {
    __m512 acc[MR][NR];
    zero_tile(mr, nr, acc);
    for (int64_t k = 0; k < K; k++) {
        __m512 b[NR];
#pragma GCC unroll 3
        for (int j = 0; j < nr; j++) b[j] = _mm512_loadu_ps(p + j * pstride + k * 16);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * K + k]);
#pragma GCC unroll 3
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < nr; j++) {
        int64_t n = n0 + 16 * j;
        __mmask16 m = tail_mask(N - n);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            _mm512_mask_storeu_ps(y + i * N + n, m, _mm512_add_ps(acc[i][j], bv));
    }
}

/* ---- bfloat16 ------------------------------------------------------------------------ */

/* One pair of k (k = 2 * k2, 2 * k2 + 1) into every accumulator; `half`: K is odd and this
 * is its last k, whose pair partner is the zero padding (x has no element there). */
INLINE TARGET void pair_bf16(const int mr, const int nr, __m512 acc[MR][NR],
                             const uint16_t *x, int64_t K, const uint16_t *p, int64_t pstride,
                             int64_t k2, const int half) {
    __m512i b[NR];
#pragma GCC unroll 3
    for (int j = 0; j < nr; j++) b[j] = _mm512_loadu_si512(p + j * pstride + k2 * 32);
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) {
        int32_t pair = 0;                           /* x[2k2] in the low half */
        memcpy(&pair, x + i * K + 2 * k2, half ? 2 : 4);
        __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
        for (int j = 0; j < nr; j++)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
    }
}

INLINE TARGET void tile_bf16(const int mr, const int nr, const uint16_t *x, int64_t K,
                             const uint16_t *p, int64_t pstride, const uint16_t *bias,
                             uint16_t *y, int64_t N, int64_t n0) {
    __m512 acc[MR][NR];
    zero_tile(mr, nr, acc);
    for (int64_t k2 = 0; k2 < K / 2; k2++) pair_bf16(mr, nr, acc, x, K, p, pstride, k2, 0);
    if (K & 1) pair_bf16(mr, nr, acc, x, K, p, pstride, K / 2, 1);
#pragma GCC unroll 3
    for (int j = 0; j < nr; j++) {
        int64_t n = n0 + 16 * j;
        __mmask16 m = tail_mask(N - n);
        __m512 bv = bias ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, bias + n))
                         : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(y + i * N + n, m,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bv)));
    }
}

/* ---- drivers: tiles of (MR rows) x (NR panels); every (mr, nr) edge gets its own
 *      fully unrolled copy of the tile, so the accumulators stay in registers. ------------ */

#define CASE(tile, mr, nr) case (mr) * 4 + (nr): tile(mr, nr, TILE_ARGS); break;
#define CASES_MR(tile, mr) CASE(tile, mr, 1) CASE(tile, mr, 2) CASE(tile, mr, 3)
#define ALL_TILES(tile, mr, nr)                                                   \
    switch ((mr) * 4 + (nr)) {                                                    \
        CASES_MR(tile, 1) CASES_MR(tile, 2) CASES_MR(tile, 3) CASES_MR(tile, 4)   \
        CASES_MR(tile, 5) CASES_MR(tile, 6) CASES_MR(tile, 7) CASES_MR(tile, 8)   \
    }

#define DRIVER(tile, T, pstride_expr)                                             \
    const int64_t panels = (N + 15) / 16, groups = (panels + NR - 1) / NR;        \
    const int64_t pstride = (pstride_expr);                                       \
    _Pragma("omp parallel for schedule(static)")                                  \
    for (int64_t g = 0; g < groups; g++) {                                        \
        const int nr = (int)(panels - g * NR < NR ? panels - g * NR : NR);        \
        const T *pg = p + g * NR * pstride;                                       \
        for (int64_t m0 = 0; m0 < M; m0 += MR) {                                  \
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);                      \
            ALL_TILES(tile, mr, nr)                                               \
        }                                                                         \
    }

#define TILE_ARGS x + m0 * K, K, pg, pstride, bias, y + m0 * N, N, g * NR * 16

TARGET_F32 void zs_linear_f32(const float *x, int64_t M, int64_t K, const float *p,
                              int64_t N, const float *bias, float *y) {
    DRIVER(tile_f32, float, K * 16)
}

TARGET void zs_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *p,
                                int64_t N, const uint16_t *bias, uint16_t *y) {
    DRIVER(tile_bf16, uint16_t, ((K + 1) / 2) * 32)
}

/* ---- AVX2 (no AVX-512): the same panels, 8 lanes, so a panel row is two vectors ------------
 * A tile is up to MR2 rows of x times one panel (2 x MR2 accumulators + 2 weight vectors in
 * the 16 ymm registers). bfloat16 weights are widened in registers (a pair (t = 0, 1) of a
 * 32-bit lane: t = 0 shifted up, t = 1 masked), x rows too; sums in float32 as above, the
 * bfloat16 output rounded once to nearest even (simd.h's store8: AVX2 has no vcvtneps2bf16). */

#define MR2 6

INLINE TARGET_AVX2 __m256 bf16_lo(__m256i pairs) {   /* t = 0 of each pair, as float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
INLINE TARGET_AVX2 __m256 bf16_hi(__m256i pairs) {   /* t = 1 */
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* One pair of k (2 k2, 2 k2 + 1) of bfloat16 x and weights into the accumulators; `half`
 * (a constant): K is odd and this is its last k, whose partner is the zero padding. */
INLINE TARGET_AVX2 void pair_avx2(const int mr, __m256 acc[MR2][2], const uint16_t *x,
                                  int64_t K, const uint16_t *p, int64_t k2, const int half) {
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + k2 * 32));
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + k2 * 32 + 16));
    const __m256 b00 = bf16_lo(w0), b01 = bf16_hi(w0);          /* rows 0-7: k, k + 1 */
    const __m256 b10 = bf16_lo(w1), b11 = bf16_hi(w1);          /* rows 8-15 */
    for (int i = 0; i < mr; i++) {
        uint32_t pair = 0;
        memcpy(&pair, x + i * K + 2 * k2, half ? 2 : 4);
        const __m256i ab = _mm256_set1_epi32((int)pair);
        const __m256 a0 = bf16_lo(ab), a1 = bf16_hi(ab);
        acc[i][0] = _mm256_fmadd_ps(a1, b01, _mm256_fmadd_ps(a0, b00, acc[i][0]));
        acc[i][1] = _mm256_fmadd_ps(a1, b11, _mm256_fmadd_ps(a0, b10, acc[i][1]));
    }
}

/* bf16: weights in pairs, x bfloat16; else float32. `mr` compile-time at each call. */
INLINE TARGET_AVX2 void tile_avx2(const int bf16, const int mr, const void *xv, int64_t K,
                                  const void *pv, const void *bias, void *yv, int64_t N,
                                  int64_t n0) {
    __m256 acc[MR2][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    if (!bf16) {
        const float *x = xv, *p = pv;
        for (int64_t k = 0; k < K; k++) {
            const __m256 b0 = _mm256_loadu_ps(p + k * 16), b1 = _mm256_loadu_ps(p + k * 16 + 8);
            for (int i = 0; i < mr; i++) {
                const __m256 a = _mm256_broadcast_ss(x + i * K + k);
                acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
            }
        }
    } else {
        const uint16_t *x = xv, *p = pv;
        for (int64_t k2 = 0; k2 < K / 2; k2++) pair_avx2(mr, acc, x, K, p, k2, 0);
        if (K & 1) pair_avx2(mr, acc, x, K, p, K / 2, 1);
    }
    const int64_t esz = bf16 ? 2 : 4;
    for (int h = 0; h < 2; h++) {
        const int64_t n = n0 + 8 * h, left = N - n;
        if (left <= 0) break;
        const __m256 bv = bias ? load8(bf16, (const char *)bias + n * esz, left)
                               : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++)
            store8(bf16, (char *)yv + (i * N + n) * esz, left, _mm256_add_ps(acc[i][h], bv));
    }
}

#define TILES2(bf16_)                                                                   \
    switch (mr) {                                                                       \
        case 1: tile_avx2(bf16_, 1, TILE2_ARGS); break;                                 \
        case 2: tile_avx2(bf16_, 2, TILE2_ARGS); break;                                 \
        case 3: tile_avx2(bf16_, 3, TILE2_ARGS); break;                                 \
        case 4: tile_avx2(bf16_, 4, TILE2_ARGS); break;                                 \
        case 5: tile_avx2(bf16_, 5, TILE2_ARGS); break;                                 \
        default: tile_avx2(bf16_, 6, TILE2_ARGS); break;                                \
    }
#define TILE2_ARGS (const char *)x + m0 * K * esz, K, (const char *)p + g * pstride * esz, \
                   bias, (char *)y + m0 * N * esz, N, g * 16

/* Rows of tile t (of `tiles`) when tile t starts at row m0. float32 splits M into tiles of
 * nearly equal size (M = 32: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2): a float32 tile of r rows has
 * 2r independent FMA chains and needs about 10 to hide the FMA latency, so a 2-row tile
 * runs at ~40% (the equal split measured 5-8% faster on the 135M shape's layers at M = 32).
 * bfloat16 takes full tiles first: its cost is widening each weight pair, which a tile's
 * rows share (there the equal split measured 5-7% slower). Rows are summed alike either way. */
static inline int tile_rows(int bf16, int64_t M, int64_t m0, int64_t tiles, int64_t t) {
    if (bf16) return (int)(M - m0 < MR2 ? M - m0 : MR2);
    return (int)(M / tiles + (t < M % tiles));
}

/* zs_linear_f32 / zs_linear_bf16's arguments, with the dtype as a flag. */
TARGET_AVX2 void zs_linear_avx2(int bf16, const void *x, int64_t M, int64_t K, const void *p,
                                int64_t N, const void *bias, void *y) {
    const int64_t panels = (N + 15) / 16, esz = bf16 ? 2 : 4;
    const int64_t pstride = bf16 ? ((K + 1) / 2) * 32 : K * 16;     /* elements per panel */
    const int64_t tiles = (M + MR2 - 1) / MR2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < panels; g++) {
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = tile_rows(bf16, M, m0, tiles, t);
            if (bf16) {
                TILES2(1)
            } else {
                TILES2(0)
            }
            m0 += mr;
        }
    }
}

/* ---- LoRA products (models/lora.py: LoraLinear) --------------------------------------- */

#define LORA_ROWS 64    /* rows of an expand per pass (its scratch: LORA_ROWS x (R_p + n_p)) */
#define LORA_PARTS 3    /* parts of a fused layer: q, k, v */
#define LORA_ENTRY (3 + 5 * LORA_PARTS)

/* A scratch of at least n floats, kept per thread and only grown (a fresh one of ~1 MB a
 * call came from mmap, and its page faults cost more than the products); NULL if it cannot
 * grow. */
static float *lora_scratch(int which, int64_t n) {
    static __thread float *held[2] = {NULL, NULL};
    static __thread int64_t size[2] = {0, 0};
    if (n > size[which]) {
        float *grown = realloc(held[which], sizeof(float) * n);
        if (!grown) return NULL;
        held[which] = grown;
        size[which] = n;
    }
    return held[which];
}

static inline void lora_linear(int avx512, const float *x, int64_t M, int64_t K,
                               const void *p, int64_t N, float *y) {
    if (avx512) zs_linear_f32(x, M, K, p, N, NULL, y);
    else zs_linear_avx2(0, x, M, K, p, N, NULL, y);
}

/* For each run r (runs[3r..3r+2] = slot, lo, hi): t = x[lo:hi] A^T, then for each part p of
 * the layer's output the adapter adapts, y[lo:hi, c_p:c_p + n_p] += t[:, r_p:r_p + R_p] B_p^T.
 * table[LORA_ENTRY slot ...] = {A's panels ([R, K]), R, parts, then per part: r_p, R_p,
 * B_p's panels ([n_p, R_p]), c_p, n_p}; R = 0: the adapter leaves this layer alone. x [*, K]
 * and y [*, N] are contiguous float32. Every product is zs_linear_f32's (avx512) or
 * zs_linear_avx2's, so each sum runs over its k in order; each delta is added to y once.
 * Threads: the shrinks one run after another (each split over its panels), then the
 * expands, one (run, part) per thread at a time (inside, zs_linear runs serially: OpenMP
 * does not nest), as they write disjoint rows or columns of y: two parallel regions a
 * call instead of one per product. Returns 0, or -1 if a scratch could not be grown (y
 * then possibly partly updated: the caller fails the step). */
int zs_lora_f32(int avx512, const float *x, int64_t K, float *y, int64_t N,
                const int64_t *runs, int64_t nruns, const int64_t *table) {
    int64_t total = 0;
    for (int64_t r = 0; r < nruns; r++)
        total += (runs[3 * r + 2] - runs[3 * r + 1]) * table[LORA_ENTRY * runs[3 * r] + 1];
    if (total == 0) return 0;
    float *t = lora_scratch(0, total);
    if (!t) return -1;
    int64_t at = 0;
    for (int64_t r = 0; r < nruns; r++) {
        const int64_t *w = table + LORA_ENTRY * runs[3 * r];
        const int64_t lo = runs[3 * r + 1], hi = runs[3 * r + 2];
        if (w[1] == 0) continue;
        lora_linear(avx512, x + lo * K, hi - lo, K, (const void *)(intptr_t)w[0], w[1], t + at);
        at += (hi - lo) * w[1];
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) reduction(| : failed)
    for (int64_t task = 0; task < nruns * LORA_PARTS; task++) {
        const int64_t r = task / LORA_PARTS, q = task % LORA_PARTS;
        const int64_t *w = table + LORA_ENTRY * runs[3 * r];
        const int64_t rank = w[1];
        if (rank == 0 || q >= w[2]) continue;
        int64_t t0 = 0;                     /* where run r's t starts */
        for (int64_t s = 0; s < r; s++)
            t0 += (runs[3 * s + 2] - runs[3 * s + 1]) * table[LORA_ENTRY * runs[3 * s] + 1];
        const int64_t *pw = w + 3 + 5 * q;
        const int64_t r0 = pw[0], rp = pw[1], c0 = pw[3], np = pw[4];
        const void *b = (const void *)(intptr_t)pw[2];
        float *part = lora_scratch(1, LORA_ROWS * (rp + np));
        if (!part) {
            failed = 1;
            continue;
        }
        float *d = part + LORA_ROWS * rp;
        for (int64_t lo = runs[3 * r + 1], hi = runs[3 * r + 2]; lo < hi; lo += LORA_ROWS) {
            const int64_t m = hi - lo < LORA_ROWS ? hi - lo : LORA_ROWS;
            const float *tr = t + t0 + (lo - runs[3 * r + 1]) * rank, *src = tr;
            if (rp != rank) {                           /* this part's columns of t */
                for (int64_t i = 0; i < m; i++)
                    memcpy(part + i * rp, tr + i * rank + r0, sizeof(float) * rp);
                src = part;
            }
            lora_linear(avx512, src, m, rp, b, np, d);
            for (int64_t i = 0; i < m; i++) {
                float *out = y + (lo + i) * N + c0;
                const float *di = d + i * np;
                for (int64_t j = 0; j < np; j++) out[j] += di[j];
            }
        }
    }
    return failed ? -1 : 0;
}
