/* bfloat16 linears over weights packed for AVX512-BF16's vdpbf16ps, every row summed in one fixed order.
 *
 *   pdkv_bf16_linear   out[m, col0 + n] = sum_k x[m, k] w[n, k]     (x, w, out bfloat16; float32 sums)
 *   pdkv_bf16_rows     rows of w as dense bfloat16 (tests, the bench's floor)
 *
 * Layout (engine/model/quantized.py's pack_bf16 writes it): output rows in groups of 16 (the lanes of a
 * vector); per group, for each pair of inputs p (k even), 64 bytes: row r's w[r, 2p] and w[r, 2p + 1].
 * One vdpbf16ps adds two inputs' products to 16 outputs: the activation pair broadcast, no horizontal sums.
 *
 * Each output accumulates its pairs in input order in one float32 lane, whatever the number of rows, the
 * tile a row lands in or the threads: a row's result depends on that row alone (batch-invariant, the
 * engine's determinism rule).  A tile is up to 4 groups x 6 (4) rows of accumulators, all independent,
 * so the adds' latency overlaps; a thread's groups and a chunk's rows split into tiles as evenly as they
 * go (32 rows: 6 6 5 5 5 5, not 6 x 5 and a tile of 2 that ran 6 rows' dot products: in-process A/B on an
 * AMD EPYC Zen 4, bfloat16 decode step at batch 32 38.9 -> 36.7 ms, batch 8 17.5 -> 15.7).
 *
 * The dot products run in one of two forms with the same bits (FORM_VDP, FORM_FMA below): vdpbf16ps, or
 * two FMAs per pair with DAZ and FTZ -- the only form without AVX512-BF16 (simd.h's PDKV_BF16 2, 3), and the
 * faster one on Intel's cores without AMX (pdkv_bf16_fma).
 *
 * On CPUs with AMX-BF16 the same layout runs in AMX tiles where pdkv_bf16_amx turned them on (bf16_amx.h).
 *
 * pdkv_side_stream: byte ranges the calling thread's next batch linears prefetch as they go (below).
 *
 * Returns 0; 1 without AVX-512 or AVX2 in this build; 2 for a shape it does not serve; 3 when memory for the
 * activations widened to floats (the FMA form) runs out.
 */

#define _GNU_SOURCE /* syscall(), for the tiles' permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "simd.h"

#define G16 16
#define BF_PREFETCH 1024
/* 1: the weights prefetched non-temporally (prefetchnta), so that they pass through without pushing the
 * KV cache and the activations out of the caches; 0: into L1 (prefetcht0).  Which is faster is the
 * CPU's (quant.c's row_prefetch says more): an AMD EPYC Zen 5, in-process A/B with the switch flipped
 * between rounds of steps, bfloat16 decode step at batch 1 6.49-6.55 -> 6.31-6.39 ms, 8 9.96 -> 9.86 and
 * 8.64 -> 8.48, 32 19.29-19.30 -> 19.04-19.15.  The same bits either way; engine/native.py sets it as the
 * library loads, by the vendor (engine/native_linear.py's row_prefetch_default). */
static int bf_nta;

/* want 0 or 1: from now on; else no change.  Returns the setting in use. */
int64_t pdkv_bf16_prefetch_nta(int64_t want) {
    if (want == 0 || want == 1) bf_nta = (int)want;
    return bf_nta;
}
/* The side stream's prefetches go to L2 (and on to the L3 as the weights' lines push them out), not L1:
 * _MM_HINT_T0 left the batch-32 step slower than T1 or T2 (AMD EPYC Zen 5). */
#define SIDE_HINT _MM_HINT_T2

#include "bf16_amx.h"

static int amx_on; /* pdkv_bf16_amx: every call of this process runs in AMX tiles (k a multiple of 32) */

/* want 1: run in AMX tiles from now on where this build has them and Linux grants them (asked once);
 * 0: in vectors; -1: no change.  Returns the path now in use: 1 tiles, 0 vectors.  The library sets it
 * once as it loads (engine/native.py); the two paths' bits differ. */
int pdkv_bf16_amx(int64_t want) {
#ifdef PDKV_AMX
    if (want < 0) return amx_on;
    amx_on = want && amx_granted() == 1;
#else
    (void)want;
#endif
    return amx_on;
}

static int bf_fma = PDKV_BF16 >= 2; /* pdkv_bf16_fma: the vector calls run FORM_FMA */

/* want 1: the vector path's dot products as FMAs from now on, 0: vdpbf16ps (where the build has it); else
 * no change.  Returns the form in use: 1 FMAs, 0 vdpbf16ps.  The same bits either way (speed only);
 * engine/native.py sets it as the library loads. */
int64_t pdkv_bf16_fma(int64_t want) {
#if PDKV_BF16 == 1
    if (want == 0 || want == 1) bf_fma = (int)want;
#else
    (void)want;
#endif
    return bf_fma;
}

/* 1: this build has the kernels on AVX512-BF16, 2: on plain AVX-512, 3: on AVX2 (simd.h's PDKV_BF16), 0:
 * none. */
int pdkv_bf16_built(void) { return PDKV_BF16; }

int pdkv_bf16_rows(const void *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out) {
    if (n <= 0 || k <= 0 || k % 2) return 2;
    const uint16_t *w = (const uint16_t *)packed;
    uint16_t *o = (uint16_t *)out;
    for (int64_t j = 0; j < count; j++) {
        const int64_t r = ids[j];
        if (r < 0 || r >= n) return 2;
        const uint16_t *g = w + (r / G16) * k * G16;
        for (int64_t i = 0; i < k; i++) o[j * k + i] = g[((i / 2) * G16 + r % G16) * 2 + i % 2];
    }
    return 0;
}

/* The calling thread's side stream: n ranges of `bytes` bytes from base[0 .. n - 1] that its next batch
 * linears (rows > 1) prefetch on the way, each thread a share, a line at each pair of inputs of a tile;
 * (NULL, 0, 0): none.  A batch linear is compute-bound and leaves the memory idle: decode_layer.c
 * streams the next layer's KV blocks in under it, where that layer's attention would wait on them. */
static _Thread_local const char *const *side_base;
static _Thread_local int64_t side_n, side_bytes;

void pdkv_side_stream(const char *const *base, int64_t n, int64_t bytes) {
    side_base = base;
    side_n = n;
    side_bytes = bytes;
}

/* The calling thread's side stream, as pdkv_side_stream set it: quant.c's calls take it too (its
 * batch-1 calls as well, a few lines after each run of groups). */
void pdkv_side_stream_of(const char *const **base, int64_t *n, int64_t *bytes) {
    *base = side_base;
    *n = side_n;
    *bytes = side_bytes;
}

#if PDKV_BF16
/* The two forms of the vector kernel (the same bits, simd.h):
 *   FORM_VDP  vdpbf16ps on the pairs as they come, each row's pair broadcast as one dword (PDKV_BF16 1);
 *   FORM_FMA  two FMAs per pair, the weights split into floats once per vector and the activations widened
 *             to floats a chunk of rows at a time, each element a broadcast memory operand of its FMA
 *             (the 121 linears of a SmolLM2 step, Xeon VM without AVX512-BF16, in-process A/B: 32 rows
 *             47.3 -> 42.8 ms, 8 rows 15.5 -> 14.7 against splitting each pair in registers); run with
 *             DAZ and FTZ, as vdpbf16ps is.  PDKV_BF16 2's only form; with AVX512-BF16 where pdkv_bf16_fma
 *             chose it (engine/native.py, by the vendor): on an Emerald Rapids VM without AMX the FMAs
 *             have twice vdpbf16ps's throughput (decode steps in separate processes alternating, three
 *             rounds: batch 32 71.2 / 63.7 / 68.3 -> 61.3 / 55.1 / 55.0 ms). */
#define FORM_VDP 0
#define FORM_FMA 1
/* Rows of a batch tile: 4 groups x 6 rows = 24 accumulators with vdpbf16ps; 4 x 4 with the FMAs (each
 * weight vector two operands: 16 accumulators and 8 halves; 6 rows measured slower at 8 and 32 rows). */
#define TILE_ROWS_VDP 6
#define TILE_ROWS_FMA 4
/* Groups a tile: 4 -- but on AVX2's halves (16 registers, not 32) one where a tile has 3 rows or more,
 * whose 4 x 4 accumulators would not stay in registers (in-process A/B, AMD EPYC Zen 3, SmolLM2's four
 * layer linears from the caches, both builds alternated: 3 rows 0.90-0.92x the time, 4 rows 0.67-0.69x,
 * 8 to 256 rows 0.65-0.67x; 1 and 2 rows alike either way). */
#ifdef PDKV_ON_AVX2
#define TILE_GROUPS(rows) ((rows) >= 3 ? 1 : 4)
#else
#define TILE_GROUPS(rows) 4
#endif

/* FORM_FMA's activations widened to floats: the thread's buffer, kept across calls (CHUNK_ROWS * k floats
 * at most). */
static _Thread_local void *xf_buf;
static _Thread_local size_t xf_bytes;

#define CHUNK_ROWS 60 /* rows a pass over a thread's groups: their activations stay in L2 meanwhile */

/* Rows m0 .. m1 - 1 of x [rows, k] as the tiles of `form` take them: x itself (bfloat16 pairs), or widened
 * to floats in the thread's buffer; NULL when memory for that runs out. */
static const void *chunk_rows(const uint16_t *x, int64_t m0, int64_t m1, int64_t k, int form) {
    if (form == FORM_VDP) return x + m0 * k;
    const int64_t count = (m1 - m0) * k;
    float *f = (float *)grow_scratch(&xf_buf, &xf_bytes, (size_t)count * sizeof(float));
    if (f == NULL) return NULL;
    widen_bf16(x + m0 * k, f, count);
    return f;
}

INLINE void side_step(LineStream *side) {
    const char *line = line_stream_next(side);
    if (line != NULL) _mm_prefetch(line, SIDE_HINT);
}

/* GT groups from g0 times RT rows of x (FORM's layout: chunk_rows): every output's pairs in input order,
 * then stored.  Inlined with constant GT, RT and FORM (batch_tile: unrolled, accumulators in registers);
 * the arithmetic per output is the same at any GT and RT, and in either form. */
INLINE void tile(const uint16_t *w, int64_t g0, int64_t k, const void *x, const int GT, const int RT,
                 const int FORM, uint16_t *out, int64_t ldo, int64_t col0, int64_t n, LineStream *side) {
    __m512 acc[4][TILE_ROWS_VDP];
    for (int gi = 0; gi < GT; gi++)
        for (int j = 0; j < RT; j++) acc[gi][j] = _mm512_setzero_ps();
    const int64_t half = k / 2;
    const uint16_t *wg[4];
    for (int gi = 0; gi < GT; gi++) wg[gi] = w + (g0 + gi) * k * G16;
    const int nta = bf_nta;
    /* The loops below run one per prefetch hint, and on a copy of the side stream: one loop with the
     * hint chosen inside it, over the caller's stream, kept each step's broadcast pairs in memory (gcc
     * joined the two paths there and stored the six vectors every pair of inputs) -- AMD EPYC Zen 5, the
     * 121 linears of a SmolLM2 step at 32 rows, in-process A/B of the two builds: 644 -> 917 GFLOP/s
     * from the caches, 18.1 -> 12.7 ms from memory (the FMA form: no change; docs/BENCHMARKS.md). */
    LineStream s = side != NULL ? *side : line_stream(NULL, 0, 0);
    if (FORM == FORM_FMA) {
        const float *xr[TILE_ROWS_FMA];
        for (int j = 0; j < RT; j++) xr[j] = (const float *)x + j * k;
#define FMA_LOOP(HINT) \
        for (int64_t p = 0; p < half; p++) { \
            side_step(&s); \
            for (int gi = 0; gi < GT; gi++) { \
                _mm_prefetch((const char *)(wg[gi] + p * 2 * G16) + BF_PREFETCH, HINT); \
                const bf16_split wv = bf16_split_of(_mm512_loadu_si512(wg[gi] + p * 2 * G16)); \
                for (int j = 0; j < RT; j++) acc[gi][j] = bf16_dot_pair(acc[gi][j], wv, xr[j] + 2 * p); \
            } \
        }
        if (nta)
            FMA_LOOP(_MM_HINT_NTA)
        else
            FMA_LOOP(_MM_HINT_T0)
#undef FMA_LOOP
    }
#if PDKV_BF16 == 1
    else {
        const uint16_t *xr[TILE_ROWS_VDP];
        for (int j = 0; j < RT; j++) xr[j] = (const uint16_t *)x + j * k;
#define VDP_LOOP(HINT) \
        for (int64_t p = 0; p < half; p++) { \
            bf16v xv[TILE_ROWS_VDP]; /* each row's pair p: one dword broadcast */ \
            for (int j = 0; j < RT; j++) { \
                int32_t pair; \
                memcpy(&pair, xr[j] + 2 * p, sizeof pair); \
                xv[j] = bf16v_pair(pair); \
            } \
            side_step(&s); \
            for (int gi = 0; gi < GT; gi++) { \
                _mm_prefetch((const char *)(wg[gi] + p * 2 * G16) + BF_PREFETCH, HINT); \
                const bf16v wv = bf16v_load(wg[gi] + p * 2 * G16); \
                for (int j = 0; j < RT; j++) acc[gi][j] = bf16_dot(acc[gi][j], wv, xv[j]); \
            } \
        }
        if (nta)
            VDP_LOOP(_MM_HINT_NTA)
        else
            VDP_LOOP(_MM_HINT_T0)
#undef VDP_LOOP
    }
#endif
    if (side != NULL) *side = s;
    for (int gi = 0; gi < GT; gi++) {
        const int64_t c = (g0 + gi) * G16;
        const int64_t nc = n - c < G16 ? n - c : G16;
        const __mmask16 mask = nc >= G16 ? (__mmask16)0xffff : (__mmask16)((1u << nc) - 1u);
        for (int j = 0; j < RT; j++)
            _mm256_mask_storeu_epi16(out + j * ldo + col0 + c, mask, to_bf16x16(acc[gi][j]));
    }
}

/* Tile i of `tiles` that split `count` items as evenly as they can (the first count % tiles one more). */
INLINE int64_t share(int64_t count, int64_t tiles, int64_t i) { return count / tiles + (i < count % tiles); }

/* tile() with its counts constants: 1 .. 4 groups, 1 .. the form's tile rows -- no accumulator for a
 * group or a row the tile does not have (a 32-row call's last tile of 2 rows computed 6). */
#define ROWS_CASE(GT, RT, FORM) \
    case RT: tile(w, g, k, x, GT, RT, FORM, out, ldo, col0, n, side); break;
#define FMA_GROUPS_CASE(GT) \
    case GT: \
        switch (nr) { ROWS_CASE(GT, 1, FORM_FMA) ROWS_CASE(GT, 2, FORM_FMA) ROWS_CASE(GT, 3, FORM_FMA) \
                      ROWS_CASE(GT, 4, FORM_FMA) } \
        break;
#define VDP_GROUPS_CASE(GT) \
    case GT: \
        switch (nr) { ROWS_CASE(GT, 1, FORM_VDP) ROWS_CASE(GT, 2, FORM_VDP) ROWS_CASE(GT, 3, FORM_VDP) \
                      ROWS_CASE(GT, 4, FORM_VDP) ROWS_CASE(GT, 5, FORM_VDP) ROWS_CASE(GT, 6, FORM_VDP) } \
        break;

INLINE void batch_tile(const uint16_t *w, int64_t g, int64_t k, const void *x, int ng, int nr, int form,
                       uint16_t *out, int64_t ldo, int64_t col0, int64_t n, LineStream *side) {
    if (form == FORM_FMA) {
        switch (ng) { FMA_GROUPS_CASE(1) FMA_GROUPS_CASE(2) FMA_GROUPS_CASE(3) FMA_GROUPS_CASE(4) }
    }
#if PDKV_BF16 == 1
    else {
        switch (ng) { VDP_GROUPS_CASE(1) VDP_GROUPS_CASE(2) VDP_GROUPS_CASE(3) VDP_GROUPS_CASE(4) }
    }
#endif
}
#endif

int pdkv_bf16_linear(const void *x_, int64_t rows, int64_t k, const void *packed, int64_t n, void *out_,
                     int64_t ldo, int64_t col0) {
#if !PDKV_BF16
    (void)x_; (void)rows; (void)k; (void)packed; (void)n; (void)out_; (void)ldo; (void)col0;
    return 1;
#else
    if (n <= 0 || k <= 0 || k % 2 || rows < 0 || ldo < col0 + n) return 2;
    const uint16_t *x = (const uint16_t *)x_, *w = (const uint16_t *)packed;
    uint16_t *out = (uint16_t *)out_;
    const int64_t groups = (n + G16 - 1) / G16;
    const char *const *sbase = side_base;
    const int64_t sn = side_n, sbytes = side_bytes;
    const int form = __atomic_load_n(&bf_fma, __ATOMIC_RELAXED) ? FORM_FMA : FORM_VDP; /* read once */
    int failed = 0;
    /* every thread an even share of the groups (tiles of 4 would leave 576 rows' 36 groups split 5:4) */
#pragma omp parallel if (rows * n * k >= 32768)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
        const int64_t s0 = sn * tid / nt, s1 = sn * (tid + 1) / nt;
        LineStream side = line_stream(sbase ? sbase + s0 : NULL, s1 - s0, sbytes); /* this thread's share */
#ifdef PDKV_AMX
        if (amx_on && k % 32 == 0) {
            amx_rows(x, rows, k, w, g0, g1, out, ldo, col0, n);
        } else
#endif
        {
            /* a batch-1 call takes no side stream (its weights' stream is what the memory is busy with) */
            LineStream *stream = rows > 1 ? &side : NULL;
            const int tile_rows = form == FORM_FMA ? TILE_ROWS_FMA : TILE_ROWS_VDP;
            const unsigned csr = bf16_mode_enter(1); /* simd.h: either form, the same bits */
            for (int64_t m0 = 0; m0 < rows; m0 += CHUNK_ROWS) {
                const int64_t m1 = m0 + CHUNK_ROWS < rows ? m0 + CHUNK_ROWS : rows;
                const char *xs = (const char *)chunk_rows(x, m0, m1, k, form); /* row m0 first */
                if (xs == NULL) {
#pragma omp atomic write
                    failed = 3;
                    break;
                }
                const size_t row_bytes = (size_t)k * (form == FORM_FMA ? sizeof(float) : sizeof(uint16_t));
                const int64_t tg = TILE_GROUPS(m1 - m0), gtiles = (g1 - g0 + tg - 1) / tg;
                const int64_t rtiles = (m1 - m0 + tile_rows - 1) / tile_rows;
                for (int64_t gt = 0, g = g0; gt < gtiles; gt++) {
                    const int ng = (int)share(g1 - g0, gtiles, gt);
                    for (int64_t rt = 0, r = m0; rt < rtiles; rt++) {
                        const int nr = (int)share(m1 - m0, rtiles, rt);
                        const char *xr = xs + (size_t)(r - m0) * row_bytes;
                        batch_tile(w, g, k, xr, ng, nr, form, out + r * ldo, ldo, col0, n, stream);
                        r += nr;
                    }
                    g += ng;
                }
            }
            bf16_mode_leave(1, csr);
        }
    }
    return failed;
#endif
}
