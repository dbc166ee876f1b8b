/* Shared helpers for zserve's CPU kernels. AVX-512: 16 float32 lanes at a time, loaded from
 * and stored to float32 or bfloat16 memory (at the end: the same for AVX2, 8 lanes). `bf16`
 * must be a compile-time constant where they are inlined, so each kernel gets one
 * branch-free copy per dtype; GCC outlines an OpenMP region before it inlines, so kernels
 * pick the dtype inside their parallel loops.
 * AVX-512's bfloat16 conversions flush values below ~1.2e-38 to zero (vcvtneps2bf16,
 * vdpbf16ps); AVX2's keep them, as torch does.
 */
#ifndef ZSERVE_SIMD_H
#define ZSERVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_F32 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

/* Scalar bfloat16 <-> float32, rounded as the vector versions (f32_to_bf16x8) and torch. */
INLINE float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* The first min(left, 16) lanes. */
INLINE __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

INLINE TARGET __m512 bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* Masked-off lanes read as 0 and are never touched in memory. */
INLINE TARGET __m512 load16(const int bf16, const void *p, __mmask16 m) {
    if (bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_maskz_loadu_ps(m, p);
}

/* bfloat16: rounded to nearest even. */
INLINE TARGET void store16(const int bf16, void *p, __mmask16 m, __m512 v) {
    if (bf16) _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_mask_storeu_ps(p, m, v);
}

/* v rounded to the dtype's precision (what storing and reloading it would give). */
INLINE TARGET __m512 round_bf(const int bf16, __m512 v) {
    return bf16 ? bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v)) : v;
}

/* e^x as 2^n * p(r), r = x - n ln2: relative error < 2e-7; like expf, it overflows to inf,
 * underflows to 0 (scalef saturates; the clamp only keeps r finite) and keeps NaN (x86
 * min/max return their second operand when either is NaN). */
/* The shared constants of exp_ps and exp8: log2(e), ln 2 split in a high part (exact in
 * float32) and the rest, and the polynomial for e^r - 1 - r over r^2 (highest power first). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

INLINE TARGET_F32 __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(1e4f), _mm512_max_ps(_mm512_set1_ps(-1e4f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ---- AVX2, 8 lanes: the kernels for CPUs without AVX-512 ---------------------------- */

#define TARGET_AVX2 __attribute__((target("avx2,fma")))

/* e^x with exp_ps's polynomial, 2^n built in the exponent bits; x clamped to [-87, 88]
 * (so e^x below ~1.6e-38 comes out as a small normal number, never 0, inf or a denormal:
 * softmax feeds it s - max <= 0, silu -x, where that is 0 at float32 precision). */
INLINE TARGET_AVX2 __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* IQ4_NL's and IQ4_XS's 16 values (gguf-py: IQ4_NL.kvalues), the one spelling of them:
 * blocks.c's scalar table, iq4_values below and quant.c's VNNI tile take them from here. */
#define IQ4_KVALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

/* Those values for every byte of `nibbles` (its low 4 bits; a byte with bit 7 set gives
 * 0): one vpshufb. blocks.c and quant.c. */
INLINE TARGET_AVX2 __m256i iq4_values(__m256i nibbles) {
    const __m256i table = _mm256_setr_epi8(IQ4_KVALUES, IQ4_KVALUES);
    return _mm256_shuffle_epi8(table, nibbles);
}

/* 8 rows' fp16 field (8 halves at p) as float32. blocks.c and quant.c. */
INLINE __attribute__((target("avx2,fma,f16c"))) __m256 f16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Q4_K's and Q5_K's 8 six-bit scales and mins (gguf-py: Q4_K.get_scale_min) of 8 rows at
 * once, times the rows' d and dmin: their 12 bytes regrouped as 3 units of 8 rows (u0, u1,
 * u2 = bytes 0-3, 4-7, 8-11 of each row, at `scales`, `scales` + 32, + 64). blocks.c and
 * quant.c. */
INLINE TARGET_AVX2 void k4_scales8(const uint8_t *scales, __m256 d, __m256 dmin,
                                   __m256 ds[8], __m256 dm[8]) {
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)scales);
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(scales + 32));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(scales + 64));
    const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
    const __m256i byte = _mm256_set1_epi32(255);
#define K4_BYTE(u, j) _mm256_and_si256(_mm256_srli_epi32(u, 8 * (j)), byte)
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
        __m256i sc, mn;
        if (j < 4) {
            sc = _mm256_and_si256(K4_BYTE(u0, j), six);
            mn = _mm256_and_si256(K4_BYTE(u1, j), six);
        } else {
            const __m256i b2 = K4_BYTE(u2, j - 4);
            sc = _mm256_or_si256(_mm256_and_si256(b2, four),
                                 _mm256_slli_epi32(_mm256_srli_epi32(K4_BYTE(u0, j - 4), 6), 4));
            mn = _mm256_or_si256(_mm256_srli_epi32(b2, 4),
                                 _mm256_slli_epi32(_mm256_srli_epi32(K4_BYTE(u1, j - 4), 6), 4));
        }
        ds[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        dm[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
    }
#undef K4_BYTE
}

INLINE TARGET_AVX2 float hsum8_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The first min(left, 8) lanes, as a mask vector for maskload / maskstore / and. */
INLINE TARGET_AVX2 __m256i tail8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE TARGET_AVX2 __m256 bf16x8_to_f32(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* float32 -> bfloat16 rounded to nearest even, as torch rounds (denormals kept); a NaN
 * stays NaN (quieted, sign and payload top kept, as vcvtneps2bf16 does). */
INLINE TARGET_AVX2 __m128i f32_to_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
        _mm256_set1_epi32(0x7FFF), odd)), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* The first min(left, 8) elements of float32 or bfloat16 memory at p; lanes past them read
 * as 0 and are never touched in memory. */
INLINE TARGET_AVX2 __m256 load8(const int bf16, const void *p, int64_t left) {
    if (!bf16) return left >= 8 ? _mm256_loadu_ps((const float *)p)
                                : _mm256_maskload_ps((const float *)p, tail8(left));
    if (left >= 8) return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)p));
    uint16_t t[8] = {0};
    for (int64_t k = 0; k < left; k++) t[k] = ((const uint16_t *)p)[k];
    return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)t));
}

INLINE TARGET_AVX2 void store8(const int bf16, void *p, int64_t left, __m256 v) {
    if (!bf16) {
        if (left >= 8) _mm256_storeu_ps((float *)p, v);
        else _mm256_maskstore_ps((float *)p, tail8(left), v);
        return;
    }
    __m128i b = f32_to_bf16x8(v);
    if (left >= 8) {
        _mm_storeu_si128((__m128i *)p, b);
        return;
    }
    uint16_t t[8];
    _mm_storeu_si128((__m128i *)t, b);
    for (int64_t k = 0; k < left; k++) ((uint16_t *)p)[k] = t[k];
}

/* v rounded to the dtype's precision (what storing and reloading it would give). */
INLINE TARGET_AVX2 __m256 round8(const int bf16, __m256 v) {
    return bf16 ? bf16x8_to_f32(f32_to_bf16x8(v)) : v;
}

#endif
