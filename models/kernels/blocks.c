/* zserve's block-quantized linear layers with float activations: y[M, N] = x[M, K] W[N, K]^T
 * (+ bias), x and y float32, W in any of GGUF's block types that zserve serves:
 *   blocks of 32:  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL
 *   blocks of 256: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
 * in groups of 8 output rows (models/quant_linear.py: regroup; blocks_impl.h says the
 * layout; for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL it is quant.c's, so one copy serves
 * both kernels).
 *
 * x is multiplied as it is: no rounding of the activations, so a layer's output is the
 * dequantized layer's up to float32 rounding. Two forms of the arithmetic:
 * - tiles of 2 to 8 rows of x (group_tile): each block dequantized in registers, bit for
 *   bit as gguf-py's dequantize_blocks computes it (the same float operations in the same
 *   order), one weight's 8 rows in the 8 lanes of one vector, one broadcast of x per row;
 * - one row of x alone (group_row: batch-1 decode, and the odd row of an odd M), for
 *   every type but Q2_K and Q3_K: each sub-block's x . w as d * sum(q x) + m * sum(x),
 *   the codes converted where they lie in the lane (IQ4's looked up four at a time by a
 *   byte shuffle): per 8 weights about one AND, one conversion and one fused multiply-add
 *   with x's value spread in a vector. The same real number as the dequantized product
 *   with other roundings (tests/test_blocks.py has the bound); about half the work a
 *   weight.
 * Q2_K and Q3_K have the tiles' form only: each block dequantized 8 rows at a time into a
 * buffer, then multiplied.
 *
 * Loop order: threads split the groups; each takes the rows of x in tiles of 8 (then 4,
 * 2, 1), transposed once per call so that a tile's x values for a position are adjacent.
 * At M = 1 each weight is read from memory once, with 8 chains of sums in flight.
 *
 * Two builds of the same code (blocks_impl.h, included twice): AVX2 + FMA + F16C and
 * AVX-512 F/BW/VL (the same 8-lane algorithm in AVX-512's encodings: no 16-lane or VNNI
 * version yet), chosen by kernels.available, the rule every kernel follows (QuantLinear
 * writes the choice into the layer's ZsBlocks).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum {                                   /* gguf.GGMLQuantizationType */
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
    GGML_IQ4_NL = 20, GGML_IQ4_XS = 23,
};

/* IQ4_NL's and IQ4_XS's 16 values (simd.h). */
static const int8_t KVALUES[16] = {IQ4_KVALUES};

/* Bytes of one block, by ggml type; 0 for a type not served here. */
static inline int64_t block_bytes(int type) {
    switch (type) {
        case GGML_Q4_0: case GGML_IQ4_NL: return 18;
        case GGML_Q4_1: return 20;
        case GGML_Q5_0: return 22;
        case GGML_Q5_1: return 24;
        case GGML_Q8_0: return 34;
        case GGML_Q2_K: return 84;
        case GGML_Q3_K: return 110;
        case GGML_Q4_K: return 144;
        case GGML_Q5_K: return 176;
        case GGML_Q6_K: return 210;
        case GGML_IQ4_XS: return 136;
        default: return 0;
    }
}

static inline int64_t block_values(int type) {
    return type >= GGML_Q2_K && type != GGML_IQ4_NL ? 256 : 32;
}

/* Each type's block as fields (byte offset, size), in GGUF's order: what regroup
 * (models/quant_linear.py) interleaves 8 rows at a time, field by field. */
typedef struct {
    int n;
    int off[5], size[5];
} Fields;

static const Fields F_Q4_0 = {2, {0, 2}, {2, 16}};
static const Fields F_Q4_1 = {3, {0, 2, 4}, {2, 2, 16}};
static const Fields F_Q5_0 = {3, {0, 2, 6}, {2, 4, 16}};
static const Fields F_Q5_1 = {4, {0, 2, 4, 8}, {2, 2, 4, 16}};
static const Fields F_Q8_0 = {2, {0, 2}, {2, 32}};
static const Fields F_Q2_K = {4, {0, 16, 80, 82}, {16, 64, 2, 2}};
static const Fields F_Q3_K = {4, {0, 32, 96, 108}, {32, 64, 12, 2}};
static const Fields F_Q4_K = {4, {0, 2, 4, 16}, {2, 2, 12, 128}};
static const Fields F_Q5_K = {5, {0, 2, 4, 16, 48}, {2, 2, 12, 32, 128}};
static const Fields F_Q6_K = {4, {0, 128, 192, 208}, {128, 64, 16, 2}};
static const Fields F_IQ4_XS = {4, {0, 2, 4, 8}, {2, 2, 4, 128}};

static inline const Fields *fields_of(int type) {
    switch (type) {
        case GGML_Q4_0: case GGML_IQ4_NL: return &F_Q4_0;
        case GGML_Q4_1: return &F_Q4_1;
        case GGML_Q5_0: return &F_Q5_0;
        case GGML_Q5_1: return &F_Q5_1;
        case GGML_Q8_0: return &F_Q8_0;
        case GGML_Q2_K: return &F_Q2_K;
        case GGML_Q3_K: return &F_Q3_K;
        case GGML_Q4_K: return &F_Q4_K;
        case GGML_Q5_K: return &F_Q5_K;
        case GGML_Q6_K: return &F_Q6_K;
        default: return &F_IQ4_XS;
    }
}

/* Where bit p of a Q5_0 / Q5_1 block's qh (the fifth bit of value p) is kept: bit 8t + c
 * for value 4c + t, 8t + 4 + c for value 4c + t + 16 (c, t < 4), so that lane byte t of
 * a row's qh holds the fifth bits of the values in lane byte t of its qs units
 * (blocks_impl.h: row_q4). models/quant_linear.py: regroup orders them so; ungroup puts
 * them back. */
#define QH_BIT(p) (8 * ((p) % 4) + ((p) % 16) / 4 + 4 * ((p) / 16))

/* Rows of x taken together: 8, then 4, 2, 1 for what is left. */
static inline int tile_rows(int64_t left) {
    return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

static __thread float *tiles;               /* x_tiles' buffer: only grows */
static __thread size_t tiles_size;

/* x [M, K] as its tiles of tile_rows rows, each transposed to [K][rows] (so that a tile's
 * values for one position are adjacent: blocks_impl.h's FMA_ROWS reads them so); and where
 * the last tile is one row (M odd: tile_rows leaves at most one such tile, the last), that
 * row's operands for the row kernels (group_row): *spread, the row with each value 8 times
 * ([K][8]), and *sums, its sums of 16 values ([K / 16]); both NULL for an even M. In a
 * per-thread buffer; the tiles are x itself when M = 1 (a tile of one row is the row).
 * NULL: no memory. K is a multiple of 32 (every block type's). */
static const float *x_tiles(const float *x, int64_t M, int64_t K, const float **sums,
                            const float **spread) {
    const int64_t nrow = M % 2 ? 8 * K + K / 16 : 0;
    const size_t need = (size_t)(M * K + nrow) * sizeof(float);
    if (need > tiles_size) {
        float *grown = realloc(tiles, need);
        if (grown == NULL) return NULL;
        tiles = grown, tiles_size = need;
    }
    *spread = *sums = NULL;
    if (nrow) {
        const float *last = x + (M - 1) * K;
        float *sp = tiles + M * K, *s = sp + 8 * K;
        for (int64_t k = 0; k < K; k++)
            for (int l = 0; l < 8; l++) sp[8 * k + l] = last[k];
        for (int64_t i = 0; i < K / 16; i++) {
            float acc = 0.0f;
            for (int j = 0; j < 16; j++) acc += last[16 * i + j];
            s[i] = acc;
        }
        *spread = sp, *sums = s;
    }
    if (M <= 1) return x;
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t mr = tile_rows(M - m0);
        for (int64_t k = 0; k < K; k++)
            for (int64_t m = 0; m < mr; m++) tiles[m0 * K + k * mr + m] = x[(m0 + m) * K + k];
        m0 += mr;
    }
    return tiles;
}

/* AVX2 + FMA + F16C */
#define BT __attribute__((target("avx2,fma,f16c")))
#define SFX(name) name##_avx2
#include "blocks_impl.h"
#undef BT
#undef SFX

/* The same code built for AVX-512 F/BW/VL (EVEX encodings, the 8-lane algorithm: no 16-lane
 * or VNNI version yet) */
#define BT __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define SFX(name) name##_avx512
#include "blocks_impl.h"
#undef BT
#undef SFX

/* ---- a linear layer of one or more parts --------------------------------------------- */

int zs_linear_quant(int vnni, int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                    int64_t N, const float *bias, float *y, int64_t ldy);

/* A layer's output rows in parts, each of one block type in groups of 8 rows (a fused
 * layer whose GGUF tensors differ in type, e.g. Q4_K_M's q/k in Q4_K and v in Q6_K, keeps
 * each in its own): part p gives outputs [the earlier parts' rows, + rows).
 * models/quant_linear.py fills it (QuantLinear.c_blocks) and decode.c calls through it, so
 * both take the same kernel in the same step, by one rule: parts with `int8` set (quant.c's
 * types, quant_linear.INT8_TYPES, whose groups are quant.c's layout too) take quant.c's
 * int8 kernel where the batch is at least int8_batch (its AVX-512 VNNI tiles where `vnni`
 * says: kernels.vnni_available); every other part and batch takes blocks.c's float
 * kernel, AVX-512 or AVX2 as `avx512` says (kernels.available: the rule's one home). The
 * batch is the model step's number of requests (step_batch, set around each step by the
 * scheduler's runner: quant_linear.step_batch), so a request alone is computed the same
 * float way whatever its prompt's length; outside a step (direct calls), M rows of x. */
static int64_t step_batch;                 /* 0: no step set; the model runs on one thread */

void zs_set_step_batch(int64_t requests) { step_batch = requests; }

#define ZS_MAX_PARTS 3
typedef struct {
    int64_t type, int8, rows;
    const uint8_t *weight;
} ZsPart;

typedef struct ZsBlocks {
    int64_t nparts, avx512, int8_batch, vnni;
    ZsPart part[ZS_MAX_PARTS];
} ZsBlocks;

/* y[M, N] = x[M, K] W^T (+ bias), N the parts' rows in all. Returns 0, or -1 (out of
 * memory, or a part the kernels do not serve). */
int zs_linear_parts(const ZsBlocks *L, const float *x, int64_t M, int64_t K,
                    const float *bias, float *y) {
    int64_t N = 0, off = 0;
    for (int64_t p = 0; p < L->nparts; p++) N += L->part[p].rows;
    const float *xs = NULL, *sums, *spread;  /* x_tiles, made once for every float part */
    for (int64_t p = 0; p < L->nparts; p++) {
        const ZsPart *q = &L->part[p];
        const float *b = bias ? bias + off : NULL;
        if (q->int8 && (step_batch > 0 ? step_batch : M) >= L->int8_batch) {
            if (zs_linear_quant((int)L->vnni, (int)q->type, x, M, K, q->weight, q->rows, b, y + off, N))
                return -1;
        } else {
            if (block_bytes((int)q->type) == 0 || K % block_values((int)q->type)) return -1;
            if (xs == NULL && (xs = x_tiles(x, M, K, &sums, &spread)) == NULL) return -1;
            (L->avx512 ? linear_tiles_avx512 : linear_tiles_avx2)(
                (int)q->type, xs, sums, spread, M, K, q->weight, q->rows, b, y + off, N);
        }
        off += q->rows;
    }
    return 0;
}
