/* zserve CPU decode attention: one query token per row against its own cached positions,
 * read in place from the paged KV pool (no gather, no mask), AVX-512.
 *
 *   q    [B, H, D]               this step's queries (RoPE applied); rows q_stride
 *                                 elements apart, each row's heads contiguous
 *   kv   [slots, 2, Hkv, D]      one layer's pool: K then V of each slot, of kind `kvk`:
 *                                 KV_F32, KV_BF16 (either with float32 or bfloat16 q) or
 *                                 KV_I8 (int8, with one float32 scale per KV_BLOCK values:
 *   scales [slots, 2, Hkv, D/32]  value = int8 * scale; NULL unless KV_I8)
 *   table[rows, ctx] int64       request-to-slot table; row[b] is row b's request
 *   lens [B] int64               positions to attend (this token's included), >= 1
 *   out  [B, H, D]               softmax(q k^T * scale) v, per head
 *
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention). Softmax is online
 * (flash-decoding style, in blocks of BLOCK positions), all in float32; bfloat16 and int8
 * K/V are widened on load and the output rounded once. An int8 key's dot product is summed
 * per block of KV_BLOCK values, then scaled (one multiply-add per block); a value row's
 * weight p is multiplied by each block's scale. D must be 32, 64, 128 or 256 and H at most
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
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 64
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };   /* the pool's element kinds (pool.py) */
#define KV_BLOCK 32      /* int8 values per scale */

INLINE int64_t kv_size(const int kvk) { return kvk == KV_F32 ? 4 : kvk == KV_BF16 ? 2 : 1; }

/* 16 K/V values of kind kvk at p as float32 (int8: unscaled). */
INLINE TARGET __m512 load_kv16(const int kvk, const void *p) {
    if (kvk == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return load16(kvk == KV_BF16, p, 0xFFFF);
}

/* q . k over one head (nd vectors of 16), lane-wise (the caller sums the lanes). int8:
 * each KV_BLOCK's partial sum times its scale ks[b]. */
INLINE TARGET __m512 kv_dot16(const int kvk, const int nd, const __m512 *qv, const char *k,
                              const float *ks) {
    const int64_t kesz = kv_size(kvk);
    if (kvk != KV_I8) {
        __m512 dot = _mm512_mul_ps(qv[0], load_kv16(kvk, k));
        for (int d = 1; d < nd; d++)
            dot = _mm512_fmadd_ps(qv[d], load_kv16(kvk, k + d * 16 * kesz), dot);
        return dot;
    }
    const int vpb = KV_BLOCK / 16;
    __m512 dot = _mm512_setzero_ps(), part = _mm512_setzero_ps();
    for (int d = 0; d < nd; d++) {
        const __m512 kd = load_kv16(KV_I8, k + d * 16);
        part = d % vpb ? _mm512_fmadd_ps(qv[d], kd, part) : _mm512_mul_ps(qv[d], kd);
        if (d % vpb == vpb - 1) {
            const __m512 sc = _mm512_set1_ps(ks[d / vpb]);
            dot = d < vpb ? _mm512_mul_ps(part, sc) : _mm512_fmadd_ps(part, sc, dot);
        }
    }
    return dot;
}
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

/* The same for the K/V rows of n slots, and their int8 scales (kvk KV_I8). */
INLINE void prefetch_kv(const int kvk, const void *kv, const float *scales,
                        const int64_t *slots, int64_t n, int64_t row_bytes, int64_t srow) {
    prefetch_rows(kv, slots, n, row_bytes);
    if (kvk == KV_I8) prefetch_rows(scales, slots, n, srow * (int64_t)sizeof(float));
}

/* Heads [g0, g1) of KV heads of one row. `nd` = D / 16 is a compile-time constant at each
 * call site, so a query head's vectors live in registers. Positions go in blocks: every
 * head takes its turn over a block while the block's K/V rows sit in L1/L2, so each row
 * comes from memory once, front to back. */
INLINE TARGET void decode_task(const int bf16, const int kvk, const int nd, const void *q,
                               const void *kv, const float *scales, const int64_t *slots,
                               int64_t len, int64_t H, int64_t Hkv, int64_t g0, int64_t g1,
                               float scale, void *out, float *part) {
    const int64_t G = H / Hkv, esz = bf16 ? 2 : 4, D = nd * 16, kesz = kv_size(kvk);
    const int64_t row_bytes = 2 * Hkv * D * kesz;            /* one slot: K heads, V heads */
    const int64_t nb = D / KV_BLOCK, srow = 2 * Hkv * nb;    /* int8: a slot's scales */
    __m512 acc[MAX_HEADS][MAX_D / 16];
    float m[MAX_HEADS], l[MAX_HEADS], s[BLOCK];
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        for (int d = 0; d < nd; d++) acc[h][d] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    prefetch_kv(kvk, kv, scales, slots, len < BLOCK ? len : BLOCK, row_bytes, srow);
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        const int64_t *blk = slots + t0;
        if (t0 + BLOCK < len)            /* the next block streams in while this one runs */
            prefetch_kv(kvk, kv, scales, blk + BLOCK,
                        len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK, row_bytes, srow);
        for (int64_t h = g0 * G; h < g1 * G; h++) {
            const int64_t g = h / G;
            const char *kbase = (const char *)kv + g * D * kesz;
            const char *vbase = (const char *)kv + (Hkv + g) * D * kesz;
            const float *ksb = kvk == KV_I8 ? scales + g * nb : NULL;
            const float *vsb = kvk == KV_I8 ? scales + (Hkv + g) * nb : NULL;
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
                    dots[j] = kv_dot16(kvk, nd, qv, kbase + blk[t + j] * row_bytes,
                                       kvk == KV_I8 ? ksb + blk[t + j] * srow : NULL);
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
                if (kvk == KV_I8) {                           /* p times each block's scale */
                    const float *vs = vsb + blk[t] * srow;
                    for (int64_t b = 0; b < nb; b++) {
                        const __m512 pb = _mm512_set1_ps(s[t] * vs[b]);
                        for (int d = b * KV_BLOCK / 16; d < (b + 1) * KV_BLOCK / 16; d++)
                            a[d] = _mm512_fmadd_ps(pb, load_kv16(KV_I8, v + d * 16), a[d]);
                    }
                    continue;
                }
                const __m512 p = _mm512_set1_ps(s[t]);
                for (int d = 0; d < nd; d++)
                    a[d] = _mm512_fmadd_ps(p, load_kv16(kvk, v + d * 16 * kesz), a[d]);
            }
            for (int d = 0; d < nd; d++) acc[h][d] = a[d];
        }
    }
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        if (part) {                                   /* a share of the positions: partials */
            float *p = part + h * (D + 2);
            p[0] = m[h];
            p[1] = l[h];
            for (int d = 0; d < nd; d++) _mm512_storeu_ps(p + 2 + 16 * d, acc[h][d]);
            continue;
        }
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

/* Splitting positions (flash-decoding's split-K). With fewer (row, KV head) pairs than
 * 4 tasks a thread (one long request: 3 KV heads on 2 threads leave a thread idle a third
 * of the time), each pair's positions are cut into up to MAX_SPLITS shares of at least
 * SPLIT_MIN, each share's softmax partials (its max m, sum l and unnormalized p.v) go to a
 * buffer, and merge_parts weighs them together: out = sum_s e^(m_s - M) acc_s /
 * sum_s e^(m_s - M) l_s, M = max_s m_s (the same online-softmax algebra the blocks use). */
#define SPLIT_MIN 256
#define MAX_SPLITS 16

static int64_t position_splits(int64_t B, int64_t Hkv, int64_t longest) {
    const int64_t threads = omp_get_max_threads(), pairs = B * Hkv;
    if (threads == 1 || pairs >= 4 * threads) return 1;
    int64_t s = (4 * threads + pairs - 1) / pairs;
    if (s > longest / SPLIT_MIN) s = longest / SPLIT_MIN;
    if (s > MAX_SPLITS) s = MAX_SPLITS;
    return s < 1 ? 1 : s;
}

/* parts [S][B][H][2 + D] (m, l, acc) -> out [B, H, D], rounded once to the dtype. */
static void merge_parts(int bf16, const float *parts, int64_t S, int64_t B, int64_t H,
                        int64_t D, void *out) {
    for (int64_t bh = 0; bh < B * H; bh++) {
        float M = -INFINITY, w[MAX_SPLITS], L = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            const float m = parts[(s * B * H + bh) * (D + 2)];
            M = m > M ? m : M;
        }
        for (int64_t s = 0; s < S; s++) {
            const float *p = parts + (s * B * H + bh) * (D + 2);
            w[s] = p[1] > 0.0f || p[1] != p[1] ? expf(p[0] - M) : 0.0f;   /* empty share: 0 */
            L += w[s] * p[1];
        }
        for (int64_t d = 0; d < D; d++) {
            float o = 0.0f;
            for (int64_t s = 0; s < S; s++) o += w[s] * parts[(s * B * H + bh) * (D + 2) + 2 + d];
            o /= L;
            if (bf16) ((uint16_t *)out)[bh * D + d] = f32_to_bf16(o);
            else ((float *)out)[bh * D + d] = o;
        }
    }
}

/* The driver, written once and instantiated per instruction set with its task function
 * (`lanes` floats a vector): a task is one row's KV heads [g0, g1) over its positions
 * [t0, t1) (all of them unless split). The dtype and head size are picked inside the loop:
 * OpenMP outlines the loop body before inlining, so only there do they become constants
 * of each task function copy. */
#define TASK(task_fn, lanes, bf16_, kvk_, d_)                                           \
    case d_: task_fn(bf16_, kvk_, d_ / lanes, qb, kv, scales, table + rows[b] * ctx + t0, \
                     t1 - t0, H, Hkv, g0, g1, scale, ob, pb); break;
#define TASKS(task_fn, lanes, bf16_, kvk_)                                              \
    switch (D) {                                                                        \
    TASK(task_fn, lanes, bf16_, kvk_, 32) TASK(task_fn, lanes, bf16_, kvk_, 64)         \
    TASK(task_fn, lanes, bf16_, kvk_, 128) TASK(task_fn, lanes, bf16_, kvk_, 256)       \
    }
#define KINDS(task_fn, lanes, bf16_)                                                    \
    switch (kvk) {                                                                      \
    case KV_F32: TASKS(task_fn, lanes, bf16_, KV_F32) break;                            \
    case KV_BF16: TASKS(task_fn, lanes, bf16_, KV_BF16) break;                          \
    case KV_I8: TASKS(task_fn, lanes, bf16_, KV_I8) break;                              \
    }
#define DECODE_ROWS(task_fn, lanes)                                                     \
    {                                                                                   \
        const int64_t esz = bf16 ? 2 : 4;                                               \
        int64_t longest = 0;                                                            \
        for (int64_t b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest; \
        int64_t S = position_splits(B, Hkv, longest);                                   \
        float *parts = S > 1 ? malloc((size_t)(S * B * H * (D + 2)) * sizeof(float)) : NULL; \
        if (!parts) S = 1;                  /* no memory for the partials: unsplit */   \
        /* positions a share, whole blocks */                                           \
        const int64_t chunk = ((longest + S - 1) / S + BLOCK - 1) / BLOCK * BLOCK;      \
        const int64_t per_task = S > 1 ? 1 : kv_heads_per_task(B, Hkv);                 \
        const int64_t tasks_per_row = Hkv / per_task * S;                               \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                \
        for (int64_t task = 0; task < B * tasks_per_row; task++) {                      \
            const int64_t b = task / tasks_per_row, r = task % tasks_per_row, s = r % S; \
            const int64_t g0 = r / S * per_task, g1 = g0 + per_task;                    \
            const int64_t t0 = S > 1 ? (s * chunk < lens[b] ? s * chunk : lens[b]) : 0; \
            const int64_t t1 = S > 1 ? (t0 + chunk < lens[b] ? t0 + chunk : lens[b]) : lens[b]; \
            const char *qb = (const char *)q + b * q_stride * esz;                      \
            char *ob = (char *)out + b * H * D * esz;                                   \
            float *pb = parts ? parts + (s * B + b) * H * (D + 2) : NULL;               \
            if (bf16) { KINDS(task_fn, lanes, 1) } else { KINDS(task_fn, lanes, 0) }    \
        }                                                                               \
        if (parts) {                                                                    \
            merge_parts(bf16, parts, S, B, H, D, out);                                  \
            free(parts);                                                                \
        }                                                                               \
    }

/* bf16: q and out are bfloat16 (else float32); kvk: the pool's kind (KV_F32, KV_BF16, or
 * KV_I8 with `scales`, else NULL); D is one of KERNEL_HEAD_DIMS. */
TARGET void zs_decode_attention(int bf16, int kvk, const void *q, int64_t q_stride,
                                const void *kv, const float *scales, const int64_t *table,
                                int64_t ctx, const int64_t *rows, const int64_t *lens,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                                void *out) DECODE_ROWS(decode_task, 16)

/* Round one block of KV_BLOCK float32 values to int8: scale = max |x| / 127, q = x / scale
 * rounded to nearest even (adding and taking away 1.5 * 2^23: exact for |x / scale| < 2^22),
 * clamped to [-127, 127]. A scale of 0 (all zeros) or NaN (a NaN among x) gives q = 0; a NaN
 * scale reads back as NaN, so a NaN poisons its row as it does in float. pool.py's
 * quantize_kv computes the same bits in torch. */
static void quantize_block(const float *x, int8_t *q, float *scale) {
    float amax = 0.0f;
    for (int j = 0; j < KV_BLOCK; j++) {
        const float a = fabsf(x[j]);
        if (a > amax || a != a) amax = a;           /* a NaN sticks, as in torch's amax */
    }
    const float d = amax / 127.0f;
    *scale = d != d ? NAN : d;                     /* the default NaN, as torch writes */
    for (int j = 0; j < KV_BLOCK; j++) {
        float r = d > 0.0f ? (x[j] / d + 0x1.8p23f) - 0x1.8p23f : 0.0f;
        if (r != r) r = 0.0f;                       /* inf / inf */
        q[j] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
}

/* n values (a multiple of KV_BLOCK unless kvk is the source's own kind) from src (float32,
 * or bfloat16 if bf16) into a slot's K or V row of kind kvk (scales: its int8 scales). */
static void kv_put(int bf16, int kvk, const void *src, void *dst, float *scales, int64_t n) {
    if (kvk == (bf16 ? KV_BF16 : KV_F32)) {
        memcpy(dst, src, (size_t)(n * (bf16 ? 2 : 4)));
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += KV_BLOCK) {
        float x[KV_BLOCK];
        for (int j = 0; j < KV_BLOCK; j++)
            x[j] = bf16 ? bf16_to_f32(((const uint16_t *)src)[i0 + j])
                        : ((const float *)src)[i0 + j];
        if (kvk == KV_F32) memcpy((float *)dst + i0, x, sizeof x);
        else if (kvk == KV_BF16)
            for (int j = 0; j < KV_BLOCK; j++) ((uint16_t *)dst)[i0 + j] = f32_to_bf16(x[j]);
        else quantize_block(x, (int8_t *)dst + i0, scales + i0 / KV_BLOCK);
    }
}

/* Write this step's K and V into the pool: kv[slots[i], 0] = k[i], kv[slots[i], 1] = v[i],
 * converted from the model dtype (bf16: bfloat16, else float32) to the pool's kind kvk
 * (KV_I8: rounded per block, the scales into `scales`, else NULL). k and v rows are `stride`
 * elements apart (views into the qkv projection), each row's Hkv * D elements contiguous.
 * One call where torch needs two index_copy_ on views. */
void zs_kv_write(int bf16, int kvk, void *kv, float *scales, const int64_t *slots, int64_t N,
                 const void *k, const void *v, int64_t stride, int64_t HkvD) {
    const int64_t esz = bf16 ? 2 : 4, row = HkvD * kv_size(kvk), srow = 2 * HkvD / KV_BLOCK;
#pragma omp parallel for schedule(static) if (N >= 256)
    for (int64_t i = 0; i < N; i++) {
        char *dst = (char *)kv + slots[i] * 2 * row;
        float *sc = kvk == KV_I8 ? scales + slots[i] * srow : NULL;
        kv_put(bf16, kvk, (const char *)k + i * stride * esz, dst, sc, HkvD);
        kv_put(bf16, kvk, (const char *)v + i * stride * esz, dst + row,
               sc ? sc + srow / 2 : NULL, HkvD);
    }
}

/* ---- AVX2: the same algorithm for CPUs without AVX-512 ----------------------------------
 * 8 float32 lanes; q, K/V and the output in float32 or bfloat16 (simd.h's load8 / store8),
 * sums in float32, the output rounded once. The same blocks, online softmax and task split
 * as above; exp is simd.h's exp8. */

/* load_kv16 and kv_dot16 for AVX2: 8 values, blocks of KV_BLOCK / 8 vectors. */
INLINE TARGET_AVX2 __m256 load_kv8(const int kvk, const void *p) {
    if (kvk == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return load8(kvk == KV_BF16, p, 8);
}

INLINE TARGET_AVX2 __m256 kv_dot8(const int kvk, const int nd, const __m256 *qv,
                                  const char *k, const float *ks) {
    const int64_t kesz = kv_size(kvk);
    if (kvk != KV_I8) {
        __m256 dot = _mm256_mul_ps(qv[0], load_kv8(kvk, k));
        for (int d = 1; d < nd; d++)
            dot = _mm256_fmadd_ps(qv[d], load_kv8(kvk, k + d * 8 * kesz), dot);
        return dot;
    }
    const int vpb = KV_BLOCK / 8;
    __m256 dot = _mm256_setzero_ps(), part = _mm256_setzero_ps();
    for (int d = 0; d < nd; d++) {
        const __m256 kd = load_kv8(KV_I8, k + d * 8);
        part = d % vpb ? _mm256_fmadd_ps(qv[d], kd, part) : _mm256_mul_ps(qv[d], kd);
        if (d % vpb == vpb - 1) {
            const __m256 sc = _mm256_set1_ps(ks[d / vpb]);
            dot = d < vpb ? _mm256_mul_ps(part, sc) : _mm256_fmadd_ps(part, sc, dot);
        }
    }
    return dot;
}

/* decode_task for AVX2; nd = D / 8 and bf16 are compile-time constants at each call. */
INLINE TARGET_AVX2 void decode_task8(const int bf16, const int kvk, const int nd,
                                     const void *q, const void *kv, const float *scales,
                                     const int64_t *slots, int64_t len, int64_t H,
                                     int64_t Hkv, int64_t g0, int64_t g1, float scale,
                                     void *out, float *part) {
    const int64_t G = H / Hkv, D = nd * 8, esz = bf16 ? 2 : 4, kesz = kv_size(kvk);
    const int64_t row = 2 * Hkv * D * kesz;                  /* bytes per slot */
    const int64_t nb = D / KV_BLOCK, srow = 2 * Hkv * nb;    /* int8: a slot's scales */
    const char *kvb = kv;
    float acc[MAX_HEADS][MAX_D], m[MAX_HEADS], l[MAX_HEADS], s[BLOCK + 8];
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        memset(acc[h], 0, (size_t)D * sizeof(float));
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    prefetch_kv(kvk, kv, scales, slots, len < BLOCK ? len : BLOCK, row, srow);
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        const int64_t *blk = slots + t0;
        if (t0 + BLOCK < len)
            prefetch_kv(kvk, kv, scales, blk + BLOCK,
                        len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK, row, srow);
        for (int64_t h = g0 * G; h < g1 * G; h++) {
            const int64_t g = h / G;
            const char *kbase = kvb + g * D * kesz, *vbase = kvb + (Hkv + g) * D * kesz;
            const float *ksb = kvk == KV_I8 ? scales + g * nb : NULL;
            const float *vsb = kvk == KV_I8 ? scales + (Hkv + g) * nb : NULL;
            __m256 qv[MAX_D / 8], a[MAX_D / 8];
            for (int d = 0; d < nd; d++)
                qv[d] = _mm256_mul_ps(load8(bf16, (const char *)q + (h * D + 8 * d) * esz, 8),
                                      _mm256_set1_ps(scale));
            float bm = m[h];
            for (int64_t t = 0; t < n; t++) {                 /* scores */
                s[t] = hsum8_ps(kv_dot8(kvk, nd, qv, kbase + blk[t] * row,
                                        kvk == KV_I8 ? ksb + blk[t] * srow : NULL));
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
                if (kvk == KV_I8) {                           /* p times each block's scale */
                    const float *vs = vsb + blk[t] * srow;
                    for (int64_t b = 0; b < nb; b++) {
                        const __m256 pb = _mm256_set1_ps(s[t] * vs[b]);
                        for (int d = b * KV_BLOCK / 8; d < (b + 1) * KV_BLOCK / 8; d++)
                            a[d] = _mm256_fmadd_ps(pb, load_kv8(KV_I8, v + 8 * d), a[d]);
                    }
                    continue;
                }
                const __m256 p = _mm256_set1_ps(s[t]);
                for (int d = 0; d < nd; d++)
                    a[d] = _mm256_fmadd_ps(p, load_kv8(kvk, v + 8 * d * kesz), a[d]);
            }
            for (int d = 0; d < nd; d++) _mm256_storeu_ps(acc[h] + 8 * d, a[d]);
        }
    }
    for (int64_t h = g0 * G; h < g1 * G; h++) {
        if (part) {                                   /* a share of the positions: partials */
            float *p = part + h * (D + 2);
            p[0] = m[h];
            p[1] = l[h];
            memcpy(p + 2, acc[h], (size_t)D * sizeof(float));
            continue;
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        for (int d = 0; d < nd; d++)
            store8(bf16, (char *)out + (h * D + 8 * d) * esz, 8,
                   _mm256_mul_ps(_mm256_loadu_ps(acc[h] + 8 * d), inv));
    }
}

/* zs_decode_attention's arguments. */
TARGET_AVX2 void zs_decode_attention_avx2(int bf16, int kvk, const void *q, int64_t q_stride,
                                          const void *kv, const float *scales,
                                          const int64_t *table, int64_t ctx,
                                          const int64_t *rows, const int64_t *lens, int64_t B,
                                          int64_t H, int64_t Hkv, int64_t D, float scale,
                                          void *out) DECODE_ROWS(decode_task8, 8)
