/* Included before each kernel source for the emulated AVX-512 build (run.sh): SIMDe's
 * AVX-512 in plain C and AVX2 under the intrinsics' own names, and, where SIMDe's differ
 * from the hardware in what a test can see, our own:
 * - masked loads and stores touch only their lanes' memory (SIMDe's read and write the
 *   whole width: past a buffer's end, a heap corruption the hardware never makes);
 * - vcvtneps2bf16 flushes denormals to zero, as the hardware does;
 * - _mm512_reduce_add_ps adds in GCC's order (halves, then quarters, then pairs). */
#ifndef ZSERVE_EMULATED_AVX512_SHIM_H
#define ZSERVE_EMULATED_AVX512_SHIM_H
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include "simde/x86/avx512.h"
#include <stdint.h>
#include <string.h>

/* Lane i (of 16, `size` bytes each) of v to p + i * size where bit i of k is set. */
static inline void emu_mask_store(void *p, unsigned k, const void *v, int size) {
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy((char *)p + size * i, (const char *)v + size * i, size);
}

/* The same lanes from p into v (the others 0). */
static inline void emu_maskz_load(void *v, unsigned k, const void *p, int size) {
    memset(v, 0, 16 * size);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy((char *)v + size * i, (const char *)p + size * i, size);
}

static inline void emu_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) {
    emu_mask_store(p, k, &a, 4);
}

static inline void emu_mask_storeu_epi16(void *p, simde__mmask16 k, simde__m256i a) {
    emu_mask_store(p, k, &a, 2);
}

static inline simde__m512 emu_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    simde__m512 o;
    emu_maskz_load(&o, k, p, 4);
    return o;
}

static inline simde__m256i emu_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    simde__m256i o;
    emu_maskz_load(&o, k, p, 2);
    return o;
}

static inline uint16_t emu_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline __m256i emu_cvtneps_pbh(simde__m512 a) {
    float f[16];
    uint16_t r[16];
    memcpy(f, &a, 64);
    for (int i = 0; i < 16; i++) r[i] = emu_bf16(f[i]);
    __m256i o;
    memcpy(&o, r, 32);
    return o;
}

static inline simde__m512i emu_cvtepi8_epi32(simde__m128i a) {
    int8_t b[16];
    int32_t r[16];
    memcpy(b, &a, 16);
    for (int i = 0; i < 16; i++) r[i] = b[i];
    simde__m512i o;
    memcpy(&o, r, 64);
    return o;
}

static inline float emu_reduce_add_ps(simde__m512 a) {
    float f[16], t1[8], t2[4], t3[4];
    memcpy(f, &a, 64);
    for (int i = 0; i < 8; i++) t1[i] = f[i + 8] + f[i];
    for (int i = 0; i < 4; i++) t2[i] = t1[i + 4] + t1[i];
    for (int i = 0; i < 4; i++) t3[i] = t2[i] + t2[i ^ 2];
    return t3[0] + t3[1];
}

#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) emu_mask_storeu_ps(p, k, a)
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) emu_mask_storeu_epi16(p, k, a)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) emu_maskz_loadu_ps(k, p)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) emu_maskz_loadu_epi16(k, p)
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) emu_cvtneps_pbh(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) emu_cvtepi8_epi32(a)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) emu_reduce_add_ps(a)
#endif
