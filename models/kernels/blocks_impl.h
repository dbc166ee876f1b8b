/* The body of blocks.c, included once per ISA with BT (the target attribute) and SFX(name)
 * (the ISA's suffix) defined. Not a header of its own: no include guard, every name carries
 * SFX.
 */

INLINE BT float SFX(h)(const uint8_t *p) {     /* fp16 at p (little-endian) -> float */
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

/* ---- one block of one row -> float, as gguf-py's dequantize_blocks computes it ---------- *
 * Each `w = ...` line is numpy's expression for the type, in its order of operations (the
 * products and sums of two float32 values each rounded once: no fused multiply-add here,
 * -ffp-contract=off), so the values are bit for bit gguf.quants.dequantize's. */

INLINE BT void SFX(deq_q4_0)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((int)(qs[j] & 15) - 8);
        out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

INLINE BT void SFX(deq_q4_1)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b), m = SFX(h)(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(qs[j] & 15) + m;
        out[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

INLINE BT void SFX(deq_q5_0)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
    }
}

INLINE BT void SFX(deq_q5_1)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b), m = SFX(h)(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (float)lo + m;
        out[j + 16] = d * (float)hi + m;
    }
}

INLINE BT void SFX(deq_q8_0)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) out[j] = (float)q[j] * d;
}

INLINE BT void SFX(deq_iq4_nl)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)KVALUES[qs[j] & 15];
        out[j + 16] = d * (float)KVALUES[qs[j] >> 4];
    }
}

/* Q2_K, 84 bytes: scales[16] (low nibble: scale, high: min, per 16), qs[64], d, dmin.
 * Position h*128 + s*32 + l (h < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[32h + l]. */
INLINE BT void SFX(deq_q2_k)(const uint8_t *b, float *out) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = SFX(h)(b + 80), dmin = SFX(h)(b + 82);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            float *o = out + h * 128 + s * 32;
            const int sb = h * 8 + s * 2;      /* sub-blocks of 16: o[0..15], o[16..31] */
            const float dl0 = d * (float)(sc[sb] & 15), ml0 = dmin * (float)(sc[sb] >> 4);
            const float dl1 = d * (float)(sc[sb + 1] & 15), ml1 = dmin * (float)(sc[sb + 1] >> 4);
            for (int l = 0; l < 16; l++) {
                o[l] = dl0 * (float)((qs[32 * h + l] >> (2 * s)) & 3) - ml0;
                o[l + 16] = dl1 * (float)((qs[32 * h + l + 16] >> (2 * s)) & 3) - ml1;
            }
        }
}

/* Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (16 six-bit values, minus 32), d.
 * Position h*128 + s*32 + l: 2 bits at 2s of qs[32h + l], minus 4 unless bit (4h + s) of
 * hmask[l] is set; scale i: the nibble (i >> 3) * 4 of scales[i & 7], with bits 2(i >> 2)..
 * of scales[8 + (i & 3)] on top. */
INLINE BT void SFX(deq_q3_k)(const uint8_t *b, float *out) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = SFX(h)(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) {
        const int lo = (sc[i & 7] >> (4 * (i >> 3))) & 15;
        const int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        dl[i] = d * (float)((lo | hi << 4) - 32);
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            float *o = out + h * 128 + s * 32;
            const int bit = 4 * h + s, sb = h * 8 + s * 2;
            for (int l = 0; l < 32; l++) {
                const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
                o[l] = dl[sb + (l >> 4)] * (float)q;
            }
        }
}

/* The 8 six-bit scales and mins of Q4_K and Q5_K (gguf-py: Q4_K.get_scale_min). */
INLINE BT void SFX(scale_min_k4)(const uint8_t *s, float d, float dmin, float *ds, float *dm) {
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63, m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
            m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        }
        ds[j] = d * (float)sc, dm[j] = dmin * (float)m;
    }
}

/* Q4_K, 144 bytes: d, dmin, scales[12], qs[128]. Sub-block 2j + s (of 32) is nibble s of
 * qs[32j .. 32j + 31]; w = (d * sc) * q - dmin * m. */
INLINE BT void SFX(deq_q4_k)(const uint8_t *b, float *out) {
    float ds[8], dm[8];
    SFX(scale_min_k4)(b + 4, SFX(h)(b), SFX(h)(b + 2), ds, dm);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            out[64 * j + l] = ds[2 * j] * (float)(qs[32 * j + l] & 15) - dm[2 * j];
            out[64 * j + 32 + l] = ds[2 * j + 1] * (float)(qs[32 * j + l] >> 4) - dm[2 * j + 1];
        }
}

/* Q5_K, 176 bytes: d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles with bit i of
 * qh[l] as bit 4 of sub-block i's value l. */
INLINE BT void SFX(deq_q5_k)(const uint8_t *b, float *out) {
    float ds[8], dm[8];
    SFX(scale_min_k4)(b + 4, SFX(h)(b), SFX(h)(b + 2), ds, dm);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            const int lo = (qs[32 * j + l] & 15) | ((qh[l] >> (2 * j)) & 1) << 4;
            const int hi = (qs[32 * j + l] >> 4) | ((qh[l] >> (2 * j + 1)) & 1) << 4;
            out[64 * j + l] = ds[2 * j] * (float)lo - dm[2 * j];
            out[64 * j + 32 + l] = ds[2 * j + 1] * (float)hi - dm[2 * j + 1];
        }
}

/* Q6_K, 210 bytes: ql[128], qh[64], scales[16] (int8, per 16), d. Position
 * h*128 + s*64 + l (l < 64): nibble s of ql[64h + l]; bits 4..5: bits 2t of qh[32h + l']
 * for position h*128 + t*32 + l'; minus 32. */
INLINE BT void SFX(deq_q6_k)(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = SFX(h)(b + 208);
    float ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) {
                const int p = 32 * t + l;                        /* position in this half */
                const int lo = (ql[64 * h + (p & 63)] >> (4 * (p >> 6))) & 15;
                const int q = (lo | ((qh[32 * h + l] >> (2 * t)) & 3) << 4) - 32;
                out[128 * h + p] = ds[8 * h + (p >> 4)] * (float)q;
            }
}

/* IQ4_XS, 136 bytes: d, scales_h (uint16: 2 bits per 32), scales_l[4] (a nibble per 32),
 * qs[128] (sub-block i: nibble s of qs[16i + l] is value 16s + l), values from KVALUES. */
INLINE BT void SFX(deq_iq4_xs)(const uint8_t *b, float *out) {
    const float d = SFX(h)(b);
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int i = 0; i < 8; i++) {
        const int s = (((sl[i >> 1] >> (4 * (i & 1))) & 15) | ((sh >> (2 * i)) & 3) << 4) - 32;
        const float dl = d * (float)s;
        for (int l = 0; l < 16; l++) {
            out[32 * i + l] = dl * (float)KVALUES[qs[16 * i + l] & 15];
            out[32 * i + 16 + l] = dl * (float)KVALUES[qs[16 * i + l] >> 4];
        }
    }
}

INLINE BT void SFX(deq)(int type, const uint8_t *b, float *out) {
    switch (type) {
        case GGML_Q4_0: SFX(deq_q4_0)(b, out); break;
        case GGML_Q4_1: SFX(deq_q4_1)(b, out); break;
        case GGML_Q5_0: SFX(deq_q5_0)(b, out); break;
        case GGML_Q5_1: SFX(deq_q5_1)(b, out); break;
        case GGML_Q8_0: SFX(deq_q8_0)(b, out); break;
        case GGML_Q2_K: SFX(deq_q2_k)(b, out); break;
        case GGML_Q3_K: SFX(deq_q3_k)(b, out); break;
        case GGML_Q4_K: SFX(deq_q4_k)(b, out); break;
        case GGML_Q5_K: SFX(deq_q5_k)(b, out); break;
        case GGML_Q6_K: SFX(deq_q6_k)(b, out); break;
        case GGML_IQ4_NL: SFX(deq_iq4_nl)(b, out); break;
        default: SFX(deq_iq4_xs)(b, out); break;
    }
}

/* ---- 8 rows at once: quant.c's groups ------------------------------------------------ *
 * Every part is kept as groups of 8 output rows (models/quant_linear.py: regroup): a
 * group's blocks in order, each block's fields (blocks.c: FIELDS) one after another, a
 * field of B bytes as B / w units of w bytes (w = 2 for the fp16 scales, else 4), unit c
 * of rows 0..7 side by side. So 8 rows' fp16 scales load as one vector, and one 32-byte
 * load gives bytes 4c..4c+3 of a field for 8 rows, one row per int32 lane: each weight's
 * 8 rows come out in the 8 lanes, and one broadcast of x serves them. */

/* Row r's block, put back in GGUF's order. */
INLINE BT void SFX(ungroup)(int type, const uint8_t *gb, int r, uint8_t *blk) {
    const Fields *f = fields_of(type);
    for (int k = 0; k < f->n; k++) {
        const int off = f->off[k], size = f->size[k], w = size == 2 ? 2 : 4;
        for (int c = 0; c < size / w; c++) memcpy(blk + off + c * w, gb + 8 * off + c * 8 * w + r * w, (size_t)w);
    }
    if (type == GGML_Q5_0 || type == GGML_Q5_1) {       /* qh back in GGUF's bit order */
        const int at = type == GGML_Q5_0 ? 2 : 4;
        uint32_t held, qh = 0;
        memcpy(&held, blk + at, 4);
        for (int p = 0; p < 32; p++) qh |= ((held >> QH_BIT(p)) & 1u) << p;
        memcpy(blk + at, &qh, 4);
    }
}

INLINE BT __m256i SFX(nib)(__m256i v, int shift) {        /* 4 bits at `shift`, per lane */
    return _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(15));
}

/* acc[chain] += w * x[m][p] for the tile's mr rows of x, xt[p * mr + m] (the tile's x
 * transposed, from the block's start: one pointer, constant offsets). A row of x has 8 / mr chains of sums (by position), so that even at mr = 1
 * eight fused multiply-adds are in flight, not one chain waiting on each; group_tile adds
 * a row's chains at the end. */
#define FMA_ROWS(w, p, key)                                                             \
    do {                                                                                \
        const __m256 w_ = (w);                                                          \
        const int ch_ = 8 / mr, c_ = (key) % ch_;                                       \
        _Pragma("GCC unroll 8") for (int m_ = 0; m_ < mr; m_++)                         \
            acc[m_ * ch_ + c_] = _mm256_fmadd_ps(w_, _mm256_broadcast_ss(xt + (p) * mr + m_), \
                                                 acc[m_ * ch_ + c_]);                   \
    } while (0);

/* The fast paths: one block of 8 rows, each weight dequantized in lanes exactly as the
 * scalar deq_* above computes it (the same float operations in the same order). */
/* Q4_0, Q4_1, Q5_0, Q5_1: fields d (16 bytes), Q4_1/Q5_1's m (16), Q5's qh (one unit: a
 * row's uint32 per lane, its bits in QH_BIT's order), qs (4 units). Value p < 32: nibble
 * p / 16 of qs byte p % 16, and for Q5 bit QH_BIT(p) of qh as its bit 4. */
INLINE BT void SFX(block_q4)(const int type, const uint8_t *gb, const int mr,
                             const float *xt, __m256 *acc) {
    const int with_m = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int q5 = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m256 d = f16x8(gb);
    const __m256 m = with_m ? f16x8(gb + 16) : _mm256_setzero_ps();
    const uint8_t *qh = gb + (with_m ? 32 : 16), *qs = qh + (q5 ? 32 : 0);
    const __m256i h = q5 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(type == GGML_Q4_0 ? 8 : 16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)
            _Pragma("GCC unroll 2") for (int hi = 0; hi < 2; hi++) {
                const int p = 4 * c + t + 16 * hi;
                __m256i q = SFX(nib)(v, 8 * t + 4 * hi);
                if (q5)
                    q = _mm256_or_si256(q, _mm256_slli_epi32(
                        _mm256_and_si256(_mm256_srli_epi32(h, QH_BIT(p)), one), 4));
                __m256 w;
                if (with_m)
                    w = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
                else
                    w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias)));
                FMA_ROWS(w, p, t + 4 * hi)
            }
    }
}

INLINE BT void SFX(block_q8_0)(const uint8_t *gb, const int mr, const float *xt,
                               __m256 *acc) {
    const __m256 d = f16x8(gb);
    for (int c = 0; c < 8; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 16 + 32 * c));
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            const __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * t), 24);
            FMA_ROWS(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), 4 * c + t, t)
        }
    }
}

/* Q4_K and Q5_K: fields d, dmin (16 bytes each), scales (3 units) at 32; Q5_K's qh (8
 * units) at 128; qs (32 units) at 128 (Q4_K) or 384 (Q5_K). qs byte i = 4c + t is value
 * i % 32 of sub-blocks 2j (low nibble) and 2j + 1 (high), j = i / 32; Q5_K's bit 4 of
 * them: bits 2j and 2j + 1 of qh byte i % 32. */
INLINE BT void SFX(block_k4)(const int q5, const uint8_t *gb, const int mr,
                             const float *xt, __m256 *acc) {
    float d[8], dmin[8], ds[8][8], dm[8][8];
    _mm256_storeu_ps(d, f16x8(gb));
    _mm256_storeu_ps(dmin, f16x8(gb + 16));
    for (int r = 0; r < 8; r++) {
        uint8_t s[12];
        for (int c = 0; c < 3; c++) memcpy(s + 4 * c, gb + 32 + 32 * c + 4 * r, 4);
        float a[8], b[8];
        SFX(scale_min_k4)(s, d[r], dmin[r], a, b);
        for (int j = 0; j < 8; j++) ds[j][r] = a[j], dm[j][r] = b[j];
    }
    const uint8_t *qs = gb + (q5 ? 384 : 128), *qh = gb + 128;
    const __m256i one = _mm256_set1_epi32(1);
    for (int c = 0; c < 32; c++) {                   /* bytes 4c..4c+3 of qs */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        const __m256i h = q5 ? _mm256_loadu_si256((const __m256i *)(qh + 32 * (c % 8)))
                             : _mm256_setzero_si256();
        const int j = c / 8, l0 = 4 * (c % 8);
        const __m256 ds0 = _mm256_loadu_ps(ds[2 * j]), dm0 = _mm256_loadu_ps(dm[2 * j]);
        const __m256 ds1 = _mm256_loadu_ps(ds[2 * j + 1]), dm1 = _mm256_loadu_ps(dm[2 * j + 1]);
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            __m256i lo = SFX(nib)(v, 8 * t), hi = SFX(nib)(v, 8 * t + 4);
            if (q5) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi32(
                    _mm256_and_si256(_mm256_srli_epi32(h, 8 * t + 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi32(
                    _mm256_and_si256(_mm256_srli_epi32(h, 8 * t + 2 * j + 1), one), 4));
            }
            FMA_ROWS(_mm256_sub_ps(_mm256_mul_ps(ds0, _mm256_cvtepi32_ps(lo)), dm0), 64 * j + l0 + t, 2 * t)
            FMA_ROWS(_mm256_sub_ps(_mm256_mul_ps(ds1, _mm256_cvtepi32_ps(hi)), dm1), 64 * j + 32 + l0 + t, 2 * t + 1)
        }
    }
}

/* Q6_K: fields ql (32 units), qh (16 units) at 1024, scales (4 units) at 1536, d at 1664.
 * Position 128h + 32t + l (l < 32): nibble t / 2 of ql byte 64h + 32(t % 2) + l, bits 2t
 * of qh byte 32h + l. */
INLINE BT void SFX(block_q6_k)(const uint8_t *gb, const int mr, const float *xt,
                               __m256 *acc) {
    float d[8], ds[16][8];
    _mm256_storeu_ps(d, f16x8(gb + 1664));
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 4; t++)
                ds[4 * c + t][r] = d[r] * (float)(int8_t)gb[1536 + 32 * c + 4 * r + t];
    const __m256i three = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++)
        for (int cq = 0; cq < 8; cq++) {                /* qh bytes 32h + 4cq .. + 3 */
            const __m256i V = _mm256_loadu_si256((const __m256i *)(gb + 1024 + 32 * (8 * h + cq)));
            const __m256i L0 = _mm256_loadu_si256((const __m256i *)(gb + 32 * (16 * h + cq)));
            const __m256i L1 = _mm256_loadu_si256((const __m256i *)(gb + 32 * (16 * h + 8 + cq)));
            for (int t = 0; t < 4; t++) {
                const __m256 s = _mm256_loadu_ps(ds[8 * h + 2 * t + cq / 4]);
                const __m256i L = t % 2 ? L1 : L0;
                _Pragma("GCC unroll 4") for (int tt = 0; tt < 4; tt++) {
                    const __m256i lo = SFX(nib)(L, 8 * tt + 4 * (t / 2));
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(V, 8 * tt + 2 * t), three);
                    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), off);
                    FMA_ROWS(_mm256_mul_ps(s, _mm256_cvtepi32_ps(q)), 128 * h + 32 * t + 4 * cq + tt, tt + 4 * (t & 1))
                }
            }
        }
}

/* IQ4_NL and IQ4_XS: a nibble q stands for KVALUES[q] (a byte shuffle looks it up in
 * every lane). IQ4_NL: d (16 bytes), qs (4 units), Q4_0's positions. IQ4_XS: d, scales_h
 * (16 bytes: a row's uint16 each), scales_l (one unit), qs (32 units) at 64; sub-block i's
 * value 16s + l is nibble s of qs byte 16i + l. */
INLINE BT __m256i SFX(kvalue)(__m256i q) {
    /* the index in each lane's low byte; 0x80 zeroes the other three */
    const __m256i v = iq4_values(_mm256_or_si256(q, _mm256_set1_epi32((int)0x80808000u)));
    return _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);
}

INLINE BT void SFX(block_iq4_nl)(const uint8_t *gb, const int mr, const float *xt,
                                 __m256 *acc) {
    const __m256 d = f16x8(gb);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 16 + 32 * c));
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)
            _Pragma("GCC unroll 2") for (int hi = 0; hi < 2; hi++) {
                const __m256i k = SFX(kvalue)(SFX(nib)(v, 8 * t + 4 * hi));
                FMA_ROWS(_mm256_mul_ps(d, _mm256_cvtepi32_ps(k)), 4 * c + t + 16 * hi, t + 4 * hi)
            }
    }
}

INLINE BT void SFX(block_iq4_xs)(const uint8_t *gb, const int mr, const float *xt,
                                 __m256 *acc) {
    float d[8], dl[8][8];
    _mm256_storeu_ps(d, f16x8(gb));
    for (int r = 0; r < 8; r++) {
        uint16_t sh;
        memcpy(&sh, gb + 16 + 2 * r, 2);
        const uint8_t *sl = gb + 32 + 4 * r;
        for (int i = 0; i < 8; i++) {
            const int sc = (((sl[i >> 1] >> (4 * (i & 1))) & 15) | ((sh >> (2 * i)) & 3) << 4) - 32;
            dl[i][r] = d[r] * (float)sc;
        }
    }
    for (int c = 0; c < 32; c++) {                  /* qs bytes 4c..4c+3: sub-block c / 4 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 64 + 32 * c));
        const int i = c / 4, l0 = 4 * (c % 4);
        const __m256 s = _mm256_loadu_ps(dl[i]);
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)
            _Pragma("GCC unroll 2") for (int hi = 0; hi < 2; hi++) {
                const __m256i k = SFX(kvalue)(SFX(nib)(v, 8 * t + 4 * hi));
                FMA_ROWS(_mm256_mul_ps(s, _mm256_cvtepi32_ps(k)), 32 * i + 16 * hi + l0 + t, t + 4 * hi)
            }
    }
}

/* Q2_K and Q3_K: a group's block dequantized into tmp[256][8] (position p, row r), 8 rows
 * at a time in lanes, each value computed as deq_q2_k / deq_q3_k compute it (the same
 * float operations in the same order), then taken position by position (block_tmp).
 * Q2_K: scales (4 units) at 0, qs (16 units) at 128, d at 640, dmin at 656. Position
 * 128h + 32s + l: bits 2s of qs byte 32h + l (unit 8h + l / 4, lane byte l % 4);
 * sub-block 8h + 2s + l / 16: scales byte of that index (unit / 4, lane byte % 4). */
INLINE BT void SFX(deq8_q2_k)(const uint8_t *gb, float tmp[256][8]) {
    const __m256 d = f16x8(gb + 640), dmin = f16x8(gb + 656);
    const __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
    for (int sb = 0; sb < 16; sb++) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(gb + 32 * (sb / 4)));
        const __m256i sc = _mm256_srli_epi32(u, 8 * (sb % 4));
        const __m256 dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sc, fifteen)));
        const __m256 ml = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(
            _mm256_and_si256(_mm256_srli_epi32(sc, 4), fifteen)));
        const int h = sb / 8, s = (sb / 2) % 4, l0 = 16 * (sb % 2);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {        /* l = l0 + 4c + t */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 128 + 32 * (8 * h + l0 / 4 + c)));
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 2 * s), three);
                _mm256_storeu_ps(tmp[128 * h + 32 * s + l0 + 4 * c + t],
                                 _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(q)), ml));
            }
        }
    }
}

/* Q3_K: hmask (8 units) at 0, qs (16 units) at 256, scales (3 units) at 768, d at 864.
 * Position 128h + 32s + l: bits 2s of qs byte 32h + l, minus 4 unless bit 4h + s of hmask
 * byte l (unit l / 4, lane byte l % 4) is set; scale i (deq_q3_k's bits): the nibble
 * (i >> 3) * 4 of scales byte i & 7, with bits 2(i >> 2) of scales byte 8 + (i & 3) on top,
 * minus 32. */
INLINE BT void SFX(deq8_q3_k)(const uint8_t *gb, float tmp[256][8]) {
    const __m256 d = f16x8(gb + 864);
    const __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
    const __m256i one = _mm256_set1_epi32(1), four = _mm256_set1_epi32(4);
    const __m256i hi_u = _mm256_loadu_si256((const __m256i *)(gb + 768 + 64));
    for (int i = 0; i < 16; i++) {
        const __m256i lo_u = _mm256_loadu_si256((const __m256i *)(gb + 768 + 32 * ((i & 7) / 4)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(lo_u, 8 * ((i & 7) % 4) + 4 * (i >> 3)), fifteen);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(hi_u, 8 * (i & 3) + 2 * (i >> 2)), three);
        const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                            _mm256_set1_epi32(32));
        const __m256 dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        const int h = i / 8, s = (i / 2) % 4, l0 = 16 * (i % 2);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {        /* l = l0 + 4c + t */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 256 + 32 * (8 * h + l0 / 4 + c)));
            const __m256i m = _mm256_loadu_si256((const __m256i *)(gb + 32 * (l0 / 4 + c)));
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                const __m256i q2 = _mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 2 * s), three);
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi32(m, 8 * t + 4 * h + s), one);
                /* minus 4 where the bit is clear: q2 - 4 + 4 * bit */
                const __m256i q = _mm256_add_epi32(_mm256_sub_epi32(q2, four), _mm256_slli_epi32(hb, 2));
                _mm256_storeu_ps(tmp[128 * h + 32 * s + l0 + 4 * c + t],
                                 _mm256_mul_ps(dl, _mm256_cvtepi32_ps(q)));
            }
        }
    }
}

/* acc += tmp (a block's 8 rows, position by position) times the tile's mr rows of x. */
INLINE BT void SFX(block_tmp)(float tmp[256][8], const int qb, const int mr, const float *xt,
                              __m256 *acc) {
    for (int p = 0; p < qb; p += 8)
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) FMA_ROWS(_mm256_loadu_ps(tmp[p + i]), p + i, i)
}

/* Any type: each row's block dequantized (deq8_* for Q2_K and Q3_K, else the scalar code),
 * then taken position by position. */
INLINE BT void SFX(block_any)(int type, const uint8_t *gb, const int mr,
                              const float *xt, __m256 *acc) {
    float tmp[256][8];
    const int qb = (int)block_values(type);
    if (type == GGML_Q2_K) {
        SFX(deq8_q2_k)(gb, tmp);
    } else if (type == GGML_Q3_K) {
        SFX(deq8_q3_k)(gb, tmp);
    } else {
        float row[256];
        uint8_t blk[256];
        for (int r = 0; r < 8; r++) {
            SFX(ungroup)(type, gb, r, blk);
            SFX(deq)(type, blk, row);
            for (int p = 0; p < qb; p++) tmp[p][r] = row[p];
        }
    }
    SFX(block_tmp)(tmp, qb, mr, xt, acc);
}

/* ---- one row of x (batch-1 decode): each sub-block's scale applied to its sum --------- *
 * A sub-block of weights w = d * q + m (d, m its scale and offset: Q4_1's m, Q4_0's -8d,
 * Q4_K's -dmin * m, Q6_K's -32d, Q8_0's 0) gives x . w = d * sum(q * x) + m * sum(x): the
 * codes are converted to float and multiplied with x as they are, d multiplies the
 * sub-block's sum once, and sum(x) (the row's sums of 16, made once per call) takes the
 * offset. The same real number as the dequantized weights' product; each product and sum
 * rounded once (tests/test_blocks.py's bound), and per weight only the code's extraction,
 * its conversion and one fused multiply-add: on AVX2 about two thirds of the work of the
 * exact dequantization above, which the tiles of several rows (group_tile) amortize.
 *
 * A nibble at bit 4k of a lane is taken where it lies (q * 2^4k, one AND) and its chain of
 * sums scaled by 2^-4k at the sub-block's end (exact: a power of two); the top nibble by a
 * shift (q itself). Chains by position class keep eight fused multiply-adds in flight. */

/* x's value p in all 8 lanes: the row is given spread (blocks.c: x_tiles), so this is a
 * plain load, folded into the multiply-add (a broadcast costs a vector slot of its own). */
INLINE BT __m256 SFX(xv)(const float *x, int p) {
    return _mm256_loadu_ps(x + 8 * p);
}

INLINE BT __m256i SFX(shl)(__m256i v, int n) {         /* << n, or >> -n (logical) */
    return n >= 0 ? _mm256_slli_epi32(v, n) : _mm256_srli_epi32(v, -n);
}

/* Nibble k (bits 4k..4k+3) of each lane as q * 2^4k (k < 7) or q (k = 7). */
INLINE BT __m256i SFX(nib_at)(__m256i v, int k) {
    return k == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * k)));
}

INLINE BT float SFX(nib_scale)(int k) {                 /* undoes nib_at's 2^4k */
    return k == 7 ? 1.0f : 1.0f / (float)(1 << (4 * k));
}

/* s[0] * 2^0 + s[1] * 2^-4 + ... (nib_scale per chain k) */
INLINE BT __m256 SFX(scaled_sum)(const __m256 *s) {
    __m256 a = _mm256_fmadd_ps(s[2], _mm256_set1_ps(SFX(nib_scale)(2)), s[0]);
    __m256 b = _mm256_fmadd_ps(s[3], _mm256_set1_ps(SFX(nib_scale)(3)), s[7]);
    a = _mm256_fmadd_ps(s[4], _mm256_set1_ps(SFX(nib_scale)(4)), a);
    b = _mm256_fmadd_ps(s[1], _mm256_set1_ps(SFX(nib_scale)(1)), b);
    a = _mm256_fmadd_ps(s[6], _mm256_set1_ps(SFX(nib_scale)(6)), a);
    b = _mm256_fmadd_ps(s[5], _mm256_set1_ps(SFX(nib_scale)(5)), b);
    return _mm256_add_ps(a, b);
}

#define ZERO8(s) for (int i_ = 0; i_ < 8; i_++) s[i_] = _mm256_setzero_ps();

INLINE BT __m256 SFX(sum8)(const __m256 *s) {            /* the 8 chains, added in a tree */
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                         _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7])));
}

/* Lane byte t (a signed code) at bits 24..31: the code times 2^24, exact in float. */
INLINE BT __m256i SFX(byte_top)(__m256i v, int t) {
    const __m256i top = _mm256_set1_epi32((int)0xFF000000u);
    return t == 0 ? _mm256_slli_epi32(v, 24)
                  : _mm256_and_si256(t == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * t), top);
}

/* Q4_0, Q4_1, Q5_0, Q5_1 (block_q4's fields): value 4c + t is nibble 2t of qs unit c,
 * value 4c + t + 16 nibble 2t + 1. Q5: qh's bits in QH_BIT's order put unit c's eight
 * fifth bits at bits c (low nibbles) and 4 + c (high ones) of each lane byte, so two
 * shifts and masks set them beside their nibbles, a unit at a time: lane byte t then
 * holds value 4c + t's five bits (and, shifted down four, 4c + t + 16's), taken where
 * they lie (q * 2^8t) and scaled back per chain. xs: the row's sums of 16. */
INLINE BT __m256 SFX(row_q4)(const int type, const uint8_t *gb, const float *x,
                             const float *xs, __m256 acc) {
    const int with_m = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int q5 = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m256 d = f16x8(gb);
    const __m256 m = with_m ? f16x8(gb + 16)
                            : _mm256_mul_ps(d, _mm256_set1_ps(type == GGML_Q4_0 ? -8.0f : -16.0f));
    const uint8_t *qh = gb + (with_m ? 32 : 16), *qs = qh + (q5 ? 32 : 0);
    __m256 s[8];
    ZERO8(s)
    if (q5) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        const __m256i low = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low),
                                               _mm256_and_si256(_mm256_slli_epi32(h, 4 - c), fifth));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v, 4), low),
                                               _mm256_and_si256(_mm256_srli_epi32(h, c), fifth));
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                const __m256i five = _mm256_set1_epi32(31 << (8 * t));
                s[2 * t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, five)),
                                           SFX(xv)(x, 4 * c + t), s[2 * t]);
                s[2 * t + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, five)),
                                               SFX(xv)(x, 4 * c + t + 16), s[2 * t + 1]);
            }
        }
        __m256 sum = _mm256_add_ps(s[0], s[1]);         /* chains 2t, 2t + 1: 2^8t */
        _Pragma("GCC unroll 3") for (int t = 1; t < 4; t++)
            sum = _mm256_fmadd_ps(_mm256_add_ps(s[2 * t], s[2 * t + 1]),
                                  _mm256_set1_ps(1.0f / (float)(1 << (8 * t))), sum);
        acc = _mm256_fmadd_ps(d, sum, acc);
    } else {
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
                const int p = 4 * c + k / 2 + 16 * (k & 1);     /* the value nibble k holds */
                s[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(SFX(nib_at)(v, k)), SFX(xv)(x, p), s[k]);
            }
        }
        acc = _mm256_fmadd_ps(d, SFX(scaled_sum)(s), acc);
    }
    return _mm256_fmadd_ps(m, _mm256_set1_ps(xs[0] + xs[1]), acc);
}

/* Q8_0: byte t of a lane moved to the top (byte_top), d * 2^-24 after. */
INLINE BT __m256 SFX(row_q8_0)(const uint8_t *gb, const float *x, __m256 acc) {
    __m256 s[8];
    ZERO8(s)
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 16 + 32 * c));
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            const int k = t + 4 * (c & 1);
            s[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(SFX(byte_top)(v, t)),
                                   SFX(xv)(x, 4 * c + t), s[k]);
        }
    }
    return _mm256_fmadd_ps(_mm256_mul_ps(f16x8(gb), _mm256_set1_ps(0x1p-24f)),
                           SFX(sum8)(s), acc);
}

/* Q4_K and Q5_K (block_k4's fields): the 8 six-bit scales and mins of 8 rows (simd.h). */
INLINE BT void SFX(scales_k4_x8)(const uint8_t *gb, __m256 ds[8], __m256 dm[8]) {
    k4_scales8(gb + 32, f16x8(gb), f16x8(gb + 16), ds, dm);
}

/* Q4_K, Q5_K: qs byte 4c + t of part j (c < 8) is value 4c + t of sub-block 2j (nibble 2t
 * of the lane) and of 2j + 1 (nibble 2t + 1); Q5_K's bit 4 from bit 2j (+ 1) of qh's byte
 * 4c + t, put just above the nibble. */
INLINE BT __m256 SFX(row_k4)(const int q5, const uint8_t *gb, const float *x,
                             const float *xs, __m256 acc) {
    __m256 ds[8], dm[8];
    SFX(scales_k4_x8)(gb, ds, dm);
    const uint8_t *qs = gb + (q5 ? 384 : 128), *qh = gb + 128;
    _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
        __m256 s[8];
        ZERO8(s)
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (8 * j + c)));
            const __m256i h = q5 ? _mm256_loadu_si256((const __m256i *)(qh + 32 * c))
                                 : _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
                const int t = k / 2, hi = k & 1;
                __m256i q = SFX(nib_at)(v, k);
                if (q5) {
                    const int at = k == 7 ? 4 : 4 * k + 4, from = 8 * t + 2 * j + hi;
                    q = _mm256_or_si256(q, _mm256_and_si256(SFX(shl)(h, at - from),
                                                            _mm256_set1_epi32(1 << at)));
                }
                s[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q),
                                       SFX(xv)(x, 64 * j + 32 * hi + 4 * c + t), s[k]);
            }
        }
        /* the even chains are sub-block 2j, the odd ones 2j + 1 */
        __m256 lo = _mm256_fmadd_ps(s[2], _mm256_set1_ps(SFX(nib_scale)(2)), s[0]);
        lo = _mm256_fmadd_ps(s[4], _mm256_set1_ps(SFX(nib_scale)(4)), lo);
        lo = _mm256_fmadd_ps(s[6], _mm256_set1_ps(SFX(nib_scale)(6)), lo);
        __m256 hi = _mm256_fmadd_ps(s[1], _mm256_set1_ps(SFX(nib_scale)(1)), s[7]);
        hi = _mm256_fmadd_ps(s[3], _mm256_set1_ps(SFX(nib_scale)(3)), hi);
        hi = _mm256_fmadd_ps(s[5], _mm256_set1_ps(SFX(nib_scale)(5)), hi);
        acc = _mm256_fmadd_ps(ds[2 * j], lo, acc);
        acc = _mm256_fmadd_ps(ds[2 * j + 1], hi, acc);
        acc = _mm256_fnmadd_ps(dm[2 * j], _mm256_set1_ps(xs[4 * j] + xs[4 * j + 1]), acc);
        acc = _mm256_fnmadd_ps(dm[2 * j + 1], _mm256_set1_ps(xs[4 * j + 2] + xs[4 * j + 3]), acc);
    }
    return acc;
}

/* Q6_K (block_q6_k's fields): sub-block 8h + 2t + cq / 4 (16 values) has scale
 * d * scales[that]; its codes 0..63 (the -32 is the offset m = -32 * scale). The four
 * sub-blocks t = 0..3 of a quarter (h, cq / 4) share their loads and run side by side,
 * two chains each. */
INLINE BT __m256 SFX(row_q6_k)(const uint8_t *gb, const float *x, const float *xs,
                               __m256 acc) {
    const __m256 d = f16x8(gb + 1664);
    const __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
    _Pragma("GCC unroll 1") for (int h = 0; h < 2; h++)
        _Pragma("GCC unroll 1") for (int half = 0; half < 2; half++) {
            __m256 s[8];
            ZERO8(s)
            _Pragma("GCC unroll 4") for (int c4 = 0; c4 < 4; c4++) {
                const int cq = 4 * half + c4;
                const __m256i V = _mm256_loadu_si256((const __m256i *)(gb + 1024 + 32 * (8 * h + cq)));
                const __m256i L0 = _mm256_loadu_si256((const __m256i *)(gb + 32 * (16 * h + cq)));
                const __m256i L1 = _mm256_loadu_si256((const __m256i *)(gb + 32 * (16 * h + 8 + cq)));
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                    const __m256i L = t % 2 ? L1 : L0;
                    _Pragma("GCC unroll 4") for (int tt = 0; tt < 4; tt++) {
                        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(L, 8 * tt + 4 * (t / 2)), fifteen);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(V, 8 * tt + 2 * t), three);
                        const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
                        const int k = 2 * t + (tt & 1);
                        s[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q),
                                               SFX(xv)(x, 128 * h + 32 * t + 4 * cq + tt), s[k]);
                    }
                }
            }
            /* scales of sub-blocks 8h + 2t + half: scales unit (8h + 2t + half) / 4, byte % 4 */
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                const int sb = 8 * h + 2 * t + half;
                const __m256i u = _mm256_loadu_si256((const __m256i *)(gb + 1536 + 32 * (sb / 4)));
                const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * (sb % 4)), 24);
                const __m256 dsub = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                acc = _mm256_fmadd_ps(dsub, _mm256_add_ps(s[2 * t], s[2 * t + 1]), acc);
                acc = _mm256_fnmadd_ps(_mm256_mul_ps(dsub, _mm256_set1_ps(32.0f)),
                                       _mm256_set1_ps(xs[sb]), acc);
            }
        }
    return acc;
}

/* IQ4_NL and IQ4_XS: one byte shuffle looks up the 16 values of a unit's four low (or
 * high) nibbles at once, as signed bytes (simd.h: iq4_values); each byte is then moved to
 * the top of its lane (byte_top, Q8_0's way) and the 2^-24 joins the scale. 32 values from
 * four units: value 4c + t is the low nibble of lane byte t of unit c, 4c + t + 16 the
 * high one. */

/* sum over 32 values of KVALUES[q] * x, times 2^24 (four units at qs, x spread) */
INLINE BT __m256 SFX(iq4_sum32)(const uint8_t *qs, const float *x) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256 s[8];
    ZERO8(s)
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        const __m256i lo = iq4_values(_mm256_and_si256(v, low));
        const __m256i hi = iq4_values(_mm256_and_si256(_mm256_srli_epi32(v, 4), low));
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            s[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(SFX(byte_top)(lo, t)),
                                   SFX(xv)(x, 4 * c + t), s[t]);
            s[4 + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(SFX(byte_top)(hi, t)),
                                       SFX(xv)(x, 4 * c + t + 16), s[4 + t]);
        }
    }
    return SFX(sum8)(s);
}

/* IQ4_NL (block_iq4_nl's fields): d, then qs's four units. */
INLINE BT __m256 SFX(row_iq4_nl)(const uint8_t *gb, const float *x, __m256 acc) {
    const __m256 d = _mm256_mul_ps(f16x8(gb), _mm256_set1_ps(0x1p-24f));
    return _mm256_fmadd_ps(d, SFX(iq4_sum32)(gb + 16, x), acc);
}

/* IQ4_XS (block_iq4_xs's fields): sub-block i's scale d * (six bits - 32): the nibble
 * i % 2 of scales_l byte i / 2 (lane byte of the unit at 32), bits 2i of the row's
 * scales_h (a uint16 per row at 16); its 32 values in qs units 4i..4i+3. */
INLINE BT __m256 SFX(row_iq4_xs)(const uint8_t *gb, const float *x, __m256 acc) {
    const __m256 d = _mm256_mul_ps(f16x8(gb), _mm256_set1_ps(0x1p-24f));
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gb + 16)));
    const __m256i sl = _mm256_loadu_si256((const __m256i *)(gb + 32));
    _Pragma("GCC unroll 1") for (int i = 0; i < 8; i++) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 8 * (i / 2) + 4 * (i % 2)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sh, 2 * i), _mm256_set1_epi32(3));
        const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                            _mm256_set1_epi32(32));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)),
                              SFX(iq4_sum32)(gb + 64 + 128 * i, x + 8 * 32 * i), acc);
    }
    return acc;
}

/* Does row_of serve this type? */
static inline int SFX(has_row)(int type) {
    switch (type) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0:
        case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: case GGML_IQ4_NL:
        case GGML_IQ4_XS: return 1;
        default: return 0;
    }
}

/* One group of 8 output rows against one row of x (has_row types): out[r] = x . W[n0 + r].
 * x: the row spread (each value 8 times), xs: its sums of 16. */
INLINE BT void SFX(group_row)(int type, const uint8_t *g, int64_t nb, int64_t bs, int64_t qb,
                              const float *x, const float *xs, float out[8]) {
    __m256 acc = _mm256_setzero_ps();
#define ROW_LOOP(call)                                                                  \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        const uint8_t *gb = g + b * 8 * bs;                                             \
        const float *xb = x + 8 * b * qb, *sb = xs + b * qb / 16;                       \
        (void)sb;                                                                       \
        _mm_prefetch((const char *)(gb + 8 * bs), _MM_HINT_T0);                         \
        acc = call;                                                                     \
    }                                                                                   \
    break;
    switch (type) {     /* outside the loop over blocks: each type's loop its own */
        case GGML_Q4_0: ROW_LOOP(SFX(row_q4)(GGML_Q4_0, gb, xb, sb, acc))
        case GGML_Q4_1: ROW_LOOP(SFX(row_q4)(GGML_Q4_1, gb, xb, sb, acc))
        case GGML_Q5_0: ROW_LOOP(SFX(row_q4)(GGML_Q5_0, gb, xb, sb, acc))
        case GGML_Q5_1: ROW_LOOP(SFX(row_q4)(GGML_Q5_1, gb, xb, sb, acc))
        case GGML_Q8_0: ROW_LOOP(SFX(row_q8_0)(gb, xb, acc))
        case GGML_Q4_K: ROW_LOOP(SFX(row_k4)(0, gb, xb, sb, acc))
        case GGML_Q5_K: ROW_LOOP(SFX(row_k4)(1, gb, xb, sb, acc))
        case GGML_Q6_K: ROW_LOOP(SFX(row_q6_k)(gb, xb, sb, acc))
        case GGML_IQ4_NL: ROW_LOOP(SFX(row_iq4_nl)(gb, xb, acc))
        default: ROW_LOOP(SFX(row_iq4_xs)(gb, xb, acc))
    }
#undef ROW_LOOP
    _mm256_storeu_ps(out, acc);
}

/* One group of 8 output rows against mr (<= 8, a constant where inlined) rows of x:
 * out[m][r] = x[m] . W[n0 + r]. */
INLINE BT void SFX(group_tile)(int type, const uint8_t *g, int64_t nb, int64_t bs, int64_t qb,
                               const float *x, const int mr, float out[8][8]) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b * 8 * bs;
        const float *xt = x + b * qb * mr;
        _mm_prefetch((const char *)(gb + 8 * bs), _MM_HINT_T0);
        switch (type) {
            case GGML_Q4_0: SFX(block_q4)(GGML_Q4_0, gb, mr, xt, acc); break;
            case GGML_Q4_1: SFX(block_q4)(GGML_Q4_1, gb, mr, xt, acc); break;
            case GGML_Q5_0: SFX(block_q4)(GGML_Q5_0, gb, mr, xt, acc); break;
            case GGML_Q5_1: SFX(block_q4)(GGML_Q5_1, gb, mr, xt, acc); break;
            case GGML_Q8_0: SFX(block_q8_0)(gb, mr, xt, acc); break;
            case GGML_Q4_K: SFX(block_k4)(0, gb, mr, xt, acc); break;
            case GGML_Q5_K: SFX(block_k4)(1, gb, mr, xt, acc); break;
            case GGML_Q6_K: SFX(block_q6_k)(gb, mr, xt, acc); break;
            case GGML_IQ4_NL: SFX(block_iq4_nl)(gb, mr, xt, acc); break;
            case GGML_IQ4_XS: SFX(block_iq4_xs)(gb, mr, xt, acc); break;
            default: SFX(block_any)(type, gb, mr, xt, acc); break;
        }
    }
    const int ch = 8 / mr;
    for (int m = 0; m < mr; m++) {
        __m256 sum = acc[m * ch];
        for (int c = 1; c < ch; c++) sum = _mm256_add_ps(sum, acc[m * ch + c]);
        _mm256_storeu_ps(out[m], sum);
    }
}

/* y[m * ldy + n] = x[m] . W[n] (+ bias[n]) for m < M, n < N, with x given as its tiles
 * (and, where the last row is a tile of its own, that row spread and its sums of 16:
 * blocks.c, x_tiles) and W's N rows as `type` blocks in groups of 8 (above). Threads
 * split the groups; each takes the tiles of x in turn, every weight dequantized once per
 * tile in registers; a tile of one row takes group_row where the type has it. */
static BT void SFX(linear_tiles)(int type, const float *xt, const float *sums,
                                  const float *spread, int64_t M, int64_t K,
                                  const uint8_t *w, int64_t N, const float *bias, float *y,
                                  int64_t ldy) {
    const int64_t qb = block_values(type), bs = block_bytes(type), nb = K / qb;
    const int64_t groups = (N + 7) / 8;
    const int row = SFX(has_row)(type);
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < groups; gi++) {
        const uint8_t *g = w + gi * nb * 8 * bs;
        const int64_t n0 = gi * 8, nn = N - n0 < 8 ? N - n0 : 8;
        for (int64_t m0 = 0; m0 < M;) {
            const int mr = tile_rows(M - m0);
            float out[8][8];
            const float *tile = xt + m0 * K;
            if (mr == 8) SFX(group_tile)(type, g, nb, bs, qb, tile, 8, out);
            else if (mr == 4) SFX(group_tile)(type, g, nb, bs, qb, tile, 4, out);
            else if (mr == 2) SFX(group_tile)(type, g, nb, bs, qb, tile, 2, out);
            else if (row) SFX(group_row)(type, g, nb, bs, qb, spread, sums, out[0]);
            else SFX(group_tile)(type, g, nb, bs, qb, tile, 1, out);
            for (int m = 0; m < mr; m++) {
                float *ym = y + (m0 + m) * ldy + n0;
                for (int64_t r = 0; r < nn; r++) ym[r] = bias ? out[m][r] + bias[n0 + r] : out[m][r];
            }
            m0 += mr;
        }
    }
}

/* The same on x float32 [M, K] itself (rows K apart). Returns 0, or -1 if the type is not
 * served or there is no memory for x's tiles. */
BT int SFX(zs_linear_blocks)(int type, const float *x, int64_t M, int64_t K,
                             const uint8_t *w, int64_t N, const float *bias, float *y,
                             int64_t ldy) {
    if (block_bytes(type) == 0 || K % block_values(type)) return -1;
    const float *sums, *spread;
    const float *xt = x_tiles(x, M, K, &sums, &spread);
    if (xt == NULL) return -1;
    SFX(linear_tiles)(type, xt, sums, spread, M, K, w, N, bias, y, ldy);
    return 0;
}

/* out[i] = W[ids[i]] as float32 (K values), i < n: an embedding's row lookup on its
 * groups. Returns 0, or -1 if an id is outside [0, N) (nothing written) or the type is
 * not served. */
BT int SFX(zs_dequant_rows)(int type, const uint8_t *w, int64_t N, int64_t K,
                            const int64_t *ids, int64_t n, float *out) {
    if (block_bytes(type) == 0 || K % block_values(type)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int64_t qb = block_values(type), bs = block_bytes(type), nb = K / qb;
#pragma omp parallel for schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids[i];
        const uint8_t *g = w + (row / 8) * nb * 8 * bs;
        uint8_t blk[256];
        for (int64_t b = 0; b < nb; b++) {
            SFX(ungroup)(type, g + b * 8 * bs, (int)(row % 8), blk);
            SFX(deq)(type, blk, out + i * K + b * qb);
        }
    }
    return 0;
}
