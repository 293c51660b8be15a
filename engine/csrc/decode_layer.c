/* One decoder layer of a decode step in one call, for models whose linears run packed (quant.c: GGUF's
 * quantized blocks, or dense bfloat16 through bf16_linear.c).
 *
 *   pdkv_decode_layer   the same kernels, in the same order, with the same roundings as the layer's
 *                       per-op path (engine/model/llama.py's DecoderLayer.forward with every native
 *                       kernel): the residual add and RMSNorm, the fused q/k/v linear, RoPE with the K/V
 *                       write, decode attention over the paged cache, the output linear, the second add
 *                       and norm, the gate/up linear, SiLU-mul and the down linear -- so its results are
 *                       the per-op path's bits, without ~10 Python calls and their tensors per layer.
 *
 * A batch-1 decode step of SmolLM2-135M reads its 96 MB of quantized weights in ~4 ms; the per-op path
 * spent as much again in Python dispatch.  engine/model/fused_decode.py builds the structs once.
 *
 * Returns 0, or the first failing kernel's code (quant.c's and paged_decode.c's meanings).
 */

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

int pdkv_qlinear(const void *x, int64_t in_bf16, int64_t rows, int64_t k, const void *packed, int64_t fmt,
                 int64_t n_out, void *out, int64_t ldo, int64_t out_bf16);
int pdkv_rms_norm(const void *x, const void *delta, void *h_out, const void *weight, void *out, int64_t rows,
                  int64_t hidden, float eps, int64_t bf16);
int pdkv_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16);
int pdkv_rope_write_kv(const void *qkv, const void *cos, const void *sin, void *qk, void *cache,
                       const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t rows, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t num_layers, int64_t layer,
                       int64_t block_size, int64_t bf16, int64_t num_blocks, int64_t kv_order);
void pdkv_side_stream(const char *const *base, int64_t n, int64_t bytes);
int pdkv_lora_bf16(const void *x_, void *y_, const int64_t *slot, const void *a_, const void *b_,
                   int64_t rows, int64_t in, int64_t out, int64_t parts, const int64_t *part_start,
                   int64_t rank, int64_t num_slots);
int pdkv_paged_prefill_many(const void *q, int64_t q_stride, const void *cache, void *out,
                            const int64_t *block_table, int64_t table_width, const int64_t *starts,
                            const int64_t *counts, int64_t num_chunks, int64_t num_layers, int64_t layer,
                            int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t window, float scale, int64_t num_blocks, int64_t kv_order);
int pdkv_paged_decode(const void *q, const void *cache, void *out, const int64_t *block_table,
                      const int64_t *positions, int64_t num_seqs, int64_t table_width, int64_t num_layers,
                      int64_t layer, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t window, float scale, int64_t bf16, int64_t q_stride,
                      int64_t num_blocks);

/* One linear's LoRA slots (engine/lora/layers.py's native layouts, csrc/lora.c). */
struct pdkv_lora_mod {
    const void *a, *b;
    const int64_t *part_start;
    int64_t parts, rank, num_slots;
};

/* A packed linear: up to PDKV_MAX_PARTS runs of output rows, each one format (a GGUF file may hold q/k
 * and v, or gate and up, in different types: a Q4_K_M file's v in Q6_K), each part's outputs the next
 * columns of the output, as QuantLinear.forward writes them. */
#define PDKV_MAX_PARTS 3
struct pdkv_linear {
    int64_t parts;
    const void *w[PDKV_MAX_PARTS]; /* packed (quant.c's layouts) */
    int64_t fmt[PDKV_MAX_PARTS];   /* their quant.c formats */
    int64_t rows[PDKV_MAX_PARTS];  /* their output rows */
};

/* Per layer, fixed at load (engine/model/fused_decode.py mirrors these structs with ctypes). */
struct pdkv_layer {
    const void *norm1, *norm2;                /* RMSNorm weights [hidden] */
    struct pdkv_linear qkv, o, gu, d;         /* packed linears */
    int64_t layer, window;                    /* window 0: none */
    float eps, scale;
    const struct pdkv_lora_mod *lora;         /* [4]: q/k/v, o, gate/up, down; NULL without LoRA */
};

/* The model's shapes. */
struct pdkv_shape {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_layers, block_size, bf16;
    int64_t kv_order; /* the cache's order inside a block (simd.h): KV_PAIRED in deterministic mode */
};

/* Per step.  Attention: with chunks == 0 every row is a decode (block_table [T, W], positions [T]:
 * pdkv_paged_decode); else the rows are `chunks` chunks (block_table [C, W], positions = their starts
 * [C], counts [C]: pdkv_paged_prefill_many, deterministic mode's kernel for every row). */
struct pdkv_step {
    int64_t rows, table_width, num_blocks;
    const void *cos, *sin;                    /* [T, 1, D/2] */
    void *kv_cache;
    const int64_t *slot_blocks, *slot_offsets; /* [T] */
    const int64_t *block_table, *positions;
    const int64_t *counts;
    int64_t chunks;
    void *scratch;                            /* pdkv_decode_scratch_bytes(shape, rows) bytes */
    const int64_t *lora_rows;                 /* [T] each row's adapter slot (-1: none); NULL: none */
    const int64_t *lora_on;                   /* [layers * 4]: whether a module has a delta this step */
};

/* The LoRA delta of module m of layer L added to y where this step has one (LoRALinear.forward's
 * native path: after the base linear, before anything reads y). */
static int add_lora(const struct pdkv_layer *L, const struct pdkv_step *st, int m, const void *x, void *y,
                    int64_t in, int64_t out) {
    if (st->lora_rows == NULL || L->lora == NULL || !st->lora_on[L->layer * 4 + m]) return 0;
    const struct pdkv_lora_mod *mod = &L->lora[m];
    return pdkv_lora_bf16(x, y, st->lora_rows, mod->a, mod->b, st->rows, in, out, mod->parts, mod->part_start,
                          mod->rank, mod->num_slots);
}

int64_t pdkv_decode_scratch_bytes(const struct pdkv_shape *s, int64_t rows) {
    const int64_t es = s->bf16 ? 2 : 4;
    const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t per_row = s->hidden * 3 + qkv + (s->heads + s->kv_heads) * s->head_dim +
                            s->heads * s->head_dim + 3 * s->inter;
    return rows * per_row * es + 64;
}

/* The next layer's KV under this layer's batch linears.  A decode batch's attention reads every row's
 * keys and values of the layer from blocks scattered over the cache (3.5 MB a layer for SmolLM2 at 32 rows
 * of ~140 tokens), waiting on memory, while the batch linears around it are compute-bound and leave the
 * memory idle.  So the o, gate/up and down linears of layer l prefetch layer l + 1's (block, layer) slabs
 * -- keys then values, contiguous -- into L2 and L3 (bf16_linear.c's side stream), shares in proportion
 * to their work, at most SIDE_MAX_BYTES a layer (rows in order; the rest is read as before).  Batch-32
 * step of the built-in model, 128-token prompts (AMD EPYC Zen 5, instrumented layers): attention 3.1-3.3
 * -> 2.0-2.1 ms a step, RoPE's K/V writes 0.40 -> 0.27 ms, the three linears +0.2-0.3 ms.
 * A batch-1 step streams too, under its quantized linears (quant.c: a few lines after each run of groups;
 * bf16_linear.c's batch-1 calls take none): its one row's KV is a few hundred KB a layer, but the weights
 * streamed since the layer's last step have pushed it out of every cache, and its attention waited on it
 * line by line.  An AMD EPYC Zen 4, the Q4_1 model's batch-1 step with its weights evicted, in-process
 * A/B with the stream switched between rounds (16 rounds, medians): 128-token prompt attention 0.385 ->
 * 0.326 ms a step, the step 4.40 -> 4.29 ms; 512 tokens 0.972 -> 0.684 and 5.59 -> 5.47 ms (the
 * linears give back part: they share the memory). */
#define SIDE_MAX_BYTES ((int64_t)8 << 20)

static _Thread_local const char **side_slabs;
static _Thread_local int64_t side_cap;

/* The last position row (or chunk) c of the step sees. */
static inline int64_t last_position(const struct pdkv_step *st, int64_t c) {
    return st->positions[c] + (st->chunks > 0 ? st->counts[c] : 1) - 1;
}

/* Layer `layer`'s slabs of the step's rows (their visible blocks) into side_slabs; returns how many (0
 * where the list cannot be had: no stream then). */
static int64_t layer_slabs(const struct pdkv_shape *s, const struct pdkv_step *st, int64_t layer,
                           int64_t bytes) {
    const int64_t bs = s->block_size, seqs = st->chunks > 0 ? st->chunks : st->rows;
    int64_t need = 0;
    for (int64_t c = 0; c < seqs && need * bytes < SIDE_MAX_BYTES; c++)
        need += last_position(st, c) / bs + 1;
    if (need > side_cap) {
        free(side_slabs);
        side_slabs = (const char **)malloc(sizeof(char *) * (size_t)need);
        side_cap = side_slabs == NULL ? 0 : need;
        if (side_slabs == NULL) return 0;
    }
    int64_t m = 0;
    for (int64_t c = 0; c < seqs && m < need; c++) {
        for (int64_t k = 0; k <= last_position(st, c) / bs && m < need; k++) {
            const int64_t block = st->block_table[c * st->table_width + k];
            /* an address to prefetch only (never loaded): made as an integer, whatever the table holds */
            const int64_t offset = ((block * s->num_layers + layer) * 2) * (bytes / 2);
            side_slabs[m++] = (const char *)((uintptr_t)st->kv_cache + (uintptr_t)offset);
        }
    }
    return m;
}

/* out [rows, n] = x [rows, k] through the linear's parts, part i into the columns after part i - 1's. */
static int run_linear(const struct pdkv_linear *lin, const void *x, int64_t bf, int64_t rows, int64_t k,
                      int64_t n, void *out) {
    int64_t col = 0;
    for (int64_t i = 0; i < lin->parts; i++) {
        const int rc = pdkv_qlinear(x, bf, rows, k, lin->w[i], lin->fmt[i], lin->rows[i],
                                    (char *)out + col * (bf ? 2 : 4), n, bf);
        if (rc) return rc;
        col += lin->rows[i];
    }
    return col == n ? 0 : 2;
}

/* Linear `which` of a layer (0 o, 1 gate/up, 2 down) with its share of the next layer's slabs. */
static int linear_with_side(int which, int64_t slabs, int64_t bytes, const void *x, int64_t bf, int64_t rows,
                            int64_t k, const struct pdkv_linear *lin, int64_t n, void *out) {
    static const int64_t upto[4] = {0, 12, 69, 100}; /* percent of the stream before each: work ~1 : 5 : 3 */
    const int64_t from = slabs * upto[which] / 100, to = slabs * upto[which + 1] / 100;
    pdkv_side_stream(slabs ? side_slabs + from : NULL, to - from, bytes);
    const int rc = run_linear(lin, x, bf, rows, k, n, out);
    pdkv_side_stream(NULL, 0, 0);
    return rc;
}

/* h_out = h + delta + attention (the residual after this layer's attention; h + delta is the input's
 * residual, h itself when delta is NULL), delta_out = this layer's MLP output: DecoderLayer.forward's
 * (h, delta) contract. */
int pdkv_decode_layer(const struct pdkv_layer *L, const struct pdkv_shape *s, const struct pdkv_step *st,
                      const void *h, const void *delta, void *h_out, void *delta_out) {
    const int64_t t = st->rows, es = s->bf16 ? 2 : 4, bf = s->bf16;
    const int64_t hd = s->head_dim, nq = s->heads * hd, nkv = s->kv_heads * hd, nqkv = nq + 2 * nkv;
    char *p = (char *)st->scratch;
    void *x = p;                 p += t * s->hidden * es;
    void *h1 = p;                p += t * s->hidden * es;
    void *o = p;                 p += t * s->hidden * es;
    void *qkv = p;               p += t * nqkv * es;
    void *qk = p;                p += t * (nq + nkv) * es;
    void *attn = p;              p += t * nq * es;
    void *gu = p;                p += t * 2 * s->inter * es;
    void *act = p;
    int rc;
    if (delta == NULL) {
        h1 = (void *)h;
        rc = pdkv_rms_norm(h, NULL, NULL, L->norm1, x, t, s->hidden, L->eps, bf);
    } else {
        rc = pdkv_rms_norm(h, delta, h1, L->norm1, x, t, s->hidden, L->eps, bf);
    }
    if (rc) return rc;
    if ((rc = run_linear(&L->qkv, x, bf, t, s->hidden, nqkv, qkv))) return rc;
    if ((rc = add_lora(L, st, 0, x, qkv, s->hidden, nqkv))) return rc;
    rc = pdkv_rope_write_kv(qkv, st->cos, st->sin, qk, st->kv_cache, st->slot_blocks, st->slot_offsets, t,
                            s->heads, s->kv_heads, hd, s->num_layers, L->layer, s->block_size, bf, st->num_blocks,
                            s->kv_order);
    if (rc) return rc;
    if (st->chunks > 0)
        rc = pdkv_paged_prefill_many(qk, nq + nkv, st->kv_cache, attn, st->block_table, st->table_width,
                                     st->positions, st->counts, st->chunks, s->num_layers, L->layer,
                                     s->block_size, s->heads, s->kv_heads, hd, L->window, L->scale,
                                     st->num_blocks, s->kv_order);
    else if (s->kv_order != 0)
        rc = 2; /* the decode kernel reads the canonical order only */
    else
        rc = pdkv_paged_decode(qk, st->kv_cache, attn, st->block_table, st->positions, t, st->table_width,
                               s->num_layers, L->layer, s->block_size, s->heads, s->kv_heads, hd, L->window,
                               L->scale, bf, nq + nkv, st->num_blocks);
    if (rc) return rc;
    /* the next layer's KV blocks under this one's linears (the next attention would wait on them) */
    const int64_t slab_bytes = 2 * s->block_size * s->kv_heads * hd * es;
    const int64_t slabs =
        L->layer + 1 < s->num_layers ? layer_slabs(s, st, L->layer + 1, slab_bytes) : 0;
    if ((rc = linear_with_side(0, slabs, slab_bytes, attn, bf, t, nq, &L->o, s->hidden, o))) return rc;
    if ((rc = add_lora(L, st, 1, attn, o, nq, s->hidden))) return rc;
    if ((rc = pdkv_rms_norm(h1, o, h_out, L->norm2, x, t, s->hidden, L->eps, bf))) return rc;
    if ((rc = linear_with_side(1, slabs, slab_bytes, x, bf, t, s->hidden, &L->gu, 2 * s->inter, gu)))
        return rc;
    if ((rc = add_lora(L, st, 2, x, gu, s->hidden, 2 * s->inter))) return rc;
    if ((rc = pdkv_silu_mul(gu, act, t, s->inter, bf))) return rc;
    rc = linear_with_side(2, slabs, slab_bytes, act, bf, t, s->inter, &L->d, s->hidden, delta_out);
    if (rc) return rc;
    return add_lora(L, st, 3, act, delta_out, s->inter, s->hidden);
}
