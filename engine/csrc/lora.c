/* LoRA deltas of a mixed batch, segmented by adapter: one call per module, whatever the adapters.
 *
 *   pdkv_lora_bf16   y[t, :] += B[s_t] (A[s_t] x[t, :])   for every row t whose slot s_t >= 0
 *
 * Layouts (bfloat16, contiguous; engine/lora/layers.py keeps them):
 *   x [T, in]             the module's input rows
 *   y [T, out]            its output (the base linear's), updated in place
 *   slot [T] int64        each row's adapter slot, -1 for none
 *   a [S, in/2, P*R, 2]   per slot, the fused parts' (q, k, v: P = 3) rank-R down projections, rows
 *                         p * R + r, in pairs of input dims (in even): the layout vdpbf16ps reads
 *   b [S, R/2, out, 2]    per slot, the up projections of the parts side by side (the columns
 *                         part_start[p] .. part_start[p + 1] - 1 belong to part p, scaling folded in),
 *                         ranks in pairs (R even): the layout vdpbf16ps reads
 *
 * Rows are grouped by slot (a counting sort), then cut into tiles of up to TILE rows of one slot; each
 * tile is one task: u[j, p, r] = <x[t_j], a[s, p, r]> (vdpbf16ps, float32 sums, 16 ranks in the lanes,
 * up to 48 side by side in one pass over A), then for each 32 or 16 columns of each part
 * sum_r u[j, p, r] * b[s, r, cols] is added to y (rounded once; u rounded to bfloat16 first, as the torch
 * path's matmul output is).  A tile reads its adapter's A and B once for all its rows.  No work for rows
 * without an adapter, none for slots the step does not use: the cost is the adapters' FLOPs, not
 * (slots x rows).  Each output's sums run in one order fixed by the shapes alone (over the input pairs,
 * then over the rank pairs, from zero): a row's bits do not depend on the tile, the batch or the threads.
 *
 * Returns 0; 2 for a shape it does not serve (rank or parts over the limits); 1 without AVX-512
 * in this build (the caller keeps the torch path).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "simd.h"

#define TILE 8
/* Software prefetch distances: the adapters' A and B come from memory (a step's base weights evict them),
 * in short streams (~80 KB a module) that the hardware prefetchers pick up late.  SmolLM2 at rank 16, 32
 * rows of one adapter, every module's weights evicted (AMD EPYC Zen 5): 1.80 -> 1.47 ms a step's 120
 * calls.  Addresses past an array's end are only prefetched (never loaded), as integers. */
#define AHEAD_PAIRS 16
#define AHEAD_COLUMNS 128
#define MAX_RANK 64
#define MAX_PARTS 4

int pdkv_lora_built(void) { return PDKV_BF16 != 0; }

#if PDKV_BF16
INLINE void prefetch_at(const void *p, int64_t bytes) {
    _mm_prefetch((const char *)((uintptr_t)p + (uintptr_t)bytes), _MM_HINT_T0);
}

/* u[j][q0 + 16 v + l] = <x[t_j], a[q0 + 16 v + l]> for the tile's rows and NV (1..3) vectors of 16 q,
 * A in pairs of input dims (a2[i / 2][q][i % 2]): one pass over A's input pairs reads the NV vectors of
 * each pair side by side (A's rows for these q, in order), each broadcast pair of x feeds all NV of them
 * (vdpbf16ps, float32 sums, 16 q in the lanes) -- no horizontal sums.  Each lane sums over the input
 * pairs in order from zero, whatever NV or the tile. */
INLINE void shrink_pass(const uint16_t *const *xr, const int n, const uint16_t *a2, int64_t half,
                        int64_t pr, int64_t q0, const int nv, float u[TILE][MAX_PARTS * MAX_RANK]) {
    __mmask16 m[3];
    for (int v = 0; v < nv; v++) {
        const int64_t left = pr - q0 - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    }
    __m512 acc[TILE][3];
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
    const uint16_t *ap = a2 + q0 * 2;
    for (int64_t ip = 0; ip < half; ip++, ap += pr * 2) {
        bf16v av[3];
        for (int v = 0; v < nv; v++) av[v] = bf16v_of(_mm512_maskz_loadu_epi32(m[v], ap + 32 * v));
        for (int v = 0; v < nv; v++) prefetch_at(ap, (AHEAD_PAIRS * pr * 2 + 32 * v) * 2);
        for (int j = 0; j < n; j++) {
            int32_t xp;
            memcpy(&xp, xr[j] + 2 * ip, sizeof xp);
            const bf16v xb = bf16v_pair(xp);
            for (int v = 0; v < nv; v++) acc[j][v] = bf16_dot(acc[j][v], xb, av[v]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(&u[j][q0 + 16 * v], m[v], acc[j][v]);
}

/* u[j][q] = <x[t_j], a[q]> for the pr = P * R rows q of A: passes of up to 3 vectors of 16 q (with 8
 * rows, 24 accumulators: the registers hold them). */
INLINE void shrink(const uint16_t *x, const int64_t *rows, const int n, const uint16_t *a2, int64_t in,
                   int64_t pr, float u[TILE][MAX_PARTS * MAX_RANK]) {
    const uint16_t *xr[TILE];
    for (int j = 0; j < n; j++) xr[j] = x + rows[j] * in;
    for (int64_t q0 = 0; q0 < pr; q0 += 48) {
        const int64_t vectors = (pr - q0 + 15) / 16;
        if (vectors >= 3)
            shrink_pass(xr, n, a2, in / 2, pr, q0, 3, u);
        else if (vectors == 2)
            shrink_pass(xr, n, a2, in / 2, pr, q0, 2, u);
        else
            shrink_pass(xr, n, a2, in / 2, pr, q0, 1, u);
    }
}

/* NV (1 or 2) chunks of 16 columns from c: acc = sum over the rank pairs in order, from zero, then
 * y += acc (rounded once).  Each broadcast pair of u feeds the NV chunks. */
INLINE void expand_chunks(uint16_t *const *yr, const int n, const uint16_t *b2, int64_t out, int64_t pairs,
                          int64_t c, const int nv, const uint32_t up[TILE][MAX_RANK / 2]) {
    __m512 acc[TILE][2];
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; q++) {
        bf16v bv[2];
        for (int v = 0; v < nv; v++) {
            const uint16_t *bp = b2 + (q * out + c + 16 * v) * 2;
            bv[v] = bf16v_load(bp);
            prefetch_at(bp, AHEAD_COLUMNS * 4);
        }
        for (int j = 0; j < n; j++) {
            const bf16v ub = bf16v_pair((int32_t)up[j][q]);
            for (int v = 0; v < nv; v++) acc[j][v] = bf16_dot(acc[j][v], ub, bv[v]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) {
            uint16_t *yp = yr[j] + c + 16 * v;
            const __m512 old = from_bf16x16(_mm256_loadu_si256((const __m256i *)yp));
            _mm256_storeu_si256((__m256i *)yp, to_bf16x16(_mm512_add_ps(old, acc[j][v])));
        }
}

/* y[t_j, c0 .. c1) += sum_r u[j][r] * b[r, c0 .. c1), b in pairs of ranks: b2[r / 2][col][r % 2], and
 * u rounded to bfloat16 pairs (as the torch path rounds it): one vdpbf16ps adds two ranks to 16 columns,
 * 32 columns at a time (16 accumulators with 8 rows), then 16, then the columns left one by one. */
INLINE void expand(uint16_t *y, const int64_t *rows, int n, const uint16_t *b2, int64_t out, int64_t pairs,
                   int64_t c0, int64_t c1, const uint32_t up[TILE][MAX_RANK / 2]) {
    uint16_t *yr[TILE];
    for (int j = 0; j < n; j++) yr[j] = y + rows[j] * out;
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) expand_chunks(yr, n, b2, out, pairs, c, 2, up);
    for (; c + 16 <= c1; c += 16) expand_chunks(yr, n, b2, out, pairs, c, 1, up);
    for (; c < c1; c++) {
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t q = 0; q < pairs; q++) {
                const uint16_t lo = (uint16_t)(up[j][q] & 0xffffu), hi = (uint16_t)(up[j][q] >> 16);
                s += bf16_to_f32(lo) * bf16_to_f32(b2[(q * out + c) * 2]);
                s += bf16_to_f32(hi) * bf16_to_f32(b2[(q * out + c) * 2 + 1]);
            }
            uint16_t *yp = y + rows[j] * out + c;
            *yp = f32_to_bf16(bf16_to_f32(*yp) + s);
        }
    }
}

/* One tile: n rows of slot s. */
INLINE void lora_tile(const uint16_t *x, uint16_t *y, const int64_t *rows, const int n, const uint16_t *a,
                      const uint16_t *b, int64_t s, int64_t in, int64_t out, int64_t parts,
                      const int64_t *part_start, int64_t rank) {
    const int64_t pr = parts * rank;
    float u[TILE][MAX_PARTS * MAX_RANK];
    shrink(x, rows, n, a + s * pr * in, in, pr, u);
    const uint16_t *bs = b + s * rank * out;
    for (int64_t p = 0; p < parts; p++) {
        uint32_t up[TILE][MAX_RANK / 2];
        for (int j = 0; j < n; j++)
            for (int64_t q = 0; q < rank / 2; q++)
                up[j][q] = (uint32_t)f32_to_bf16(u[j][p * rank + 2 * q]) |
                           ((uint32_t)f32_to_bf16(u[j][p * rank + 2 * q + 1]) << 16);
        expand(y, rows, n, bs, out, rank / 2, part_start[p], part_start[p + 1], up);
    }
}
#endif

int pdkv_lora_bf16(const void *x_, void *y_, const int64_t *slot, const void *a_, const void *b_,
                   int64_t rows, int64_t in, int64_t out, int64_t parts, const int64_t *part_start,
                   int64_t rank, int64_t num_slots) {
#if !PDKV_BF16
    (void)x_; (void)y_; (void)slot; (void)a_; (void)b_; (void)rows; (void)in; (void)out; (void)parts;
    (void)part_start; (void)rank; (void)num_slots;
    return 1;
#else
    if (rank <= 0 || rank > MAX_RANK || rank % 2 || parts <= 0 || parts > MAX_PARTS || num_slots <= 0 ||
        in % 2)
        return 2;
    const uint16_t *x = (const uint16_t *)x_;
    uint16_t *y = (uint16_t *)y_;
    const uint16_t *a = (const uint16_t *)a_;
    const uint16_t *b = (const uint16_t *)b_;
    /* rows grouped by slot: order[] holds them, start[s] .. start[s + 1] the rows of slot s; one block for
     * the lists (on the stack for a decode step's few rows: no allocation per call) */
    int64_t local[1024];
    const int64_t need = 2 * (rows + 1) + 2 * num_slots + 1;
    int64_t *lists = need <= 1024 ? local : (int64_t *)malloc((size_t)need * sizeof(int64_t));
    if (lists == NULL) return 3;
    int64_t *order = lists, *tiles = lists + rows + 1, *start = lists + 2 * (rows + 1);
    int64_t *fill = start + num_slots + 1;
    memset(start, 0, (size_t)(num_slots + 1) * sizeof(int64_t));
    for (int64_t t = 0; t < rows; t++)
        if (slot[t] >= 0 && slot[t] < num_slots) start[slot[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    memcpy(fill, start, (size_t)num_slots * sizeof(int64_t));
    for (int64_t t = 0; t < rows; t++)
        if (slot[t] >= 0 && slot[t] < num_slots) order[fill[slot[t]]++] = t;
    /* tiles: the first index into order[] of each tile of up to TILE rows of one slot */
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t i = start[s]; i < start[s + 1]; i += TILE) tiles[num_tiles++] = i;
    const int64_t pr = parts * rank;
    const int64_t work = num_tiles * pr * (in + out);
    /* threads from two tiles of SmolLM2's o projection at rank 16 on (32 rows of one adapter: 5.4 -> 3.3 us
     * a call, the down projection 9.2 -> 5.2 us; a parallel region costs ~1 us) */
#pragma omp parallel if (num_tiles > 1 && work >= 32768)
    {
    const unsigned csr = bf16_mode_enter(1);
#pragma omp for schedule(dynamic, 1) nowait /* the region's end is the barrier */
    for (int64_t k = 0; k < num_tiles; k++) {
        const int64_t i = tiles[k];
        const int64_t s = slot[order[i]];
        int64_t end = start[s + 1];
        const int n = (int)(end - i < TILE ? end - i : TILE);
        /* n as a constant where it can be (a full tile, half of one): the row loops unroll and the
         * accumulators stay in registers */
        if (n == TILE)
            lora_tile(x, y, order + i, TILE, a, b, s, in, out, parts, part_start, rank);
        else if (n == TILE / 2)
            lora_tile(x, y, order + i, TILE / 2, a, b, s, in, out, parts, part_start, rank);
        else
            lora_tile(x, y, order + i, n, a, b, s, in, out, parts, part_start, rank);
    }
    bf16_mode_leave(1, csr);
    }
    if (lists != local) free(lists);
    return 0;
#endif
}
