/* Prefill attention read from the paged KV cache (engine/native.py builds and loads this file with
 * paged_decode.c):
 *
 *   pdkv_paged_prefill_many   prefill chunks' causal attention (chunks of many sequences, and decode
 *                             rows as chunks of one, in one call), bfloat16, AVX512-BF16 (or plain
 *                             AVX-512 on simd.h's emulated dot product: PDKV_BF16 2, the same sums; or
 *                             that on AVX2's halves, PDKV_BF16 3)
 *
 * A chunk is n query rows at positions start .. start + n - 1 of one sequence; its keys and values --
 * the cached prefix and the chunk's own, already written -- are positions 0 .. start + n - 1 of the
 * sequence's blocks.  The query at position p sees keys max(0, p - window + 1) .. p (window 0: none).
 *
 * torch's CPU flash attention runs this at 45-85 GFLOP/s on this machine kind; the dot products here are
 * vdpbf16ps (32 bf16 products per instruction, float32 sums), flash-attention style:
 *
 *   1. pack: for each KV head and tile of KT = 32 keys, the keys and values are copied out of their
 *      blocks into the layouts vdpbf16ps wants -- keys as [D/2][KT] pairs of dims (one vector holds
 *      16 keys' (d, d+1)), values as [KT/2][D] pairs of keys (one vector: 16 dims of keys (k, k+1)).
 *   2. attend: a task is one KV head and up to 64 / G query rows (with its G query heads: at most 64
 *      query vectors, whose running max, sum and float32 output stay in the task's scratch).  For each
 *      key tile up to the task's last row:
 *          s   = scale * q . k              8 query vectors x 32 keys per register block
 *          m'  = max(m, max s); p = exp(s - m'); l = l exp(m - m') + sum p   (masked keys: p = 0)
 *          o   = o exp(m - m') + p . v      p rounded to bfloat16, as torch's flash kernel does
 *      then out = o / l, rounded to bfloat16.
 *
 * Cache layout as in paged_decode.c: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim],
 * the order inside a block canonical or -- deterministic mode's -- paired (simd.h), which keeps keys and
 * values in step 1's layouts: packing a tile is then a copy, and a chunk that packs its own tiles (a
 * decode row) reads every whole tile from its blocks in place, packing only the last, partial one.
 */

#define _GNU_SOURCE /* syscall(), for the tiles' permission (amx.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "simd.h"

#define KT 32      /* keys per tile */

#if PDKV_BF16 == 1
typedef uint16_t operand; /* the queries and probabilities as vdpbf16ps takes them: bfloat16 pairs */
#else
/* Without AVX512-BF16 (simd.h's PDKV_BF16 2 and 3) a task keeps its queries and each tile's probabilities
 * (rounded to bfloat16 all the same) as floats, each a broadcast memory operand of its FMA: the same
 * bits as splitting each broadcast pair in registers, and (in-process A/B, SmolLM2's heads, Xeon VM
 * without AVX512-BF16) a 512-token prefill chunk 2.95 -> 2.09 ms a layer, 32 decode rows at 140
 * positions 281 -> 247 us. */
typedef float operand;
#endif
#define QVECS 64   /* query vectors (rows x heads of one KV head) per task, at most */
#define QBLOCK 8   /* query vectors per register block of the scores */
/* The packed keys and values are kept for the next call (every layer of a chunk packs the same size).
 * Over this size, a call that needs less than a quarter of them gives them back, so one long prompt does
 * not hold tens of MB for the life of the process. */
#define PACK_KEEP_BYTES ((size_t)64 << 20)

typedef struct {
    const uint16_t *q;
    int64_t q_stride; /* elements from one query row to the next (its heads are contiguous) */
    const uint16_t *cache;
    uint16_t *out;
    const int64_t *block_ids;
    int64_t start, n, num_layers, layer, block_size, num_heads, num_kv_heads;
    int D, G;
    int64_t window;
    float scale;
    int64_t kbase, ntiles, rows_per_task; /* key tiles start at position kbase */
    uint32_t *kpack, *vpack;              /* [num_kv_heads][ntiles][D / 2 * KT] dwords each */
    int64_t head_stride;                  /* tiles from one KV head's packs to the next: ntiles, or 0
                                           * for a task's private pack of its one KV head */
    int64_t task_heads;                   /* KV heads per attend task: 1, or all of them for a chunk
                                           * whose task packs its own tiles (a decode row in a batch) */
    int64_t kv_order;                     /* the cache's order inside a block (simd.h) */
    struct Ahead *ahead;                  /* the thread's prefetch stream, or NULL */
} Prefill;

static inline int64_t first_visible(const Prefill *a, int64_t pos) { return first_visible_key(pos, a->window); }

static int attn_amx_on; /* pdkv_attn_amx: every call of this process attends in AMX tiles (attn_amx.h) */

/* A chunk of one task per KV head (a decode row, a short chunk): its tasks pack their own tiles. */
static inline int packs_own_tiles(const Prefill *a) { return a->n <= a->rows_per_task; }

#if PDKV_BF16

#ifndef PDKV_ON_AVX2 /* (AVX2's build packs with plain loops: pack_tile) */
/* r[i] lane j <- r[j] lane i: a 16 x 16 transpose of dwords (unpacks, then 128-bit lane shuffles). */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}
#endif

/* In a cache in the paired order (simd.h's KV_PAIRED), KV head kvh of the block holding position pos:
 * the first dim pair of that position's key (pair p at + p block_size), and the values of the positions
 * pos, pos + 1 (pos even) as D dwords of pairs. */
static inline const uint32_t *paired_keys(const Prefill *a, int64_t kvh, int64_t pos) {
    const int64_t bs = a->block_size;
    const size_t slab = (size_t)(bs * a->num_kv_heads * a->D);
    const uint16_t *k = a->cache + (size_t)((a->block_ids[pos / bs] * a->num_layers + a->layer) * 2) * slab;
    return (const uint32_t *)k + (size_t)(kvh * (a->D / 2)) * bs + pos % bs;
}

static inline const uint32_t *paired_values(const Prefill *a, int64_t kvh, int64_t pos) {
    const int64_t bs = a->block_size;
    const size_t slab = (size_t)(bs * a->num_kv_heads * a->D);
    const uint16_t *v = a->cache + (size_t)((a->block_ids[pos / bs] * a->num_layers + a->layer) * 2 + 1) * slab;
    return (const uint32_t *)v + (size_t)((kvh * (bs / 2) + pos % bs / 2) * a->D);
}

/* pack_tile for a cache in the paired order (simd.h's KV_PAIRED): the tile's keys and values are
 * already pairs in the layouts step 1 makes, so packing is copying -- runs of positions within a block
 * (16 at a time where block_size is a multiple of 16) -- and zeroing what the chunk does not see. */
static void pack_tile_paired(const Prefill *a, int64_t kvh, int64_t t) {
    const int D = a->D;
    const int64_t bs = a->block_size, lo = first_visible(a, a->start), hi = a->start + a->n - 1;
    const size_t tile = (size_t)(kvh * a->head_stride + t) * (size_t)(D / 2 * KT);
    uint32_t *kp = a->kpack + tile;
    uint16_t *vp = (uint16_t *)(a->vpack + tile);
    const int64_t pos0 = a->kbase + t * KT;
    uint32_t vis = 0; /* bit j: key j of the tile is visible to the chunk */
    for (int j = 0; j < KT; j++) vis |= (uint32_t)(pos0 + j >= lo && pos0 + j <= hi) << j;
    /* keys: pair p of key j at kp[p KT + j]; in the block, at (kvh D/2 + p) bs + offset */
    if (bs % 16 == 0) {
        for (int j0 = 0; j0 < KT; j0 += 16) {
            const __mmask16 m = (__mmask16)(vis >> j0);
            const uint32_t *src = m ? paired_keys(a, kvh, pos0 + j0) : NULL;
            for (int p = 0; p < D / 2; p++)
                _mm512_storeu_si512(kp + (size_t)p * KT + j0,
                                    m ? _mm512_maskz_loadu_epi32(m, src + (size_t)p * bs) : _mm512_setzero_si512());
        }
    } else {
        for (int j = 0; j < KT; j++) {
            const uint32_t *src = vis >> j & 1 ? paired_keys(a, kvh, pos0 + j) : NULL;
            for (int p = 0; p < D / 2; p++) kp[(size_t)p * KT + j] = src ? src[(size_t)p * bs] : 0;
        }
    }
    /* values: keys j, j + 1 (j even: one block, an even offset) are 2 D contiguous elements in both */
    for (int j = 0; j < KT; j += 2) {
        uint16_t *out = vp + (size_t)(j >> 1) * 2 * D;
        const unsigned two = vis >> j & 3u;
        if (two == 0) {
            memset(out, 0, sizeof(uint16_t) * 2 * (size_t)D);
            continue;
        }
        const uint16_t *src = (const uint16_t *)paired_values(a, kvh, pos0 + j);
        const __mmask32 m = two == 3 ? 0xffffffffu : two == 1 ? 0x55555555u : 0xaaaaaaaau;
        for (int e = 0; e < 2 * D; e += 32)
            _mm512_storeu_si512(out + e, _mm512_maskz_loadu_epi16(m, src + e));
    }
}

/* Step 1 for one KV head and key tile: keys and values out of their blocks into the packed layouts;
 * positions outside first_visible(start) .. start + n - 1 are zeros (and masked out of every score).
 * Keys: 16 keys' rows of 16 dim pairs at a time, transposed in registers; values: two keys' rows
 * interleaved 32 dims at a time. */
static void pack_tile(const Prefill *a, int64_t kvh, int64_t t) {
    if (a->kv_order == KV_PAIRED) {
        pack_tile_paired(a, kvh, t);
        return;
    }
    const int D = a->D;
    const int64_t bs = a->block_size, lo = first_visible(a, a->start), hi = a->start + a->n - 1;
    const size_t tile = (size_t)(kvh * a->head_stride + t) * (size_t)(D / 2 * KT);
    uint32_t *kp = a->kpack + tile;
    uint16_t *vp = (uint16_t *)(a->vpack + tile);
    const uint16_t *krow[KT], *vrow[KT]; /* NULL: not visible to the chunk */
    const char *next[KT];                /* the next tile's key rows (NULL: none), prefetched as these load */
    const size_t token = (size_t)(a->num_kv_heads * D);
    /* positions walk the blocks in order: one division per tile, not two per key */
    const int64_t pos0 = a->kbase + t * KT;
    int64_t blk = pos0 / bs, off = pos0 % bs;
    for (int j = 0; j < 2 * KT; j++, off = off + 1 == bs ? 0 : off + 1, blk += off == 0) {
        const int64_t pos = pos0 + j;
        const uint16_t *k = NULL;
        if (pos >= lo && pos <= hi && (j < KT || t + 1 < a->ntiles)) {
            /* token row (block, layer, kv = 0, offset) of the cache, then this KV head's part of it */
            const size_t row = (size_t)((a->block_ids[blk] * a->num_layers + a->layer) * 2 * bs + off);
            k = a->cache + row * token + (size_t)kvh * D;
        }
        if (j < KT) {
            krow[j] = k;
            vrow[j] = k ? k + (size_t)bs * token : NULL;
        } else {
            next[j - KT] = (const char *)k;
        }
    }
    /* rows of scattered blocks, which the hardware prefetchers do not follow: each load of this tile's
     * rows comes with a prefetch of the same line of the next tile's, spread over the packing */
    const size_t vgap = (size_t)bs * token * sizeof(uint16_t); /* bytes from a key row to its value row */
#ifdef PDKV_ON_AVX2
    /* the same bytes with plain loops: avx512_avx2.h has no shuffles */
    for (int j = 0; j < KT; j++) {
        for (int o = 0; next[j] && o < 2 * D; o += 64) {
            _mm_prefetch(next[j] + o, _MM_HINT_T0);
            _mm_prefetch(next[j] + vgap + o, _MM_HINT_T0);
        }
        for (int p = 0; p < D / 2; p++) {
            uint32_t pair = 0;
            if (krow[j]) memcpy(&pair, krow[j] + 2 * p, sizeof pair);
            kp[(size_t)p * KT + j] = pair;
        }
    }
    for (int j = 0; j < KT; j += 2) {
        uint16_t *out = vp + (size_t)(j >> 1) * 2 * D;
        for (int d = 0; d < D; d++) {
            out[2 * d] = vrow[j] ? vrow[j][d] : 0;
            out[2 * d + 1] = vrow[j + 1] ? vrow[j + 1][d] : 0;
        }
    }
#else
    for (int p0 = 0; p0 < D / 2; p0 += 16)
        for (int j0 = 0; j0 < KT; j0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                if (next[j0 + j]) _mm_prefetch(next[j0 + j] + 4 * p0, _MM_HINT_T0);
                r[j] = krow[j0 + j] ? _mm512_loadu_si512(krow[j0 + j] + 2 * p0) : _mm512_setzero_si512();
            }
            transpose16(r); /* r[p] lane j: dim pair p0 + p of key j0 + j */
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(kp + (size_t)(p0 + p) * KT + j0, r[p]);
        }
    /* value dim d of key j at vp[(j / 2) * 2 D + 2 d + j % 2] */
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                            38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int j = 0; j < KT; j += 2) {
        uint16_t *out = vp + (size_t)(j >> 1) * 2 * D;
        for (int d0 = 0; d0 < D; d0 += 32) {
            if (next[j]) _mm_prefetch(next[j] + vgap + 2 * d0, _MM_HINT_T0);
            if (next[j + 1]) _mm_prefetch(next[j + 1] + vgap + 2 * d0, _MM_HINT_T0);
            const __m512i x = vrow[j] ? _mm512_loadu_si512(vrow[j] + d0) : _mm512_setzero_si512();
            const __m512i y = vrow[j + 1] ? _mm512_loadu_si512(vrow[j + 1] + d0) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + 2 * d0, _mm512_permutex2var_epi16(x, lo_idx, y));
            _mm512_storeu_si512(out + 2 * d0 + 32, _mm512_permutex2var_epi16(x, hi_idx, y));
        }
    }
#endif
}

/* A decode batch's next row, prefetched while this row computes: a row's blocks lie anywhere in the cache
 * (no hardware prefetcher follows them), and the next tile's lines alone (tile_scores, tile_values) keep
 * too few in flight.  Each thread knows the row it attends next (pdkv_paged_prefill_many's decode
 * schedule), so it streams the (block, layer) slabs -- keys then values, contiguous -- of the row it
 * attends next, a line at every step of the score and value loops, up to AHEAD_BLOCKS slabs (12 KB each
 * at SmolLM2's heads: 288 KB, within L2 beside the row at hand).  Batch-32 step of the built-in model,
 * 128-token prompts (AMD EPYC Zen 5): attention 4.2-4.4 -> 2.6-2.8 ms a step, 30 layers. */
#define AHEAD_BLOCKS 24
typedef struct Ahead {
    const char *slabs[AHEAD_BLOCKS];
    LineStream lines; /* over slabs */
} Ahead;
static _Thread_local Ahead ahead;

/* One line of a loop's local copy of the thread's ahead stream (ahead_in, ahead_out around the loop). */
INLINE void ahead_step(LineStream *s) {
    const char *line = line_stream_next(s);
    if (line != NULL) _mm_prefetch(line, _MM_HINT_T0);
}

INLINE LineStream ahead_in(const Ahead *h) { return h != NULL ? h->lines : line_stream(NULL, 0, 0); }

INLINE void ahead_out(Ahead *h, const LineStream *s) {
    if (h != NULL) h->lines = *s;
}

/* This thread's stream over decode row a's slabs of the layer (a NULL: none). */
static void ahead_plan(const Prefill *a) {
    int64_t n = 0, bytes = 0;
    if (a != NULL) {
        const int64_t bs = a->block_size, last = (a->start + a->n - 1) / bs;
        const size_t slab = (size_t)(bs * a->num_kv_heads * a->D); /* elements of keys (or values) */
        bytes = (int64_t)(2 * slab * sizeof(uint16_t));
        for (int64_t k = first_visible(a, a->start) / bs; k <= last && n < AHEAD_BLOCKS; k++) {
            const size_t at = (size_t)((a->block_ids[k] * a->num_layers + a->layer) * 2) * slab;
            ahead.slabs[n++] = (const char *)(a->cache + at);
        }
    }
    ahead.lines = line_stream(ahead.slabs, n, bytes);
}

/* Where one tile's keys and values are read: its pack, or (a full tile of a cache in the paired order)
 * the cache itself.  Keys 16 h .. 16 h + 15: pair p at k[h][p kstride]; values of keys 2 j, 2 j + 1 (j
 * < 8 in each half) at v[h][j D] -- the pack's layouts, which the paired order keeps inside a block. */
typedef struct {
    const uint32_t *k[2], *v[2];
    int64_t kstride;
} TileSrc;

/* The scores of NV <= QBLOCK query vectors (rows of q, D bf16 each) against one key tile: s[i][h] holds
 * keys 16 h .. 16 h + 15, times the scale; with pf, the next tile's keys prefetched on the way, and two
 * lines of the thread's next row (ah) at each pair of dims.  Each
 * vector's sums are the same whatever NV (a decode row's G vectors fill a block only partly). */
INLINE void tile_scores(Ahead *ah, const operand *q, const TileSrc *src, const TileSrc *pf, float scale,
                        __m512 s[QBLOCK][2], const int D, const int NV) {
    for (int i = 0; i < NV; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
    LineStream ls = ahead_in(ah);
    for (int p = 0; p < D / 2; p++) {
        if (pf) { /* the next tile's keys, a line of each half per pair of dims */
            _mm_prefetch((const char *)(pf->k[0] + (size_t)p * pf->kstride), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf->k[1] + (size_t)p * pf->kstride), _MM_HINT_T0);
        }
        ahead_step(&ls);
        ahead_step(&ls);
        const bf16v k0 = bf16v_load(src->k[0] + (size_t)p * src->kstride);
        const bf16v k1 = bf16v_load(src->k[1] + (size_t)p * src->kstride);
        for (int i = 0; i < NV; i++) {
#if PDKV_BF16 == 1
            int32_t pair;
            memcpy(&pair, q + (size_t)i * D + 2 * p, sizeof pair);
            const bf16v qb = bf16v_pair(pair);
            s[i][0] = bf16_dot(s[i][0], k0, qb);
            s[i][1] = bf16_dot(s[i][1], k1, qb);
#else
            s[i][0] = bf16_dot_pair(s[i][0], k0, q + (size_t)i * D + 2 * p);
            s[i][1] = bf16_dot_pair(s[i][1], k1, q + (size_t)i * D + 2 * p);
#endif
        }
    }
    ahead_out(ah, &ls);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int i = 0; i < NV; i++) {
        s[i][0] = _mm512_mul_ps(s[i][0], sv);
        s[i][1] = _mm512_mul_ps(s[i][1], sv);
    }
}

/* o[i] = o[i] * corr[i] + sum_k p[i][k] v[k] for QB query vectors (QB * D / 16 = 16 accumulators); with
 * pf, the next tile's values prefetched on the way, a line per load, and a line of the next row's. */
INLINE void tile_values(Ahead *ah, float *o, const operand *p, const TileSrc *src, const TileSrc *pf,
                        const float *corr, const int D, const int QB) {
    const int C = D / 16;
    __m512 acc[16];
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < C; c++)
            acc[i * C + c] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)i * D + 16 * c), _mm512_set1_ps(corr[i]));
    LineStream ls = ahead_in(ah);
    for (int kp = 0; kp < KT / 2; kp++) {
        for (int c = 0; c < C; c++) {
            if (pf) _mm_prefetch((const char *)(pf->v[kp >> 3] + (size_t)(kp & 7) * D + 16 * c), _MM_HINT_T0);
            ahead_step(&ls);
            const bf16v v = bf16v_load(src->v[kp >> 3] + (size_t)(kp & 7) * D + 16 * c);
            for (int i = 0; i < QB; i++) {
#if PDKV_BF16 == 1
                int32_t pair;
                memcpy(&pair, p + (size_t)i * KT + 2 * kp, sizeof pair);
                acc[i * C + c] = bf16_dot(acc[i * C + c], v, bf16v_pair(pair));
#else
                acc[i * C + c] = bf16_dot_pair(acc[i * C + c], v, p + (size_t)i * KT + 2 * kp);
#endif
            }
        }
    }
    ahead_out(ah, &ls);
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(o + (size_t)i * D + 16 * c, acc[i * C + c]);
}

/* Whether key tile t is read from the cache in place (filling *src): a chunk that packs its own tiles (a
 * decode row, a short chunk) over a cache in the paired order, whose blocks hold 16-position runs
 * (block_size a multiple of 16), every key of the tile visible to the chunk -- its pack would be a
 * copy.  Only the last tile of a decode row, partly beyond its position, is packed then. */
INLINE int direct_tile(const Prefill *a, int64_t kvh, int64_t t, TileSrc *src) {
    const int64_t bs = a->block_size, pos0 = a->kbase + t * KT;
    if (a->kv_order != KV_PAIRED || !packs_own_tiles(a) || bs % 16 ||
        pos0 < first_visible(a, a->start) || pos0 + KT - 1 > a->start + a->n - 1)
        return 0;
    for (int h = 0; h < 2; h++) {
        src->k[h] = paired_keys(a, kvh, pos0 + 16 * h);
        src->v[h] = paired_values(a, kvh, pos0 + 16 * h);
    }
    src->kstride = bs;
    return 1;
}

/* Where tile t of KV head kvh is read from its pack (the layouts direct_tile reads in place). */
INLINE TileSrc packed_tile(const Prefill *a, int64_t kvh, int64_t t, const int D) {
    const size_t tile = (size_t)(kvh * a->head_stride + t) * (size_t)(D / 2 * KT);
    return (TileSrc){{a->kpack + tile, a->kpack + tile + 16}, {a->vpack + tile, a->vpack + tile + 8 * D}, KT};
}

/* The lanes of `keys` (16 key positions) that a query whose keys are lo .. hi sees. */
INLINE __mmask16 visible_keys(__m512i keys, __m512i lo, __m512i hi) {
    return _mm512_cmple_epi32_mask(keys, hi) & _mm512_cmpge_epi32_mask(keys, lo);
}

/* Task scratch: the query vectors (copied, zero-padded to whole blocks), their float32 outputs, running
 * maxima, sums and corrections, and one tile's probabilities. */
typedef struct {
    operand *q; /* [QVECS][D] */
    float *o;   /* [QVECS][D] */
    float *m, *l, *corr;
    operand *p; /* [QVECS][KT] */
} Scratch;

static _Thread_local void *task_scratch;
static _Thread_local size_t task_scratch_bytes;

static int scratch_for(int D, Scratch *s) {
    const size_t bytes = (size_t)QVECS * D * (sizeof(operand) + 4) + 3 * QVECS * sizeof(float) +
                         (size_t)QVECS * KT * sizeof(operand);
    char *b = grow_scratch(&task_scratch, &task_scratch_bytes, bytes);
    if (b == NULL) return 1;
    s->o = (float *)b;
    s->m = s->o + (size_t)QVECS * D;
    s->l = s->m + QVECS;
    s->corr = s->l + QVECS;
    s->q = (operand *)(s->corr + QVECS);
    s->p = s->q + (size_t)QVECS * D;
    return 0;
}

/* The task's nq query vectors into its scratch, zero vectors after them up to `padded` (whole blocks), with
 * their running max and sum started and their outputs zeroed: query vector i is row r0 + i / G, head
 * kvh * G + i % G. */
INLINE void load_queries(const Prefill *a, Scratch *s, int64_t kvh, int64_t r0, int nq, int padded, const int D) {
    const int G = a->G;
    for (int i = 0; i < padded; i++) {
        operand *qi = s->q + (size_t)i * D;
        if (i < nq) {
            const uint16_t *src = a->q + (size_t)((r0 + i / G) * a->q_stride + (kvh * G + i % G) * D);
#if PDKV_BF16 == 1
            memcpy(qi, src, 2 * (size_t)D);
#else
            widen_bf16(src, qi, D);
#endif
        } else {
            memset(qi, 0, sizeof(operand) * (size_t)D);
        }
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
    memset(s->o, 0, sizeof(float) * (size_t)nq * D);
}

/* The task's nq query vectors' outputs, o / l rounded to bfloat16, into the call's output rows. */
INLINE void store_outputs(const Prefill *a, const Scratch *s, int64_t kvh, int64_t r0, int nq, const int D) {
    const int G = a->G;
    for (int i = 0; i < nq; i++) {
        uint16_t *out = a->out + (size_t)((r0 + i / G) * a->num_heads + kvh * G + i % G) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / s->l[i]);
        for (int c = 0; c < D / 16; c++)
            _mm256_storeu_si256((__m256i *)(out + 16 * c),
                                to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(s->o + (size_t)i * D + 16 * c), inv)));
    }
}

/* Step 2: KV head kvh, query rows r0 .. r0 + rows - 1 of the chunk. */
INLINE int attend_rows(const Prefill *a, int64_t kvh, int64_t r0, int64_t rows, const int D) {
    Scratch s;
    if (scratch_for(D, &s)) return 1;
    const int G = a->G, nq = (int)rows * G, nb = (nq + QBLOCK - 1) / QBLOCK;
    load_queries(a, &s, kvh, r0, nq, nb * QBLOCK, D);
    const int64_t first_row_pos = a->start + r0, last = first_row_pos + rows - 1;
    const int64_t t0 = (first_visible(a, first_row_pos) - a->kbase) / KT, t1 = (last - a->kbase) / KT;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    TileSrc next_src = {{NULL, NULL}, {NULL, NULL}, 0}; /* tile t + 1's, where it is read in place */
    int next_direct = direct_tile(a, kvh, t0, &next_src);
    for (int64_t t = t0; t <= t1; t++) {
        TileSrc src = next_src;
        if (!next_direct) src = packed_tile(a, kvh, t, D);
        /* the next tile, where it too is read in place: its lines prefetched as this one's are read
         * (its blocks lie anywhere in the cache, which the hardware prefetchers do not follow) */
        next_direct = t < t1 && direct_tile(a, kvh, t + 1, &next_src);
        const TileSrc *pf = next_direct ? &next_src : NULL;
        const __m512i k0 = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(a->kbase + t * KT)), iota);
        const __m512i k1 = _mm512_add_epi32(k0, _mm512_set1_epi32(16));
        for (int b = 0; b < nb; b++) {
            __m512 sc[QBLOCK][2];
            const operand *qb = s.q + (size_t)b * QBLOCK * D;
            switch (nq - b * QBLOCK < QBLOCK ? nq - b * QBLOCK : QBLOCK) { /* constants, so it unrolls */
            case 1: tile_scores(a->ahead, qb, &src, b ? NULL : pf, a->scale, sc, D, 1); break;
            case 2: tile_scores(a->ahead, qb, &src, b ? NULL : pf, a->scale, sc, D, 2); break;
            case 3: tile_scores(a->ahead, qb, &src, b ? NULL : pf, a->scale, sc, D, 3); break;
            case 4: tile_scores(a->ahead, qb, &src, b ? NULL : pf, a->scale, sc, D, 4); break;
            default: tile_scores(a->ahead, qb, &src, b ? NULL : pf, a->scale, sc, D, QBLOCK); break;
            }
            for (int j = 0; j < QBLOCK; j++) {
                const int i = b * QBLOCK + j;
                if (i >= nq) break;
                const int64_t pos = first_row_pos + i / G;
                const __m512i hi = _mm512_set1_epi32((int32_t)pos);
                const __m512i lo = _mm512_set1_epi32((int32_t)first_visible(a, pos));
                const __mmask16 v0 = visible_keys(k0, lo, hi), v1 = visible_keys(k1, lo, hi);
                operand *pi = s.p + (size_t)i * KT;
                const float tmax = fmaxf(_mm512_mask_reduce_max_ps(v0, sc[j][0]),
                                         _mm512_mask_reduce_max_ps(v1, sc[j][1]));
                if (!(v0 | v1) || tmax == -INFINITY) { /* nothing visible in this tile */
                    memset(pi, 0, sizeof(operand) * KT);
                    s.corr[i] = 1.0f;
                    continue;
                }
                const float m = s.m[i] > tmax ? s.m[i] : tmax;
                const __m512 mv = _mm512_set1_ps(m);
                const __m512 p0 = _mm512_maskz_mov_ps(v0, exp512(_mm512_sub_ps(sc[j][0], mv)));
                const __m512 p1 = _mm512_maskz_mov_ps(v1, exp512(_mm512_sub_ps(sc[j][1], mv)));
                /* expf(0) is 1 exactly: a maximum that did not move needs no call */
                const float corr = s.m[i] == -INFINITY ? 0.0f : s.m[i] == m ? 1.0f : expf(s.m[i] - m);
                s.l[i] = s.l[i] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                s.m[i] = m;
                s.corr[i] = corr;
#if PDKV_BF16 == 1
                _mm512_storeu_si512(pi, pack_bf16x32(p0, p1)); /* keys 0..31 in order */
#else
                _mm512_storeu_ps(pi, round_bf16x16(p0));
                _mm512_storeu_ps(pi + 16, round_bf16x16(p1));
#endif
            }
        }
        const int QB = 256 / D; /* query vectors per block of the values: 16 accumulators */
        int i = 0; /* the first pass over the values prefetches the next tile's */
#define VALUES(n) \
    tile_values(a->ahead, s.o + (size_t)i * D, s.p + (size_t)i * KT, &src, i ? NULL : pf, s.corr + i, D, n)
        for (; i + QB <= nq; i += QB) VALUES(QB);
        for (int r; i < nq; i += r) { /* the rest, up to 3 vectors a pass (a decode row's G): constants */
            r = nq - i < 3 ? nq - i : 3;
            r = r < QB ? r : QB; /* r * D / 16 accumulators: at most 16 */
            if (r == 3) VALUES(3);
            else if (r == 2) VALUES(2);
            else VALUES(1);
        }
#undef VALUES
    }
    store_outputs(a, &s, kvh, r0, nq, D);
    return 0;
}

#include "attn_amx.h"

static int attend_task(const Prefill *a, int64_t kvh, int64_t r0, int64_t rows) {
#ifdef PDKV_ATTN_AMX
    if (attn_amx_on) switch (a->D) {
        case 64: return attend_rows_amx(a, kvh, r0, rows, 64);
        case 128: return attend_rows_amx(a, kvh, r0, rows, 128);
        default: return attend_rows_amx(a, kvh, r0, rows, a->D);
        }
#endif
    switch (a->D) { /* head sizes as constants, so the register blocks unroll */
    case 64: return attend_rows(a, kvh, r0, rows, 64);
    case 128: return attend_rows(a, kvh, r0, rows, 128);
    default: return attend_rows(a, kvh, r0, rows, a->D);
    }
}

/* The shared packed keys and values, grown by the calling thread (never by the pool's threads, which
 * only read them). */
static _Thread_local void *pack;
static _Thread_local size_t pack_bytes;
/* A pool thread's private pack (the tiles of one task), kept across calls. */
static _Thread_local void *private_pack;
static _Thread_local size_t private_pack_bytes;

/* Task i of chunk a (its KV heads' group and rows). */
static int run_task(const Prefill *a, int64_t i) {
    const int64_t groups = a->num_kv_heads / a->task_heads;
    const int64_t kvh = i % groups * a->task_heads, r0 = (i / groups) * a->rows_per_task;
    const int64_t rows = a->n - r0 < a->rows_per_task ? a->n - r0 : a->rows_per_task;
    if (a->head_stride != 0) return attend_task(a, kvh, r0, rows);
    /* its private pack: its KV heads' tiles, key by key */
    const size_t tile_dwords = (size_t)(a->D / 2 * KT);
    const size_t tiles = (size_t)(a->task_heads * a->ntiles);
    uint32_t *buf =
        grow_scratch(&private_pack, &private_pack_bytes, 2 * sizeof(uint32_t) * tile_dwords * tiles);
    if (buf == NULL) return 1;
    Prefill own = *a; /* one head (kvh): its tiles; every head (kvh 0): head by head */
    own.kpack = buf;
    own.vpack = buf + tile_dwords * tiles;
    own.head_stride = a->task_heads > 1 ? a->ntiles : 0;
    own.ahead = &ahead; /* a decode batch's next row, where the schedule planned one */
    for (int64_t t = 0; t < a->ntiles; t++)
        for (int64_t h = kvh; h < kvh + a->task_heads; h++) {
            TileSrc in_place;
            if (!direct_tile(&own, h, t, &in_place)) pack_tile(&own, h, t);
        }
    for (int64_t h = kvh; h < kvh + a->task_heads; h++)
        if (attend_task(&own, h, r0, rows)) return 1;
    return 0;
}

#endif /* PDKV_BF16 */

/* 1 when this build has the kernel (the compiler targeted AVX-512 or AVX2: simd.h's PDKV_BF16), 0 when
 * pdkv_paged_prefill_many can only refuse: the CPU's flags say what it runs, not what gcc emitted. */
int pdkv_paged_prefill_built(void) { return PDKV_BF16 != 0; }

/* want 1: attend in AMX tiles from now on where this build has them (AMX-BF16 and AVX512-BF16) and Linux
 * grants them; 0: in vectors; -1: no change.  Returns the path now in use: 1 tiles, 0 vectors.  The
 * library sets it once as it loads (engine/native.py); the two paths' bits differ (attn_amx.h), and an
 * engine names the path in its KV namespace as it starts -- so only tests of the kernel alone change it
 * later, never while an engine runs. */
int pdkv_attn_amx(int64_t want) {
#ifdef PDKV_ATTN_AMX
    if (want >= 0) attn_amx_on = want && amx_granted() == 1;
#else
    (void)want;
#endif
    return attn_amx_on;
}

/* Many chunks in one call: chunk c is counts[c] query rows at positions starts[c] .. starts[c] + counts[c]
 * - 1 of the sequence whose blocks are block_table[c * table_width ..] (table_width ids, covering those
 * positions); its rows follow the previous chunk's in q (row i at q + i * q_stride) and in out ([rows,
 * num_heads, head_dim] contiguous).  A decode step is counts[c] = 1 per sequence.  Each row's arithmetic
 * depends on its own position and keys only: key tiles sit at absolute multiples of KT, and a tile a row
 * does not see leaves its running max, sum and output untouched -- so a token's attention is the same
 * bits computed in any chunk, alone or with others (engine/determinism.py relies on it).
 * Returns 0; 1 when memory could not be allocated; 2 for what this build or the shape cannot take (no
 * AVX-512, head_dim not a multiple of 32 or over 256, more than 16 query heads per KV head); 3 for a
 * block id, position or layer outside the table or the cache (nothing is read). */
int pdkv_paged_prefill_many(const void *q, int64_t q_stride, const void *cache, void *out,
                            const int64_t *block_table, int64_t table_width, const int64_t *starts,
                            const int64_t *counts, int64_t num_chunks, int64_t num_layers, int64_t layer,
                            int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t window, float scale, int64_t num_blocks, int64_t kv_order) {
#if !PDKV_BF16
    (void)q, (void)q_stride, (void)cache, (void)out, (void)block_table, (void)table_width, (void)starts;
    (void)counts, (void)num_chunks, (void)num_layers, (void)layer, (void)block_size, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)window, (void)scale, (void)num_blocks, (void)kv_order;
    return 2;
#else
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim % 32 || head_dim <= 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 || num_chunks <= 0 ||
        (kv_order != KV_CANONICAL && (kv_order != KV_PAIRED || block_size % 2)))
        return 2;
    if (layer < 0 || layer >= num_layers) return 3;
    const int G = (int)(num_heads / num_kv_heads);
    Prefill *chunks = malloc(sizeof(Prefill) * (size_t)num_chunks);
    int64_t *pack_first = malloc(sizeof(int64_t) * (size_t)(2 * num_chunks + 2));
    if (chunks == NULL || pack_first == NULL) {
        free(chunks), free(pack_first);
        return 1;
    }
    /* pack_first[c]: chunk c's first pack job (KV head x tile); task_first[c]: its first attend task */
    int64_t *task_first = pack_first + num_chunks + 1;
    size_t dwords = 0; /* of the packed keys (as many again for the values) */
    int64_t row = 0, jobs = 0, tasks = 0;
    int status = 0;
    for (int64_t c = 0; c < num_chunks && status == 0; c++) {
        const int64_t start = starts[c], n = counts[c];
        const int64_t *ids = block_table + c * table_width;
        if (n <= 0 || start < 0) {
            status = 2;
            break;
        }
        Prefill a = {(const uint16_t *)q + (size_t)(row * q_stride), q_stride, cache,
                     (uint16_t *)out + (size_t)(row * num_heads * head_dim), ids, start, n, num_layers, layer,
                     block_size, num_heads, num_kv_heads, (int)head_dim, G, window, scale, 0, 0, QVECS / G,
                     NULL, NULL, 0, 1, kv_order, NULL};
        a.kbase = first_visible(&a, start) / KT * KT;
        a.ntiles = (start + n - a.kbase + KT - 1) / KT;
        /* A chunk of one task per KV head (a decode row, a short chunk) packs its tiles in that task,
         * into the thread's own buffer, where they stay in cache for the attention right after; longer
         * chunks share one pack, made first, among their tasks. */
        const int private = packs_own_tiles(&a);
        a.head_stride = private ? 0 : a.ntiles;
        /* Among many such chunks (a decode batch), one task packs and attends every KV head of its
         * rows: it reads each key's and value's row of the cache whole, one stream, where a task per
         * head would read a third of each row, three strided streams (+12% a batch-32 step). */
        a.task_heads = private && num_chunks >= 4 * (int64_t)omp_get_max_threads() ? num_kv_heads : 1;
        if ((start + n + block_size - 1) / block_size > table_width) status = 3;
        for (int64_t k = first_visible(&a, start) / block_size; status == 0 && k <= (start + n - 1) / block_size; k++)
            if (ids[k] < 0 || ids[k] >= num_blocks) status = 3;
        a.kpack = (uint32_t *)(uintptr_t)dwords; /* an offset until the buffer exists */
        dwords += (size_t)(num_kv_heads * a.head_stride) * (size_t)(head_dim / 2 * KT);
        chunks[c] = a;
        pack_first[c] = jobs;
        task_first[c] = tasks;
        jobs += num_kv_heads * a.head_stride;
        tasks += num_kv_heads / a.task_heads * ((n + a.rows_per_task - 1) / a.rows_per_task);
        row += n;
    }
    pack_first[num_chunks] = jobs;
    task_first[num_chunks] = tasks;
    const size_t half = dwords * sizeof(uint32_t);
    if (status == 0 && (2 * half > pack_bytes || (pack_bytes > PACK_KEEP_BYTES && 8 * half < pack_bytes))) {
        free(pack); /* nothing in it is kept: no copy, as realloc would make */
        pack = malloc(2 * half);
        pack_bytes = pack == NULL ? 0 : 2 * half;
        if (pack == NULL) status = 1;
    }
    if (status != 0) {
        free(chunks), free(pack_first);
        return status;
    }
    for (int64_t c = 0; c < num_chunks; c++) {
        const size_t offset = (size_t)(uintptr_t)chunks[c].kpack;
        chunks[c].kpack = chunks[c].head_stride ? (uint32_t *)pack + offset : NULL;
        chunks[c].vpack = chunks[c].head_stride ? (uint32_t *)((char *)pack + half) + offset : NULL;
    }
    /* every chunk a decode row whose one task attends all its KV heads: the decode schedule below */
    int rows_only = tasks == num_chunks;
    for (int64_t r = 0; r < num_chunks && rows_only; r++)
        rows_only = chunks[r].n == 1 && chunks[r].head_stride == 0 && chunks[r].task_heads == num_kv_heads;
    int failed = 0;
    int64_t next_row = 0; /* the decode rows' claims (below) */
#pragma omp parallel
    {
        const unsigned csr = bf16_mode_enter(1);
        int64_t c = 0;
#pragma omp for schedule(static)
        for (int64_t job = 0; job < jobs; job++) {
            while (pack_first[c + 1] <= job) c++;
            while (pack_first[c] > job) c--;
            const int64_t j = job - pack_first[c];
            pack_tile(&chunks[c], j / chunks[c].head_stride, j % chunks[c].head_stride);
        }
        int bad = 0;
        if (rows_only) {
            /* decode rows, a task each, claimed in order from a shared counter, one claim ahead of the
             * row at hand -- so the thread knows the row it attends next and streams it in on the way
             * (ahead_plan), and a thread on a slower core attends fewer rows.  This VM's two vCPUs ran a
             * bare vdpbf16ps loop up to 25 % apart (ad-hoc, AMD EPYC Zen 5), which a fixed share balanced
             * by tiles left to the slower one: 32 decode rows at 150 positions, 30 layers from L3
             * (in-process A/B, three runs each from the caches and from memory), 3.01 / 3.30 / 2.05 ->
             * 2.58 / 3.06 / 2.03 ms and 4.65 / 4.45 / 4.14 -> 4.64 / 4.33 / 4.13 ms (medians); in the
             * engine, in minutes when the two ran alike, the batch-32 step the same (19.93 / 19.90 ms). */
            int64_t r = __atomic_fetch_add(&next_row, 1, __ATOMIC_RELAXED);
            while (r < num_chunks && !bad) {
                const int64_t after = __atomic_fetch_add(&next_row, 1, __ATOMIC_RELAXED);
                ahead_plan(after < num_chunks ? &chunks[after] : NULL);
                bad = run_task(&chunks[r], 0);
                r = after;
            }
            ahead_plan(NULL);
        } else {
            c = num_chunks - 1;
            /* the last rows see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = tasks - 1; task >= 0; task--) {
                while (task_first[c] > task) c--;
                while (task_first[c + 1] <= task) c++;
                if (!bad) bad = run_task(&chunks[c], task - task_first[c]);
            }
        }
#ifdef PDKV_ATTN_AMX
        attn_amx_release();
#endif
        bf16_mode_leave(1, csr);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(chunks), free(pack_first);
    return failed;
#endif
}
