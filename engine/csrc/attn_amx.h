/* paged_prefill.c's attention in AMX tiles (TDPBF16PS), on CPUs with AMX-BF16 where pdkv_attn_amx turned
 * them on: the same tasks and key tiles of KT keys as attend_rows, with the dot products -- the scores of
 * up to 16 query vectors against a tile's keys, and their probabilities times its values -- in AMX tiles,
 * and the softmax's running max, sum and rescaling per span of AMX_SPAN tiles (256 keys) instead of per
 * tile.
 *
 * The layouts are already the tiles': a key tile's half (16 keys) holds pair p of the keys' dims at
 * k[h] + p kstride -- a B tile of 16 pairs x 16 keys per 32 dims; the values of keys 2 j, 2 j + 1 (j < 8)
 * at v[h] + j D -- a B tile of 8 key pairs x 16 dims per 16 dims.  A block of up to 16 query vectors is
 * the A tile of the scores, 32 dims a step, and its probabilities (rounded to bfloat16) the A tile of
 * the values, 16 keys a step.
 *
 * Why spans: a decode row has G (3 for SmolLM2) query vectors per KV head, so its tiles are mostly empty
 * rows and the dot products cheap; what costs is the softmax's horizontal max and sum, its scalar
 * correction and a trip through memory for every tile (a chain of tile load, TDPBF16PS and tile store
 * waits ~30 ns on a Xeon with AMX).  Per span, three passes: the scores of its tiles (two tiles side by
 * side in the accumulators); then for each vector m' = max(m, the span's visible scores), p = exp(s -
 * m') rounded to bfloat16, l = l exp(m - m') + the span's sum of p (lanes added tile by tile, then across);
 * then p . v accumulated over the span's tiles in order (each tile's first 16 keys, then its last 16) in
 * zeroed accumulators, and o = fma(o, exp(m - m'), p . v).
 *
 * Spans sit at absolute multiples of AMX_SPAN tiles, so each vector's bits depend on its own position and
 * keys only -- a tile's rows are independent in TDPBF16PS -- whatever the number of rows in the block,
 * the task or the call: a token's attention is the same bits in a prefill chunk or a decode step.  They
 * are not the vectors' bits, so a process runs one path for every call and the KV namespace names it
 * (engine/determinism.kv_fingerprint: attention=amx).
 *
 * Tiles, one configuration: 0 a query step (nv x 64 bytes), 1 a key half's step (16 x 64), 2..5
 * accumulators (nv x 64: two key tiles' scores, or four 16-dim columns of p . v), 6 a probability half
 * (nv x 32), 7 a value step (8 x 64). */

#if PDKV_BF16 == 1 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDKV_ATTN_AMX 1
#include "amx.h"

#define AMX_Q 16   /* query vectors per tile block */
#define AMX_SPAN 8 /* key tiles per span of the softmax, at absolute multiples */

/* The configuration this thread loaded (-1: none), kept from task to task of one call and given back at
 * its end: nothing else may use the tiles inside a task (bf16_amx.h's and quant_amx.h's linears load and
 * give back their own, call by call). */
static _Thread_local int amx_rows_now = -1;

static void attn_amx_configure(int nv) {
    const int rows[8] = {nv, 16, nv, nv, nv, nv, nv, 8}, colsb[8] = {64, 64, 64, 64, 64, 64, 32, 64};
    amx_configure_tiles(rows, colsb, 8);
    amx_rows_now = nv;
}

/* At the end of a call's parallel region: the tiles' state given back. */
static void attn_amx_release(void) {
    if (amx_rows_now >= 0) _tile_release();
    amx_rows_now = -1;
}

/* A span's buffers: scores [AMX_SPAN][AMX_Q][KT], probabilities (bfloat16) likewise, p . v [AMX_Q][D],
 * the corrections [AMX_Q]. */
static _Thread_local void *amx_scratch;
static _Thread_local size_t amx_scratch_bytes;

/* n lines of the thread's ahead stream, into L2 (prefetcht1): the tiles load from L2 as fast, and the
 * lines come in bursts between tile instructions, which into L1 (the vector path's prefetcht0) take the
 * fill buffers the tile loads wait on.  In-process A/B on a Xeon with AMX (the hint switched between
 * rounds of 5 steps, 14 rounds, batch 32 at 128-token prompts): T1 0.943-0.989 of T0's step, median
 * 0.959; T2 as T1; NTA 1.4x slower. */
INLINE void ahead_steps(Ahead *h, int n) {
    for (int i = 0; h != NULL && i < n; i++) {
        const char *line = line_stream_next(&h->lines);
        if (line == NULL) return;
        _mm_prefetch(line, _MM_HINT_T1);
    }
}

/* Pass 1: block qb's scores against tiles u, u + 1 (two: both) of the span, into sc (unscaled). */
INLINE void amx_scores(const operand *qb, const TileSrc *src, int two, float *sc, Ahead *ah, int ahead,
                       const int D) {
    _tile_zero(2);
    _tile_zero(3);
    if (two) {
        _tile_zero(4);
        _tile_zero(5);
    }
    for (int st = 0; st < D / 32; st++) {
        const size_t at = (size_t)(16 * st);
        _tile_loadd(0, qb + 32 * st, 2 * D);
        _tile_loadd(1, src[0].k[0] + at * src[0].kstride, 4 * src[0].kstride);
        _tile_dpbf16ps(2, 0, 1);
        ahead_steps(ah, ahead);
        _tile_loadd(1, src[0].k[1] + at * src[0].kstride, 4 * src[0].kstride);
        _tile_dpbf16ps(3, 0, 1);
        ahead_steps(ah, ahead);
        if (two) {
            _tile_loadd(1, src[1].k[0] + at * src[1].kstride, 4 * src[1].kstride);
            _tile_dpbf16ps(4, 0, 1);
            ahead_steps(ah, ahead);
            _tile_loadd(1, src[1].k[1] + at * src[1].kstride, 4 * src[1].kstride);
            _tile_dpbf16ps(5, 0, 1);
            ahead_steps(ah, ahead);
        }
    }
    _tile_stored(2, sc, KT * 4);
    _tile_stored(3, sc + 16, KT * 4);
    if (two) {
        _tile_stored(4, sc + AMX_Q * KT, KT * 4);
        _tile_stored(5, sc + AMX_Q * KT + 16, KT * 4);
    }
}

/* Pass 3: the span's p . v for dims 16 c0 .. 16 c0 + 63 (four columns; two where only two are left), every
 * tile's first 16 keys then its last 16, in order, into pv ([nv][D]). */
INLINE void amx_values(const uint16_t *pbuf, const TileSrc *src, int nt, int c0, int four, float *pv,
                       Ahead *ah, int ahead, const int D) {
    _tile_zero(2);
    _tile_zero(3);
    if (four) {
        _tile_zero(4);
        _tile_zero(5);
    }
    for (int u = 0; u < nt; u++)
        for (int h = 0; h < 2; h++) {
            _tile_loadd(6, pbuf + (size_t)u * AMX_Q * KT + 16 * h, KT * 2);
            const uint32_t *vh = src[u].v[h] + 16 * c0;
            _tile_loadd(7, vh, 4 * D);
            _tile_dpbf16ps(2, 6, 7);
            ahead_steps(ah, ahead);
            _tile_loadd(7, vh + 16, 4 * D);
            _tile_dpbf16ps(3, 6, 7);
            ahead_steps(ah, ahead);
            if (four) {
                _tile_loadd(7, vh + 32, 4 * D);
                _tile_dpbf16ps(4, 6, 7);
                ahead_steps(ah, ahead);
                _tile_loadd(7, vh + 48, 4 * D);
                _tile_dpbf16ps(5, 6, 7);
                ahead_steps(ah, ahead);
            }
        }
    float *at = pv + 16 * c0;
    _tile_stored(2, at, 4 * D);
    _tile_stored(3, at + 16, 4 * D);
    if (four) {
        _tile_stored(4, at + 32, 4 * D);
        _tile_stored(5, at + 48, 4 * D);
    }
}

/* attend_rows in tiles: KV head kvh, query rows r0 .. r0 + rows - 1 of the chunk. */
INLINE int attend_rows_amx(const Prefill *a, int64_t kvh, int64_t r0, int64_t rows, const int D) {
    Scratch s;
    const size_t sc_floats = (size_t)AMX_SPAN * AMX_Q * KT;
    float *sbuf = grow_scratch(&amx_scratch, &amx_scratch_bytes,
                               sizeof(float) * (sc_floats + (size_t)AMX_Q * (D + 1)) + sizeof(uint16_t) * sc_floats);
    if (sbuf == NULL || scratch_for(D, &s)) return 1;
    float *pv = sbuf + sc_floats, *cbuf = pv + (size_t)AMX_Q * D;
    uint16_t *pbuf = (uint16_t *)(cbuf + AMX_Q);
    const int G = a->G, nq = (int)rows * G;
    /* blocks of nv vectors: one block of them all up to 16 (a decode row's G), else blocks of 16, the last
     * padded with zero queries (whose probabilities are zeros and whose outputs are not read) */
    const int nv = nq < AMX_Q ? nq : AMX_Q, nb = (nq + nv - 1) / nv;
    load_queries(a, &s, kvh, r0, nq, nb * nv, D);
    if (amx_rows_now != nv) attn_amx_configure(nv);
    const int64_t first_row_pos = a->start + r0, last = first_row_pos + rows - 1;
    const int64_t t0 = (first_visible(a, first_row_pos) - a->kbase) / KT, t1 = (last - a->kbase) / KT;
    const int64_t tbase = a->kbase / KT; /* tile t is absolute tile tbase + t */
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 sv = _mm512_set1_ps(a->scale);
    /* the thread's ahead stream (a decode batch's next row): as many lines a tile as the vector path's,
     * spread over the span's tile instructions (4 a tile for the scores, 2 D / 16 for the values) */
    const int ahead = (2 * (D / 2) + KT / 2 * (D / 16) + 4 + 2 * D / 16 - 1) / (4 + 2 * D / 16);
    for (int64_t c0 = t0; c0 <= t1;) {
        const int64_t span_end = (tbase + c0) / AMX_SPAN * AMX_SPAN + AMX_SPAN - tbase; /* exclusive */
        const int nt = (int)((span_end <= t1 ? span_end : t1 + 1) - c0);
        TileSrc src[AMX_SPAN];
        for (int u = 0; u < nt; u++)
            if (!direct_tile(a, kvh, c0 + u, &src[u])) src[u] = packed_tile(a, kvh, c0 + u, D);
        for (int b = 0; b < nb; b++) {
            const int i0 = b * nv, pf = b == 0 ? ahead : 0;
            const operand *qb = s.q + (size_t)i0 * D;
            for (int u = 0; u < nt; u += 2)
                amx_scores(qb, src + u, u + 1 < nt, sbuf + (size_t)u * AMX_Q * KT, a->ahead, pf, D);
            /* pass 2: each vector's softmax over the span */
            for (int j = 0; j < nv; j++) {
                const int i = i0 + j;
                cbuf[j] = 1.0f;
                __mmask16 vis[2 * AMX_SPAN];
                int any = 0;
                __m512 vmax = _mm512_set1_ps(-INFINITY);
                if (i < nq) {
                    const int64_t pos = first_row_pos + i / G;
                    const __m512i hi = _mm512_set1_epi32((int32_t)pos);
                    const __m512i lo = _mm512_set1_epi32((int32_t)first_visible(a, pos));
                    for (int u = 0; u < nt; u++) {
                        const int32_t key0 = (int32_t)(a->kbase + (c0 + u) * KT);
                        const __m512i k0 = _mm512_add_epi32(_mm512_set1_epi32(key0), iota);
                        const __m512i k1 = _mm512_add_epi32(k0, _mm512_set1_epi32(16));
                        vis[2 * u] = visible_keys(k0, lo, hi);
                        vis[2 * u + 1] = visible_keys(k1, lo, hi);
                        float *su = sbuf + (size_t)(u * AMX_Q + j) * KT;
                        for (int h = 0; h < 2; h++) {
                            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(su + 16 * h), sv);
                            _mm512_storeu_ps(su + 16 * h, x);
                            vmax = _mm512_mask_max_ps(vmax, vis[2 * u + h], vmax, x);
                            any |= vis[2 * u + h] != 0;
                        }
                    }
                }
                const float smax = any ? _mm512_reduce_max_ps(vmax) : -INFINITY;
                if (smax == -INFINITY) { /* nothing visible in this span (or a padding vector) */
                    for (int u = 0; u < nt; u++) memset(pbuf + (size_t)(u * AMX_Q + j) * KT, 0, sizeof(uint16_t) * KT);
                    continue;
                }
                const float m = s.m[i] > smax ? s.m[i] : smax;
                const __m512 mv = _mm512_set1_ps(m);
                __m512 vsum = _mm512_setzero_ps();
                for (int u = 0; u < nt; u++) {
                    const float *su = sbuf + (size_t)(u * AMX_Q + j) * KT;
                    const __m512 p0 = _mm512_maskz_mov_ps(vis[2 * u], exp512(_mm512_sub_ps(_mm512_loadu_ps(su), mv)));
                    const __m512 p1 =
                        _mm512_maskz_mov_ps(vis[2 * u + 1], exp512(_mm512_sub_ps(_mm512_loadu_ps(su + 16), mv)));
                    vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
                    _mm512_storeu_si512(pbuf + (size_t)(u * AMX_Q + j) * KT, pack_bf16x32(p0, p1));
                }
                cbuf[j] = s.m[i] == -INFINITY ? 0.0f : s.m[i] == m ? 1.0f : expf(s.m[i] - m); /* expf(0) = 1 */
                s.l[i] = s.l[i] * cbuf[j] + _mm512_reduce_add_ps(vsum);
                s.m[i] = m;
            }
            /* pass 3: p . v over the span, then o = fma(o, corr, p . v) */
            for (int c = 0; c < D / 16; c += 4)
                amx_values(pbuf, src, nt, c, c + 4 <= D / 16, pv, a->ahead, pf, D);
            for (int j = 0; j < nv && i0 + j < nq; j++) {
                float *oi = s.o + (size_t)(i0 + j) * D;
                const __m512 cv = _mm512_set1_ps(cbuf[j]);
                for (int c = 0; c < D / 16; c++)
                    _mm512_storeu_ps(oi + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(oi + 16 * c), cv,
                                                                  _mm512_loadu_ps(pv + (size_t)j * D + 16 * c)));
            }
        }
        c0 += nt;
    }
    store_outputs(a, &s, kvh, r0, nq, D);
    return 0;
}
#endif
