/* zserve CPU decode attention: one query token per row against its own cached positions,
 * read in place from the paged KV pool (no gather, no mask), AVX-512.
 *
 *   q    [B, H, D]               this step's queries (RoPE applied), contiguous
 *   kv   [slots, 2, Hkv, D]      one layer's pool: K then V of each slot
 *   table[rows, ctx] int64       request-to-slot table; row[b] is row b's request
 *   lens [B] int64               positions to attend (this token's included), >= 1
 *   out  [B, H, D]               softmax(q k^T * scale) v, per head
 *
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention). Each (row, KV head)
 * is one task: the group's query heads share every K/V row it loads. Softmax is online
 * (flash-decoding style, in blocks of BLOCK positions), all in float32; bfloat16 K/V are
 * widened on load and the output rounded once. D must be a multiple of 16.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define BLOCK 64
#define MAX_GROUP 16     /* query heads per KV head */
#define MAX_D 256

INLINE TARGET void decode_task(int bf16, const void *q, const void *kv, const int64_t *slots,
                               int64_t len, int64_t H, int64_t Hkv, int64_t D, int64_t g,
                               float scale, void *out) {
    const int64_t G = H / Hkv, esz = bf16 ? 2 : 4, nd = D / 16;
    const int64_t row_elems = 2 * Hkv * D;                  /* one slot: K heads, V heads */
    __m512 qv[MAX_GROUP][MAX_D / 16], acc[MAX_GROUP][MAX_D / 16];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][BLOCK];
    for (int64_t i = 0; i < G; i++) {
        const char *qh = (const char *)q + ((g * G + i) * D) * esz;
        for (int64_t d = 0; d < nd; d++) {
            qv[i][d] = _mm512_mul_ps(load16(bf16, qh + d * 16 * esz, 0xFFFF), _mm512_set1_ps(scale));
            acc[i][d] = _mm512_setzero_ps();
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        for (int64_t t = 0; t < n; t++) {                     /* scores */
            const char *k = (const char *)kv + (slots[t0 + t] * row_elems + g * D) * esz;
            __m512 kd[MAX_D / 16];
            for (int64_t d = 0; d < nd; d++) kd[d] = load16(bf16, k + d * 16 * esz, 0xFFFF);
            for (int64_t i = 0; i < G; i++) {
                __m512 dot = _mm512_mul_ps(qv[i][0], kd[0]);
                for (int64_t d = 1; d < nd; d++) dot = _mm512_fmadd_ps(qv[i][d], kd[d], dot);
                s[i][t] = _mm512_reduce_add_ps(dot);
            }
        }
        for (int64_t i = 0; i < G; i++) {                     /* online softmax */
            float bm = m[i];
            for (int64_t t = 0; t < n; t++) bm = s[i][t] > bm ? s[i][t] : bm;
            const float corr = expf(m[i] - bm);
            l[i] *= corr;
            for (int64_t d = 0; d < nd; d++) acc[i][d] = _mm512_mul_ps(acc[i][d], _mm512_set1_ps(corr));
            m[i] = bm;
            int64_t t = 0;
            __m512 lsum = _mm512_setzero_ps();
            for (; t < n; t += 16) {
                __mmask16 mk = tail_mask(n - t);
                __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s[i] + t),
                                                _mm512_set1_ps(bm)));
                e = _mm512_maskz_mov_ps(mk, e);
                lsum = _mm512_add_ps(lsum, e);
                _mm512_mask_storeu_ps(s[i] + t, mk, e);
            }
            l[i] += _mm512_reduce_add_ps(lsum);
        }
        for (int64_t t = 0; t < n; t++) {                     /* p v */
            const char *v = (const char *)kv + (slots[t0 + t] * row_elems + (Hkv + g) * D) * esz;
            __m512 vd[MAX_D / 16];
            for (int64_t d = 0; d < nd; d++) vd[d] = load16(bf16, v + d * 16 * esz, 0xFFFF);
            for (int64_t i = 0; i < G; i++) {
                __m512 p = _mm512_set1_ps(s[i][t]);
                for (int64_t d = 0; d < nd; d++) acc[i][d] = _mm512_fmadd_ps(p, vd[d], acc[i][d]);
            }
        }
    }
    for (int64_t i = 0; i < G; i++) {
        char *o = (char *)out + ((g * G + i) * D) * esz;
        __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (int64_t d = 0; d < nd; d++) {
            __m512 r = _mm512_mul_ps(acc[i][d], inv);
            store16(bf16, o + d * 16 * esz, 0xFFFF, r);
        }
    }
}

INLINE TARGET void decode_all(const int bf16, const void *q, const void *kv,
                              const int64_t *table, int64_t ctx, const int64_t *rows,
                              const int64_t *lens, int64_t B, int64_t H, int64_t Hkv,
                              int64_t D, float scale, void *out) {
    const int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * Hkv; task++) {
        const int64_t b = task / Hkv, g = task % Hkv;
        decode_task(bf16, (const char *)q + b * H * D * esz, kv, table + rows[b] * ctx,
                    lens[b], H, Hkv, D, g, scale, (char *)out + b * H * D * esz);
    }
}

/* bf16: q, kv and out are bfloat16 (else float32). */
TARGET void zs_decode_attention(int bf16, const void *q, const void *kv, const int64_t *table,
                                int64_t ctx, const int64_t *rows, const int64_t *lens,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                                void *out) {
    if (bf16)
        decode_all(1, q, kv, table, ctx, rows, lens, B, H, Hkv, D, scale, out);
    else
        decode_all(0, q, kv, table, ctx, rows, lens, B, H, Hkv, D, scale, out);
}
