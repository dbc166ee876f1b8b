/* zserve CPU decode attention: one query token per row against its own cached positions,
 * read in place from the paged KV pool (no gather, no mask), AVX-512.
 *
 *   q    [B, H, D]               this step's queries (RoPE applied); rows q_stride
 *                                 elements apart, each row's heads contiguous
 *   kv   [slots, 2, Hkv, D]      one layer's pool: K then V of each slot
 *   table[rows, ctx] int64       request-to-slot table; row[b] is row b's request
 *   lens [B] int64               positions to attend (this token's included), >= 1
 *   out  [B, H, D]               softmax(q k^T * scale) v, per head
 *
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention). Softmax is online
 * (flash-decoding style, in blocks of BLOCK positions), all in float32; bfloat16 K/V are
 * widened on load and the output rounded once. D must be 32, 64, 128 or 256 and H at most
 * MAX_HEADS (attention.py checks both).
 *
 * Measured at 32 rows of 96 positions, 9/3 heads of 64, float32, 2 threads: 100 us a layer
 * with K/V in cache, 265 us a layer before the rows were read once per task and the query
 * and accumulator vectors kept in registers (1100 us for gather + SDPA).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define BLOCK 64
#define MAX_HEADS 64     /* query heads */
#define MAX_D 256

/* The 16 horizontal sums of v[0..15], as one vector: lane i = sum of v[i]'s lanes. A
 * transpose-and-add tree, 45 instructions where 16 separate reductions take ~120. */
INLINE TARGET_F32 __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int k = 0; k < 8; k++)     /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)     /* per 128-bit lane: the lane's sums of v[4k .. 4k+3] */
        x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Ask for every cache line of n slots' rows (the K/V of all heads). */
INLINE void prefetch_rows(const void *kv, const int64_t *slots, int64_t n, int64_t row_bytes) {
    for (int64_t t = 0; t < n; t++) {
        const char *r = (const char *)kv + slots[t] * row_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(r + off, _MM_HINT_T1);
    }
}

/* Heads [g0, g1) of KV heads of one row. `nd` = D / 16 is a compile-time constant at each
 * call site, so a query head's vectors live in registers. Positions go in blocks: every
 * head takes its turn over a block while the block's K/V rows sit in L1/L2, so each row
 * comes from memory once, front to back. */
INLINE TARGET void decode_task(const int bf16, const int nd, const void *q, const void *kv,
                               const int64_t *slots, int64_t len, int64_t H, int64_t Hkv,
                               int64_t g0, int64_t g1, float scale, void *out) {
    const int64_t G = H / Hkv, esz = bf16 ? 2 : 4, D = nd * 16;
    const int64_t row_bytes = 2 * Hkv * D * esz;             /* one slot: K heads, V heads */
    __m512 acc[MAX_HEADS][MAX_D / 16];
    float m[MAX_HEADS], l[MAX_HEADS], s[BLOCK];
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        for (int d = 0; d < nd; d++) acc[h][d] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    prefetch_rows(kv, slots, len < BLOCK ? len : BLOCK, row_bytes);
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        const int64_t *blk = slots + t0;
        if (t0 + BLOCK < len)            /* the next block streams in while this one runs */
            prefetch_rows(kv, blk + BLOCK, len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK,
                          row_bytes);
        for (int64_t h = g0 * G; h < g1 * G; h++) {
            const int64_t g = h / G;
            const char *kbase = (const char *)kv + g * D * esz;
            const char *vbase = (const char *)kv + (Hkv + g) * D * esz;
            const char *qh = (const char *)q + h * D * esz;
            __m512 qv[MAX_D / 16], a[MAX_D / 16];
            for (int d = 0; d < nd; d++)
                qv[d] = _mm512_mul_ps(load16(bf16, qh + d * 16 * esz, 0xFFFF),
                                      _mm512_set1_ps(scale));
            for (int64_t t = 0; t < n; t += 16) {             /* scores, 16 at a time */
                const int64_t cnt = n - t < 16 ? n - t : 16;
                __m512 dots[16];
                for (int j = 0; j < 16; j++) {
                    if (j >= cnt) { dots[j] = _mm512_setzero_ps(); continue; }
                    const char *k = kbase + blk[t + j] * row_bytes;
                    __m512 dot = _mm512_mul_ps(qv[0], load16(bf16, k, 0xFFFF));
                    for (int d = 1; d < nd; d++)
                        dot = _mm512_fmadd_ps(qv[d], load16(bf16, k + d * 16 * esz, 0xFFFF),
                                              dot);
                    dots[j] = dot;
                }
                _mm512_mask_storeu_ps(s + t, tail_mask(cnt), sum16(dots));
            }
            __m512 vmax = _mm512_set1_ps(m[h]);                /* (a separate pass: no chain */
            for (int64_t t = 0; t < n; t += 16)                /*  through the scores loop) */
                vmax = _mm512_mask_max_ps(vmax, tail_mask(n - t), vmax,
                                          _mm512_maskz_loadu_ps(tail_mask(n - t), s + t));
            const float bm = _mm512_reduce_max_ps(vmax);
            const float corr = expf(m[h] - bm);              /* online softmax */
            m[h] = bm;
            __m512 lsum = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                __mmask16 mk = tail_mask(n - t);
                __m512 e = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(
                    _mm512_maskz_loadu_ps(mk, s + t), _mm512_set1_ps(bm))));
                lsum = _mm512_add_ps(lsum, e);
                _mm512_mask_storeu_ps(s + t, mk, e);
            }
            l[h] = l[h] * corr + _mm512_reduce_add_ps(lsum);
            for (int d = 0; d < nd; d++) a[d] = _mm512_mul_ps(acc[h][d], _mm512_set1_ps(corr));
            for (int64_t t = 0; t < n; t++) {                 /* p v */
                const char *v = vbase + blk[t] * row_bytes;
                const __m512 p = _mm512_set1_ps(s[t]);
                for (int d = 0; d < nd; d++)
                    a[d] = _mm512_fmadd_ps(p, load16(bf16, v + d * 16 * esz, 0xFFFF), a[d]);
            }
            for (int d = 0; d < nd; d++) acc[h][d] = a[d];
        }
    }
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        char *o = (char *)out + h * D * esz;
        const __m512 inv = _mm512_set1_ps(1.0f / l[h]);
        for (int d = 0; d < nd; d++)
            store16(bf16, o + d * 16 * esz, 0xFFFF, _mm512_mul_ps(acc[h][d], inv));
    }
}

/* A task is a row (all its KV heads: its K/V rows are read once), or for a batch too small
 * to keep every thread busy, one KV head of a row: how many KV heads a task takes. */
static int64_t kv_heads_per_task(int64_t B, int64_t Hkv) {
    return B >= 4 * omp_get_max_threads() ? Hkv : 1;
}

/* The driver, written once and instantiated per instruction set with its task function
 * (`lanes` floats a vector): a task is one row's KV heads [g0, g1). The dtype and head size
 * are picked inside the loop: OpenMP outlines the loop body before inlining, so only
 * there do they become constants of each task function copy. */
#define TASK(task_fn, lanes, bf16_, d_)                                                 \
    case d_: task_fn(bf16_, d_ / lanes, qb, kv, table + rows[b] * ctx, lens[b], H, Hkv,  \
                     g0, g1, scale, ob); break;
#define TASKS(task_fn, lanes, bf16_)                                                    \
    switch (D) {                                                                        \
    TASK(task_fn, lanes, bf16_, 32) TASK(task_fn, lanes, bf16_, 64)                     \
    TASK(task_fn, lanes, bf16_, 128) TASK(task_fn, lanes, bf16_, 256)                   \
    }
#define DECODE_ROWS(task_fn, lanes)                                                     \
    {                                                                                   \
        const int64_t esz = bf16 ? 2 : 4;                                               \
        const int64_t per_task = kv_heads_per_task(B, Hkv), tasks_per_row = Hkv / per_task; \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                \
        for (int64_t task = 0; task < B * tasks_per_row; task++) {                      \
            const int64_t b = task / tasks_per_row;                                     \
            const int64_t g0 = task % tasks_per_row * per_task, g1 = g0 + per_task;     \
            const char *qb = (const char *)q + b * q_stride * esz;                      \
            char *ob = (char *)out + b * H * D * esz;                                   \
            if (bf16) { TASKS(task_fn, lanes, 1) } else { TASKS(task_fn, lanes, 0) }    \
        }                                                                               \
    }

/* bf16: q, kv and out are bfloat16 (else float32); D is one of KERNEL_HEAD_DIMS. */
TARGET void zs_decode_attention(int bf16, const void *q, int64_t q_stride, const void *kv,
                                const int64_t *table,
                                int64_t ctx, const int64_t *rows, const int64_t *lens,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                                void *out) DECODE_ROWS(decode_task, 16)

/* Write this step's K and V into the pool: kv[slots[i], 0] = k[i], kv[slots[i], 1] = v[i].
 * k and v rows are `stride` elements apart (views into the qkv projection), each row's
 * Hkv * D elements contiguous. One call where torch needs two index_copy_ on views. */
void zs_kv_write(int bf16, void *kv, const int64_t *slots, int64_t N, const void *k,
                 const void *v, int64_t stride, int64_t HkvD) {
    const int64_t esz = bf16 ? 2 : 4, row = HkvD * esz;
#pragma omp parallel for schedule(static) if (N >= 256)
    for (int64_t i = 0; i < N; i++) {
        char *dst = (char *)kv + slots[i] * 2 * row;
        memcpy(dst, (const char *)k + i * stride * esz, row);
        memcpy(dst + row, (const char *)v + i * stride * esz, row);
    }
}

/* ---- AVX2: the same algorithm for CPUs without AVX-512 ----------------------------------
 * 8 float32 lanes; q, K/V and the output in float32 or bfloat16 (simd.h's load8 / store8),
 * sums in float32, the output rounded once. The same blocks, online softmax and task split
 * as above; exp is simd.h's exp8. */

/* decode_task for AVX2; nd = D / 8 and bf16 are compile-time constants at each call. */
INLINE TARGET_AVX2 void decode_task8(const int bf16, const int nd, const void *q,
                                     const void *kv, const int64_t *slots, int64_t len,
                                     int64_t H, int64_t Hkv, int64_t g0, int64_t g1,
                                     float scale, void *out) {
    const int64_t G = H / Hkv, D = nd * 8, esz = bf16 ? 2 : 4;
    const int64_t row = 2 * Hkv * D * esz;                   /* bytes per slot */
    const char *kvb = kv;
    float acc[MAX_HEADS][MAX_D], m[MAX_HEADS], l[MAX_HEADS], s[BLOCK + 8];
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        memset(acc[h], 0, (size_t)D * sizeof(float));
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    prefetch_rows(kv, slots, len < BLOCK ? len : BLOCK, row);
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        const int64_t *blk = slots + t0;
        if (t0 + BLOCK < len)
            prefetch_rows(kv, blk + BLOCK, len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK,
                          row);
        for (int64_t h = g0 * G; h < g1 * G; h++) {
            const int64_t g = h / G;
            const char *kbase = kvb + g * D * esz, *vbase = kvb + (Hkv + g) * D * esz;
            __m256 qv[MAX_D / 8], a[MAX_D / 8];
            for (int d = 0; d < nd; d++)
                qv[d] = _mm256_mul_ps(load8(bf16, (const char *)q + (h * D + 8 * d) * esz, 8),
                                      _mm256_set1_ps(scale));
            float bm = m[h];
            for (int64_t t = 0; t < n; t++) {                 /* scores */
                const char *k = kbase + blk[t] * row;
                __m256 dot = _mm256_mul_ps(qv[0], load8(bf16, k, 8));
                for (int d = 1; d < nd; d++)
                    dot = _mm256_fmadd_ps(qv[d], load8(bf16, k + 8 * d * esz, 8), dot);
                s[t] = hsum8_ps(dot);
                bm = s[t] > bm ? s[t] : bm;
            }
            const float corr = expf(m[h] - bm);              /* online softmax */
            m[h] = bm;
            for (int64_t t = n; t < ((n + 7) & ~7); t++) s[t] = -INFINITY;
            __m256 lsum = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(bm)));
                if (n - t < 8)                                /* the padding weighs 0 */
                    e = _mm256_and_ps(e, _mm256_castsi256_ps(tail8(n - t)));
                lsum = _mm256_add_ps(lsum, e);
                _mm256_storeu_ps(s + t, e);
            }
            l[h] = l[h] * corr + hsum8_ps(lsum);
            for (int d = 0; d < nd; d++)
                a[d] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + 8 * d), _mm256_set1_ps(corr));
            for (int64_t t = 0; t < n; t++) {                 /* p v */
                const char *v = vbase + blk[t] * row;
                const __m256 p = _mm256_set1_ps(s[t]);
                for (int d = 0; d < nd; d++)
                    a[d] = _mm256_fmadd_ps(p, load8(bf16, v + 8 * d * esz, 8), a[d]);
            }
            for (int d = 0; d < nd; d++) _mm256_storeu_ps(acc[h] + 8 * d, a[d]);
        }
    }
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        for (int d = 0; d < nd; d++)
            store8(bf16, (char *)out + (h * D + 8 * d) * esz, 8,
                   _mm256_mul_ps(_mm256_loadu_ps(acc[h] + 8 * d), inv));
    }
}

/* zs_decode_attention's arguments. */
TARGET_AVX2 void zs_decode_attention_avx2(int bf16, const void *q, int64_t q_stride,
                                          const void *kv, const int64_t *table, int64_t ctx,
                                          const int64_t *rows, const int64_t *lens, int64_t B,
                                          int64_t H, int64_t Hkv, int64_t D, float scale,
                                          void *out) DECODE_ROWS(decode_task8, 8)
