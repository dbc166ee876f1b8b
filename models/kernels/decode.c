/* zserve decode step driver: every decoder layer of a step whose rows are all decode rows,
 * in one call, for float32 and bfloat16 models whose layers all run on zserve's kernels.
 *
 * The same kernels, in the same order, on the same buffers as the model's Python path
 * (models/llama.py through ops.py, attention.py and the linear modules), so the results
 * are bit for bit the same; what goes away is Python between them: ~300 calls a token,
 * each with its tensor allocations and ctypes conversions, which cost as much as the
 * kernels themselves at batch 1 (README "Performance").
 *
 * Per layer, for M rows (x: the previous layer's output, r: the residual stream):
 *   y = norm(x + r) (r = x + r; the first layer: y = norm(x), r = x)
 *   qkv = y Wqkv^T (+ b); RoPE on q and k in place; K/V into their slots
 *   o = attention(q, the row's cached K/V) Wo^T (+ b)
 *   y = norm(o + r) (r = o + r); x = silu_mul(y Wgu^T (+ b)) Wdown^T (+ b)
 * and at the end x = x + r (the hidden state compute_logits normalizes). Buffers hold the
 * model dtype; each kernel rounds where the module path's does.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* The kernels of the other files (compiled into the same library). */
void zs_linear_f32(const float *x, int64_t M, int64_t K, const float *p, int64_t N,
                   const float *bias, float *y);
void zs_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *p, int64_t N,
                    const uint16_t *bias, uint16_t *y);
void zs_linear_avx2(int bf16, const void *x, int64_t M, int64_t K, const void *p, int64_t N,
                    const void *bias, void *y);
int zs_lora_f32(int avx512, const float *x, int64_t K, float *y, int64_t N,
                const int64_t *runs, int64_t nruns, const int64_t *table);
struct ZsBlocks;                        /* blocks.c: a layer in GGUF's blocks */
int zs_linear_parts(const struct ZsBlocks *L, const float *x, int64_t M, int64_t K,
                    const float *bias, float *y);
void zs_add_rms_norm(int bf16, const void *x, const void *r, void *h, const void *w,
                     float eps, int64_t M, int64_t D, void *y);
void zs_add_rms_norm_avx2(int bf16, const void *x, const void *r, void *h, const void *w,
                          float eps, int64_t M, int64_t D, void *y);
void zs_rope(int bf16, void *x, int64_t M, int64_t stride, int64_t heads, int64_t D,
             const void *cos_sin, const int64_t *pos);
void zs_rope_avx2(int bf16, void *x, int64_t M, int64_t stride, int64_t heads, int64_t D,
                  const void *cos_sin, const int64_t *pos);
void zs_silu_mul(int bf16, const void *gu, int64_t M, int64_t I, void *y);
void zs_silu_mul_avx2(int bf16, const void *gu, int64_t M, int64_t I, void *y);
void zs_kv_write(int bf16, int kvk, void *kv, float *scales, const int64_t *slots, int64_t N,
                 const void *k, const void *v, int64_t stride, int64_t HkvD);
void zs_decode_attention(int bf16, int kvk, const void *q, int64_t q_stride, const void *kv,
                         const float *scales, const int64_t *table, int64_t ctx,
                         const int64_t *rows, const int64_t *lens, int64_t B, int64_t H,
                         int64_t Hkv, int64_t D, float scale, void *out);
void zs_decode_attention_avx2(int bf16, int kvk, const void *q, int64_t q_stride,
                              const void *kv, const float *scales, const int64_t *table,
                              int64_t ctx, const int64_t *rows, const int64_t *lens, int64_t B,
                              int64_t H, int64_t Hkv, int64_t D, float scale, void *out);

/* A linear layer: kind 1 blocks (`weight` is blocks.c's ZsBlocks: float32 models only),
 * 0 panels on AVX2, -1 panels on AVX-512 (linear.c), in the model's dtype. */
typedef struct {
    int64_t kind;
    const void *weight;
    const void *bias;           /* or NULL; the model dtype */
    const int64_t *lora;        /* its LoRA adapters' table (linear.c: zs_lora_f32), or NULL */
} ZsLinear;

typedef struct {
    const void *input_norm, *post_norm;
    ZsLinear qkv, o, gate_up, down;
    void *kv;                   /* this layer's KV pool */
    float *kv_scales;           /* and its int8 scales (kv_kind 2), else NULL */
} ZsLayer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int64_t avx512;             /* the AVX-512 norm / RoPE / SiLU / attention, else AVX2 */
    int64_t bf16;               /* the dtype of weights and activations: else float32 */
    int64_t kv_kind;            /* the KV pool's: attention.c's KV_F32, KV_BF16 or KV_I8 */
    const void *cos_sin;
    const ZsLayer *layer;
    const int64_t *lora_runs;   /* this step's runs of rows per adapter (float32 only) */
    int64_t lora_nruns;
} ZsModel;

static int linear(const ZsModel *m, const ZsLinear *l, const void *x, int64_t M, int64_t K,
                  int64_t N, void *y) {
    if (l->kind > 0) {                  /* float32 activations only (fast_decode.py) */
        if (m->bf16 || zs_linear_parts(l->weight, x, M, K, l->bias, y)) return -1;
    } else if (l->kind == 0) zs_linear_avx2((int)m->bf16, x, M, K, l->weight, N, l->bias, y);
    else if (m->bf16) zs_linear_bf16(x, M, K, l->weight, N, l->bias, y);
    else zs_linear_f32(x, M, K, l->weight, N, l->bias, y);
    if (l->lora && m->lora_nruns)        /* the adapters' products, as LoraLinear adds them */
        return zs_lora_f32((int)m->avx512, x, K, y, N, m->lora_runs, m->lora_nruns, l->lora);
    return 0;
}

/* y = norm(x + r), r = x + r; or, r NULL, y = norm(x). */
static void norm(const ZsModel *m, const void *x, void *r, const void *w, int64_t M,
                 void *y) {
    if (m->avx512) zs_add_rms_norm((int)m->bf16, x, r, r, w, m->eps, M, m->hidden, y);
    else zs_add_rms_norm_avx2((int)m->bf16, x, r, r, w, m->eps, M, m->hidden, y);
}

/* x [M, hidden]: the embeddings in, the hidden state out; r [M, hidden]: scratch for the
 * residual stream; the other buffers are scratch of the sizes named. table, ctx, rows,
 * lens, slots: attention.py's decode rows. Returns 0, or -1 (out of memory in quant.c or
 * for the LoRA products' scratch; the step is then lost). */
int zs_decode_layers(const ZsModel *m, int64_t M, void *x, void *r, const int64_t *pos,
                     const int64_t *table, int64_t ctx, const int64_t *rows,
                     const int64_t *lens, const int64_t *slots,
                     void *y /* [M, hidden] */, void *qkv /* [M, (H + 2 Hkv) D] */,
                     void *att /* [M, H D] */, void *gu /* [M, 2 inter] */,
                     void *act /* [M, inter] */) {
    const int64_t H = m->heads, Hkv = m->kv_heads, D = m->head_dim, hid = m->hidden;
    const int64_t qw = (H + 2 * Hkv) * D, esz = m->bf16 ? 2 : 4, bf16 = m->bf16;
    char *const k = (char *)qkv + H * D * esz, *const v = k + Hkv * D * esz;
    for (int64_t l = 0; l < m->layers; l++) {
        const ZsLayer *L = &m->layer[l];
        if (l == 0) {                                       /* r = x; y = norm(x) */
            memcpy(r, x, (size_t)(M * hid * esz));
            norm(m, x, NULL, L->input_norm, M, y);
        } else {
            norm(m, x, r, L->input_norm, M, y);
        }
        if (linear(m, &L->qkv, y, M, hid, qw, qkv)) return -1;
        if (m->avx512) zs_rope((int)bf16, qkv, M, qw, H + Hkv, D, m->cos_sin, pos);
        else zs_rope_avx2((int)bf16, qkv, M, qw, H + Hkv, D, m->cos_sin, pos);
        const int kvk = (int)m->kv_kind;
        zs_kv_write((int)bf16, kvk, L->kv, L->kv_scales, slots, M, k, v, qw, Hkv * D);
        if (m->avx512)
            zs_decode_attention((int)bf16, kvk, qkv, qw, L->kv, L->kv_scales, table, ctx, rows,
                                lens, M, H, Hkv, D, m->scale, att);
        else
            zs_decode_attention_avx2((int)bf16, kvk, qkv, qw, L->kv, L->kv_scales, table, ctx,
                                     rows, lens, M, H, Hkv, D, m->scale, att);
        if (linear(m, &L->o, att, M, H * D, hid, x)) return -1;
        norm(m, x, r, L->post_norm, M, y);
        if (linear(m, &L->gate_up, y, M, hid, 2 * m->inter, gu)) return -1;
        if (m->avx512) zs_silu_mul((int)bf16, gu, M, m->inter, act);
        else zs_silu_mul_avx2((int)bf16, gu, M, m->inter, act);
        if (linear(m, &L->down, act, M, m->inter, hid, x)) return -1;
    }
    if (bf16)                                           /* x + r, rounded as torch's add */
        for (int64_t i = 0; i < M * hid; i++)
            ((uint16_t *)x)[i] = f32_to_bf16(bf16_to_f32(((uint16_t *)x)[i]) +
                                             bf16_to_f32(((uint16_t *)r)[i]));
    else
        for (int64_t i = 0; i < M * hid; i++) ((float *)x)[i] += ((float *)r)[i];
    return 0;
}
