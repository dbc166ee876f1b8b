/* zserve quantized linear kernels: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 x and y,
 * W in GGUF's blocks of 32 weights (and, further below, the K-quants' and IQ4_XS's blocks
 * of 256 in blocks.c's layout), regrouped 8 output rows at a time. Two versions of the
 * block products: AVX2 + FMA + F16C (8 lanes, vpmaddubsw) and AVX-512 VNNI (16 lanes,
 * vpdpbusd; below), chosen by the caller (blocks.c: zs_linear_parts, from
 * kernels.vnni_available, the rule's one home).
 *
 * GGUF stores each output row as K/32 blocks:
 *   Q8_0  34 bytes: fp16 d, int8 q[32]                      w[j] = d * q[j]
 *   Q4_0  18 bytes: fp16 d, uint8 qs[16]                    w[j] = d * (nibble_j - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, uint8 qs[16]            w[j] = d * nibble_j + m
 *   Q5_0  22 bytes: fp16 d, uint32 qh, uint8 qs[16]         w[j] = d * (five_j - 16)
 *   Q5_1  24 bytes: fp16 d, fp16 m, uint32 qh, uint8 qs[16] w[j] = d * five_j + m
 *   IQ4_NL 18 bytes: fp16 d, uint8 qs[16]                   w[j] = d * KVALUES[nibble_j]
 * with nibble_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16, and five_j the
 * nibble with bit j of qh on top. At load (models/quant_linear.py: regroup) every 8 rows
 * (N padded with zero rows) become one group, and each block of a group is stored as
 *   d[8] fp16, (Q4_1, Q5_1) m[8] fp16, (Q5) qh of rows 0..7 (its bits in blocks.c's
 *   QH_BIT order), then for each quad c of the block's bytes (Q4, Q5, IQ4_NL: qs[4c..4c+3], c < 4;
 *   Q8_0: q[4c..4c+3], c < 8) those 4 bytes of rows 0..7: one 32-byte vector.
 * the same bytes as the file, reordered; a group's blocks are contiguous, then the next
 * group's. One vector of a quad then holds 8 rows in its 8 int32 lanes, so a block's dot
 * products for 8 outputs come out in the 8 lanes of one register: no horizontal sums, the
 * scales of 8 rows load as one vector, and one broadcast of x serves 8 rows.
 *
 * Like llama.cpp, x is quantized first, per row and per block of 32, to int8 with one float
 * scale (dx = max|x| / 127, xq = round(x / dx)), so each block's dot product is an integer
 * sum (vpmaddubsw: u8 x s8 pairs -> s16, vpmaddwd -> s32), then scaled:
 *   Q8_0: d * dx * sum(q * xq)
 *   Q4_0: d * dx * sum(nibble * xq) - 8 * d * (dx * sum(xq))
 *   Q4_1: d * dx * sum(nibble * xq) +     m * (dx * sum(xq))
 *   Q5_0, Q5_1: the same with five_j and 16 (QH_BIT puts a quad's fifth bits beside its
 *   nibbles with two shifts and masks: the bytes are five_j, 0..31).
 *   IQ4_NL: d * dx * sum(KVALUES[nibble] * xq), the values looked up by a byte shuffle
 *   (signed bytes: Q8_0's sign trick).
 * No s16 overflow: Q4 sums 8 vpmaddubsw results of at most 2 * 15 * 127 each (30480 in
 * all) before widening, Q5 4 of at most 2 * 31 * 127 (31496); Q8_0 (|q| <= 128 by the
 * sign trick, 32512 per result) widens each.
 * The only error beyond the weights' own is x's rounding to int8.
 *
 * AVX-512 VNNI: one 64-byte load holds two adjacent quads of the 8 rows (quad c in lanes
 * 0-7, c + 1 in lanes 8-15), x's two matching 4-byte groups are put beside them by one
 * vpermd, and vpdpbusd adds the u8 x s8 products of each lane's 4 byte pairs into int32
 * (no s16 stage, so nothing to widen); the two halves' sums are added at the block's end.
 * Signed weights (Q8_0, IQ4_NL) multiply as |q| times x negated where q < 0 (a mask
 * subtract: AVX-512 has no vpsignb). Both versions compute each block's integer sum
 * exactly and then the same float operations in the same order, so their outputs are
 * equal bit for bit (tests/test_quant.py holds them to it); x is rounded by the same
 * (AVX2) code in both.
 *
 * Loop order: rows of x in chunks of MC (their int8 copy stays in cache), threads split the
 * groups (OpenMP: torch's libgomp, so torch.set_num_threads applies), and a group's blocks
 * are read once per tile of MR rows of x: at M = 1 the weights stream from memory exactly
 * once (the bandwidth-bound matrix-vector product); at M = 32 each block is unpacked once
 * for 4 rows. The int8 copy of x lives in a per-thread scratch buffer that only grows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define QTARGET __attribute__((target("avx2,fma,f16c")))
#define VTARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

#define QK 32   /* weights per block */
#define MR 4    /* rows of x per tile */
#define MC 64   /* rows of x per chunk */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7,   /* gguf.GGMLQuantizationType */
       GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20,
       GGML_IQ4_XS = 23 };

/* ---- x -> int8 blocks ----------------------------------------------------------------- */

/* One row: xq[K], dx[K/32] (the scales), sx[K/32] = dx * sum(xq) (for the offset terms). */
INLINE QTARGET void quantize_row(const float *x, int64_t nb, int8_t *xq, float *dx,
                                  float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; j++)     /* round to nearest even, as llama.cpp */
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id),
                                                      _MM_FROUND_TO_NEAREST_INT |
                                                      _MM_FROUND_NO_EXC));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                     _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* int32 -> int16 -> int8 packs work within 128-bit lanes: fix the order after. */
        __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + b * QK), p8);
        dx[b] = d;
        sx[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

/* ---- one group of 8 rows: tiles of mr rows of x ------------------------------------------ */

#define TILE_PARAMS const int mr, const uint8_t *w, int64_t nb, const int8_t *xq, int64_t K, \
                    const float *dx, const float *sx, float out[MR][8]
/* w: the group's blocks; xq, dx, sx: the tile's first row of x (rows K, nb and nb apart);
 * out: the 8 outputs of each of the mr rows. */

/* acc += (a block's or sub-block's integer sums s) * d * dx: every tile's float step, on
 * both ISAs (so their outputs are equal bit for bit). */
INLINE QTARGET __m256 scale_add(__m256 acc, __m256i s, __m256 d, float dx) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
}

INLINE QTARGET __m256i bcast4(const int8_t *p) {     /* 4 bytes of x into every int32 lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Q4_0 (offset -8 * d), Q4_1 (offset m), Q5_0 (offset -16 * d), Q5_1 (offset m): `with_m`
 * and `q5` are compile-time constants. */
INLINE QTARGET void tile_q4(const int with_m, const int q5, TILE_PARAMS) {
    const int64_t bsize = 16 + (with_m ? 16 : 0) + (q5 ? 32 : 0) + 128;
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bsize;
        const uint8_t *qh = blk + (with_m ? 32 : 16), *qs = qh + (q5 ? 32 : 0);
        _mm_prefetch((const char *)(blk + 8 * bsize), _MM_HINT_T0);
        const __m256 d = f16x8(blk);
        const __m256 o = with_m ? f16x8(blk + 16)
                                : _mm256_mul_ps(d, _mm256_set1_ps(q5 ? -16.0f : -8.0f));
        const __m256i h = q5 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            lo[c] = _mm256_and_si256(v, low);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (q5) {
                lo[c] = _mm256_or_si256(lo[c], _mm256_and_si256(_mm256_slli_epi32(h, 4 - c), fifth));
                hi[c] = _mm256_or_si256(hi[c], _mm256_and_si256(_mm256_srli_epi32(h, c), fifth));
            }
        }
        for (int i = 0; i < mr; i++) {
            const int8_t *x = xq + i * K + b * QK;
            __m256i s = _mm256_maddubs_epi16(lo[0], bcast4(x));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast4(x + 16)));
            __m256i s32 = _mm256_setzero_si256();
            for (int c = 1; c < 4; c++) {
                if (q5 && c == 2) {                 /* 4 results of at most 7874: widen */
                    s32 = _mm256_madd_epi16(s, ones);
                    s = _mm256_setzero_si256();
                }
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[c], bcast4(x + 4 * c)));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[c], bcast4(x + 16 + 4 * c)));
            }
            s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s, ones));
            acc[i] = scale_add(acc[i], s32, d, dx[i * nb + b]);
            acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(sx[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

INLINE QTARGET void tile_q8_0(TILE_PARAMS) {
    (void)sx;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 272;
        const uint8_t *qs = blk + 16;
        _mm_prefetch((const char *)(blk + 4 * 272), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 4 * 272 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 4 * 272 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 4 * 272 + 192), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 4 * 272 + 256), _MM_HINT_T0);
        const __m256 d = f16x8(blk);
        for (int i = 0; i < mr; i++) {
            const int8_t *x = xq + i * K + b * QK;
            __m256i s = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q),
                                                       _mm256_sign_epi8(bcast4(x + 4 * c), q));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
            }
            acc[i] = scale_add(acc[i], s, d, dx[i * nb + b]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* The scales of an IQ4 block's sub-blocks, 8 rows each: IQ4_NL's one d; IQ4_XS's 8,
 * d * (ls - 32) with ls the nibble i of scales_l (a unit at 32) under bits 2i of the row's
 * uint16 scales_h (at 16). */
INLINE QTARGET void iq4_scales(const int xs, const uint8_t *blk, __m256 dl[8]) {
    const __m256 d = f16x8(blk);
    if (!xs) {
        dl[0] = d;
        return;
    }
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)));
    const __m256i sl = _mm256_loadu_si256((const __m256i *)(blk + 32));
    for (int i = 0; i < 8; i++) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 4 * i), _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sh, 2 * i), _mm256_set1_epi32(3));
        dl[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(
            _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32))));
    }
}

/* IQ4_NL (xs = 0) and IQ4_XS (xs = 1): each nibble stands for KVALUES[nibble] (gguf-py:
 * IQ4_NL.kvalues), a signed byte: one vpshufb looks up a vector's 32 low (or high) nibbles
 * at once, then Q8_0's products (|value| <= 127, so each pair's sum fits s16; widened per
 * quad). IQ4_NL: Q4_0's layout, d at 0, qs (4 units) at 16; IQ4_XS: 8 such sub-blocks (qs
 * units 4i..4i+3 at 64) of scale d (ls - 32) (iq4_scales, above). */
INLINE QTARGET void tile_iq4(const int xs, TILE_PARAMS) {
    (void)sx;
    const int64_t bsize = xs ? 1088 : 144, subs = xs ? 8 : 1, per = xs ? 8 : 1;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / per; B++) {
        const uint8_t *blk = w + B * bsize, *qs = blk + (xs ? 64 : 16);
        _mm_prefetch((const char *)(blk + (xs ? 2 : 8) * bsize), _MM_HINT_T0);
        __m256 dl[8];
        iq4_scales(xs, blk, dl);
        for (int ib = 0; ib < subs; ib++) {
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (4 * ib + c)));
                lo[c] = iq4_values(_mm256_and_si256(v, low));
                hi[c] = iq4_values(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
            const int64_t b = per * B + ib;
            for (int i = 0; i < mr; i++) {
                const int8_t *x = xq + i * K + b * QK;
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i xl = bcast4(x + 4 * c), xh = bcast4(x + 16 + 4 * c);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_sign_epi8(lo[c], lo[c]), _mm256_sign_epi8(xl, lo[c])), ones));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_sign_epi8(hi[c], hi[c]), _mm256_sign_epi8(xh, hi[c])), ones));
                }
                acc[i] = scale_add(acc[i], s, dl[ib], dx[i * nb + b]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* ---- blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS): blocks.c's group layout ---------------- *
 * Each of their sub-blocks lies within one block of 32 of x, so its integer sum takes x's
 * scale dx and then its own: per sub-block one more float multiply than a block of 32
 * above. nb counts x's blocks of 32 (8 to a weight block). Fields (regroup's units of 8
 * rows; blocks_impl.h says the positions):
 *   Q4_K / Q5_K  d, dmin (16 bytes each), scales (3 units) at 32, Q5_K's qh (8 units) at
 *                128, qs (32 units) at 128 / 384: unit 8j + u holds quad u of sub-block
 *                2j in its low nibbles and of 2j + 1 in its high ones; w = ds q - dm;
 *   Q6_K         ql (32 units), qh (16) at 1024, int8 scales (4) at 1536, d at 1664; x
 *                block 4h + t's quad cq is ql unit 16h + 8(t % 2) + cq (nibble t / 2) with
 *                qh unit 8h + cq (bits 2t), w = d sc (q - 32), a scale per 16 values;
 *   IQ4_XS       d, scales_h (a uint16 a row) at 16, scales_l (1 unit) at 32, qs (32
 *                units) at 64: sub-block i is IQ4_NL's block in units 4i..4i+3, scale
 *                d (ls - 32) (tile_iq4, with IQ4_NL's, above).
 * Q6_K's codes q - 32 (|.| <= 32) multiply as signed bytes (Q8_0's way: 4 pair sums of at
 * most 2 * 32 * 127 in s16); Q5_K's five-bit codes widen after 4 (as Q5_0). */

INLINE QTARGET void tile_k4(const int q5, TILE_PARAMS) {
    const int64_t bsize = q5 ? 1408 : 1152;
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / 8; B++) {
        const uint8_t *blk = w + B * bsize;
        const uint8_t *qh = blk + 128, *qs = blk + (q5 ? 384 : 128);
        _mm_prefetch((const char *)(blk + 2 * bsize), _MM_HINT_T0);
        __m256 ds[8], dm[8];
        k4_scales8(blk + 32, f16x8(blk), f16x8(blk + 16), ds, dm);
        for (int sb = 0; sb < 8; sb++) {               /* sub-block sb: nibble sb % 2 of */
            const int j = sb / 2, half = sb % 2;       /* units 8j.., x block 8B + sb */
            __m256i q[8];
            for (int u = 0; u < 8; u++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (8 * j + u)));
                q[u] = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low);
                if (q5) {                              /* bit sb of each byte -> bit 4 */
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * u));
                    const __m256i at4 = sb <= 4 ? _mm256_slli_epi16(h, 4 - sb)
                                                : _mm256_srli_epi16(h, sb - 4);
                    q[u] = _mm256_or_si256(q[u], _mm256_and_si256(at4, fifth));
                }
            }
            const int64_t b = 8 * B + sb;
            for (int i = 0; i < mr; i++) {
                const int8_t *x = xq + i * K + b * QK;
                __m256i s = _mm256_setzero_si256(), p = _mm256_setzero_si256();
                for (int u = 0; u < 8; u++) {
                    if (q5 && u == 4) {                /* 4 results of at most 7874: widen */
                        s = _mm256_madd_epi16(p, ones);
                        p = _mm256_setzero_si256();
                    }
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[u], bcast4(x + 4 * u)));
                }
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                acc[i] = scale_add(acc[i], s, ds[sb], dx[i * nb + b]);
                acc[i] = _mm256_fnmadd_ps(dm[sb], _mm256_set1_ps(sx[i * nb + b]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* Q6_K's quads 4 half .. 4 half + 3 of x block 4h + t (one code byte q - 32 per value, 8
 * rows a vector): sub-block 8h + 2t + half. */
INLINE QTARGET void q6_codes(const uint8_t *blk, int h, int t, int half, __m256i q[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    const __m256i off = _mm256_set1_epi8(32);
    for (int cq = 4 * half; cq < 4 * half + 4; cq++) {
        const __m256i L = _mm256_loadu_si256(
            (const __m256i *)(blk + 32 * (16 * h + 8 * (t % 2) + cq)));
        const __m256i V = _mm256_loadu_si256((const __m256i *)(blk + 1024 + 32 * (8 * h + cq)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(L, 4 * (t / 2)), low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(V, 2 * t), three);
        q[cq % 4] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
    }
}

/* d * the int8 scale of Q6_K sub-block sb (16 values), 8 rows. */
INLINE QTARGET __m256 q6_scale(const uint8_t *blk, __m256 d, int sb) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)(blk + 1536 + 32 * (sb / 4)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(
        _mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * (sb % 4)), 24)));
}

INLINE QTARGET void tile_q6_k(TILE_PARAMS) {
    (void)sx;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / 8; B++) {
        const uint8_t *blk = w + B * 1680;
        _mm_prefetch((const char *)(blk + 2 * 1680), _MM_HINT_T0);
        const __m256 d = f16x8(blk + 1664);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                const int64_t b = 8 * B + 4 * h + t;
                for (int half = 0; half < 2; half++) { /* sub-block 8h + 2t + half: quads */
                    __m256i q[4], a[4];                /* 4 half .. 4 half + 3 */
                    q6_codes(blk, h, t, half, q);
                    for (int c = 0; c < 4; c++) a[c] = _mm256_sign_epi8(q[c], q[c]);
                    const __m256 dsub = q6_scale(blk, d, 8 * h + 2 * t + half);
                    for (int i = 0; i < mr; i++) {
                        const int8_t *x = xq + i * K + b * QK + 16 * half;
                        __m256i p = _mm256_setzero_si256();
                        for (int c = 0; c < 4; c++)
                            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(
                                a[c], _mm256_sign_epi8(bcast4(x + 4 * c), q[c])));
                        acc[i] = scale_add(acc[i], _mm256_madd_epi16(p, ones), dsub,
                                             dx[i * nb + b]);
                    }
                }
            }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* ---- the same tiles on AVX-512 VNNI ---------------------------------------------------- */

/* x's 4-byte groups a (into lanes 0-7) and b (lanes 8-15) of a block's 32 bytes xb. */
INLINE VTARGET __m512i pair4(__m256i xb, int a, int b) {
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)),
                                           _mm256_set1_epi32(b), 1);
    return _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(xb));
}

/* The 8 rows' sums: lanes 0-7 plus lanes 8-15. */
INLINE VTARGET __m256i halves(__m512i s) {
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

INLINE VTARGET void tile_q4_vnni(const int with_m, const int q5, TILE_PARAMS) {
    const int64_t bsize = 16 + (with_m ? 16 : 0) + (q5 ? 32 : 0) + 128;
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    /* quads (0, 1) and (2, 3) of the low nibbles: values 0-7 and 8-15; of the high
     * nibbles: 16-23 and 24-31. Q5's fifth bits of quad c sit at bit c of each lane byte
     * of h (low nibbles) and at bit 4 + c (high): tile_q4's shifts to bit 4, per half. */
    const __m512i sl01 = _mm512_inserti64x4(_mm512_set1_epi32(4), _mm256_set1_epi32(3), 1);
    const __m512i sl23 = _mm512_inserti64x4(_mm512_set1_epi32(2), _mm256_set1_epi32(1), 1);
    const __m512i sr01 = _mm512_inserti64x4(_mm512_set1_epi32(0), _mm256_set1_epi32(1), 1);
    const __m512i sr23 = _mm512_inserti64x4(_mm512_set1_epi32(2), _mm256_set1_epi32(3), 1);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bsize;
        const uint8_t *qh = blk + (with_m ? 32 : 16), *qs = qh + (q5 ? 32 : 0);
        _mm_prefetch((const char *)(blk + 8 * bsize), _MM_HINT_T0);
        const __m256 d = f16x8(blk);
        const __m256 o = with_m ? f16x8(blk + 16)
                                : _mm256_mul_ps(d, _mm256_set1_ps(q5 ? -16.0f : -8.0f));
        const __m512i v01 = _mm512_loadu_si512(qs), v23 = _mm512_loadu_si512(qs + 64);
        __m512i lo01 = _mm512_and_si512(v01, low), lo23 = _mm512_and_si512(v23, low);
        __m512i hi01 = _mm512_and_si512(_mm512_srli_epi16(v01, 4), low);
        __m512i hi23 = _mm512_and_si512(_mm512_srli_epi16(v23, 4), low);
        if (q5) {
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
            lo01 = _mm512_or_si512(lo01, _mm512_and_si512(_mm512_sllv_epi32(h, sl01), fifth));
            lo23 = _mm512_or_si512(lo23, _mm512_and_si512(_mm512_sllv_epi32(h, sl23), fifth));
            hi01 = _mm512_or_si512(hi01, _mm512_and_si512(_mm512_srlv_epi32(h, sr01), fifth));
            hi23 = _mm512_or_si512(hi23, _mm512_and_si512(_mm512_srlv_epi32(h, sr23), fifth));
        }
        for (int i = 0; i < mr; i++) {
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo01, pair4(xb, 0, 1));
            s = _mm512_dpbusd_epi32(s, lo23, pair4(xb, 2, 3));
            s = _mm512_dpbusd_epi32(s, hi01, pair4(xb, 4, 5));
            s = _mm512_dpbusd_epi32(s, hi23, pair4(xb, 6, 7));
            acc[i] = scale_add(acc[i], halves(s), d, dx[i * nb + b]);
            acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(sx[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* |q| x (x negated where q < 0) into s: signed weights' products. */
INLINE VTARGET __m512i dot_signed(__m512i s, __m512i abs_q, __mmask64 neg, __m512i x) {
    return _mm512_dpbusd_epi32(s, abs_q, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}

INLINE VTARGET void tile_q8_0_vnni(TILE_PARAMS) {
    (void)sx;
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 272;
        const uint8_t *qs = blk + 16;
        for (int l = 0; l < 5; l++)
            _mm_prefetch((const char *)(blk + 4 * 272 + 64 * l), _MM_HINT_T0);
        const __m256 d = f16x8(blk);
        __m512i a[4];
        __mmask64 neg[4];
        for (int p = 0; p < 4; p++) {          /* quads 2p and 2p + 1 */
            const __m512i q = _mm512_loadu_si512(qs + 64 * p);
            a[p] = _mm512_abs_epi8(q);
            neg[p] = _mm512_movepi8_mask(q);
        }
        for (int i = 0; i < mr; i++) {
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
            __m512i s = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)
                s = dot_signed(s, a[p], neg[p], pair4(xb, 2 * p, 2 * p + 1));
            acc[i] = scale_add(acc[i], halves(s), d, dx[i * nb + b]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

INLINE VTARGET void tile_iq4_vnni(const int xs, TILE_PARAMS) {
    (void)sx;
    const int64_t bsize = xs ? 1088 : 144, subs = xs ? 8 : 1, per = xs ? 8 : 1;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(IQ4_KVALUES));
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / per; B++) {
        const uint8_t *blk = w + B * bsize, *qs = blk + (xs ? 64 : 16);
        _mm_prefetch((const char *)(blk + (xs ? 2 : 8) * bsize), _MM_HINT_T0);
        __m256 dl[8];
        iq4_scales(xs, blk, dl);
        for (int ib = 0; ib < subs; ib++) {
            __m512i a[4];                      /* lo01, lo23, hi01, hi23 as in tile_q4_vnni */
            __mmask64 neg[4];
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512(qs + 32 * (4 * ib + 2 * h));
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
                const __m512i hi = _mm512_shuffle_epi8(
                    table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                a[h] = _mm512_abs_epi8(lo), neg[h] = _mm512_movepi8_mask(lo);
                a[2 + h] = _mm512_abs_epi8(hi), neg[2 + h] = _mm512_movepi8_mask(hi);
            }
            const int64_t b = per * B + ib;
            for (int i = 0; i < mr; i++) {
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
                __m512i s = dot_signed(_mm512_setzero_si512(), a[0], neg[0], pair4(xb, 0, 1));
                s = dot_signed(s, a[1], neg[1], pair4(xb, 2, 3));
                s = dot_signed(s, a[2], neg[2], pair4(xb, 4, 5));
                s = dot_signed(s, a[3], neg[3], pair4(xb, 6, 7));
                acc[i] = scale_add(acc[i], halves(s), dl[ib], dx[i * nb + b]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

INLINE VTARGET void tile_k4_vnni(const int q5, TILE_PARAMS) {
    const int64_t bsize = q5 ? 1408 : 1152;
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / 8; B++) {
        const uint8_t *blk = w + B * bsize;
        const uint8_t *qh = blk + 128, *qs = blk + (q5 ? 384 : 128);
        _mm_prefetch((const char *)(blk + 2 * bsize), _MM_HINT_T0);
        __m256 ds[8], dm[8];
        k4_scales8(blk + 32, f16x8(blk), f16x8(blk + 16), ds, dm);
        for (int j = 0; j < 4; j++) {
            __m512i lo[4], hi[4];                      /* units (2p, 2p + 1) of 8j.. */
            for (int p = 0; p < 4; p++) {
                const __m512i v = _mm512_loadu_si512(qs + 32 * (8 * j + 2 * p));
                lo[p] = _mm512_and_si512(v, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (q5) {
                    const __m512i h = _mm512_loadu_si512(qh + 64 * p);
                    const __m512i h0 = 2 * j <= 4 ? _mm512_slli_epi16(h, 4 - 2 * j)
                                                  : _mm512_srli_epi16(h, 2 * j - 4);
                    const __m512i h1 = 2 * j + 1 <= 4 ? _mm512_slli_epi16(h, 3 - 2 * j)
                                                      : _mm512_srli_epi16(h, 2 * j - 3);
                    lo[p] = _mm512_or_si512(lo[p], _mm512_and_si512(h0, fifth));
                    hi[p] = _mm512_or_si512(hi[p], _mm512_and_si512(h1, fifth));
                }
            }
            const int64_t b0 = 8 * B + 2 * j;
            for (int i = 0; i < mr; i++) {
                const int8_t *x0 = xq + i * K + b0 * QK;
                const __m256i xa = _mm256_loadu_si256((const __m256i *)x0);
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(x0 + QK));
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++) {
                    s0 = _mm512_dpbusd_epi32(s0, lo[p], pair4(xa, 2 * p, 2 * p + 1));
                    s1 = _mm512_dpbusd_epi32(s1, hi[p], pair4(xb, 2 * p, 2 * p + 1));
                }
                const float *dxi = dx + i * nb, *sxi = sx + i * nb;
                acc[i] = scale_add(acc[i], halves(s0), ds[2 * j], dxi[b0]);
                acc[i] = _mm256_fnmadd_ps(dm[2 * j], _mm256_set1_ps(sxi[b0]), acc[i]);
                acc[i] = scale_add(acc[i], halves(s1), ds[2 * j + 1], dxi[b0 + 1]);
                acc[i] = _mm256_fnmadd_ps(dm[2 * j + 1], _mm256_set1_ps(sxi[b0 + 1]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

INLINE VTARGET void tile_q6_k_vnni(TILE_PARAMS) {
    (void)sx;
    const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    const __m512i off = _mm512_set1_epi8(32);
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t B = 0; B < nb / 8; B++) {
        const uint8_t *blk = w + B * 1680;
        _mm_prefetch((const char *)(blk + 2 * 1680), _MM_HINT_T0);
        const __m256 d = f16x8(blk + 1664);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                __m512i a[4];                          /* quads (2p, 2p + 1): q6_codes' */
                __mmask64 neg[4];
                for (int p = 0; p < 4; p++) {
                    const __m512i L = _mm512_loadu_si512(blk + 32 * (16 * h + 8 * (t % 2) + 2 * p));
                    const __m512i V = _mm512_loadu_si512(blk + 1024 + 32 * (8 * h + 2 * p));
                    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(L, 4 * (t / 2)), low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(V, 2 * t), three);
                    const __m512i q = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), off);
                    a[p] = _mm512_abs_epi8(q), neg[p] = _mm512_movepi8_mask(q);
                }
                const __m256 dA = q6_scale(blk, d, 8 * h + 2 * t);
                const __m256 dB = q6_scale(blk, d, 8 * h + 2 * t + 1);
                const int64_t b = 8 * B + 4 * h + t;
                for (int i = 0; i < mr; i++) {
                    const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
                    __m512i sA = dot_signed(_mm512_setzero_si512(), a[0], neg[0], pair4(xb, 0, 1));
                    sA = dot_signed(sA, a[1], neg[1], pair4(xb, 2, 3));
                    __m512i sB = dot_signed(_mm512_setzero_si512(), a[2], neg[2], pair4(xb, 4, 5));
                    sB = dot_signed(sB, a[3], neg[3], pair4(xb, 6, 7));
                    const float dxb = dx[i * nb + b];
                    acc[i] = scale_add(acc[i], halves(sA), dA, dxb);
                    acc[i] = scale_add(acc[i], halves(sB), dB, dxb);
                }
            }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* Every mr gets its own unrolled copy, so the accumulators stay in registers. */
#define TILE_SWITCH(call)                                                       \
    switch (mr) {                                                               \
        case 1: { const int mr_ = 1; call; break; }                             \
        case 2: { const int mr_ = 2; call; break; }                             \
        case 3: { const int mr_ = 3; call; break; }                             \
        default: { const int mr_ = 4; call; break; }                            \
    }

/* One tile's 8 outputs of each of its mr rows, by type, on each ISA (the same bits): S is
 * the tiles' suffix, empty for AVX2's, _vnni for AVX-512 VNNI's. */
typedef void TilesFn(int type, TILE_PARAMS);

#define TILE_ARGS mr_, w, nb, xq, K, dx, sx, out
#define TILES_BY_TYPE(S)                                                                \
    switch (type) {                                                                     \
        case GGML_Q8_0: TILE_SWITCH(tile_q8_0##S(TILE_ARGS)) break;                     \
        case GGML_Q4_1: TILE_SWITCH(tile_q4##S(1, 0, TILE_ARGS)) break;                 \
        case GGML_Q4_0: TILE_SWITCH(tile_q4##S(0, 0, TILE_ARGS)) break;                 \
        case GGML_IQ4_NL: TILE_SWITCH(tile_iq4##S(0, TILE_ARGS)) break;                 \
        case GGML_Q5_1: TILE_SWITCH(tile_q4##S(1, 1, TILE_ARGS)) break;                 \
        case GGML_Q5_0: TILE_SWITCH(tile_q4##S(0, 1, TILE_ARGS)) break;                 \
        case GGML_Q4_K: TILE_SWITCH(tile_k4##S(0, TILE_ARGS)) break;                    \
        case GGML_Q5_K: TILE_SWITCH(tile_k4##S(1, TILE_ARGS)) break;                    \
        case GGML_Q6_K: TILE_SWITCH(tile_q6_k##S(TILE_ARGS)) break;                     \
        default: TILE_SWITCH(tile_iq4##S(1, TILE_ARGS)) break;        /* IQ4_XS */      \
    }

static QTARGET void tiles_avx2(int type, TILE_PARAMS) { TILES_BY_TYPE() }

static VTARGET void tiles_vnni(int type, TILE_PARAMS) { TILES_BY_TYPE(_vnni) }

/* ---- driver --------------------------------------------------------------------------- */

static __thread int8_t *scratch;         /* the int8 copy of x: only grows */
static __thread size_t scratch_size;

/* Bytes of one group's block (8 rows), by ggml type; 0 for a type not served here. */
static int64_t group_block_bytes(int type) {
    switch (type) {
        case GGML_Q8_0: return 272;
        case GGML_Q4_0: case GGML_IQ4_NL: return 144;
        case GGML_Q4_1: return 160;
        case GGML_Q5_0: return 176;
        case GGML_Q5_1: return 192;
        case GGML_Q4_K: return 1152;
        case GGML_Q5_K: return 1408;
        case GGML_Q6_K: return 1680;
        case GGML_IQ4_XS: return 1088;
        default: return 0;
    }
}

/* x's blocks of 32 in one of the type's blocks. */
static int64_t x_blocks_per_block(int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K || type == GGML_IQ4_XS
               ? 8 : 1;
}

/* w: ceil(N / 8) groups as above; y's rows are ldy apart (a part of a wider output:
 * blocks.c, zs_linear_parts); vnni: the AVX-512 VNNI tiles, else AVX2's. Returns 0, or -1
 * if the scratch buffer could not be allocated or the type is not served (y is then
 * untouched). */
QTARGET int zs_linear_quant(int vnni, int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                            int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t nb = K / QK, groups = (N + 7) / 8, per = x_blocks_per_block(type);
    const int64_t group_bytes = nb / per * group_block_bytes(type);
    if (K % (QK * per)) return -1;
    const int64_t rows = M < MC ? M : MC;
    const size_t need = (size_t)rows * (size_t)(K + 8 * nb);   /* xq, then dx and sx */
    if (group_bytes == 0) return -1;
    if (need > scratch_size) {
        int8_t *grown = realloc(scratch, need);
        if (grown == NULL) return -1;
        scratch = grown, scratch_size = need;
    }
    int8_t *xq = scratch;
    float *dx = (float *)(scratch + rows * K), *sx = dx + rows * nb;
    TilesFn *const tiles = vnni ? tiles_vnni : tiles_avx2;
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mc; i++)
            quantize_row(x + (m0 + i) * K, nb, xq + i * K, dx + i * nb, sx + i * nb);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = w + g * group_bytes;
            const int64_t n0 = g * 8, nn = N - n0 < 8 ? N - n0 : 8;
            for (int64_t i0 = 0; i0 < mc; i0 += MR) {
                const int mr = (int)(mc - i0 < MR ? mc - i0 : MR);
                const int8_t *xt = xq + i0 * K;
                const float *dt = dx + i0 * nb, *st = sx + i0 * nb;
                float out[MR][8];
                tiles(type, mr, wg, nb, xt, K, dt, st, out);
                for (int i = 0; i < mr; i++) {
                    float *yi = y + (m0 + i0 + i) * ldy + n0;
                    for (int64_t j = 0; j < nn; j++) yi[j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
                }
            }
        }
    }
    return 0;
}
