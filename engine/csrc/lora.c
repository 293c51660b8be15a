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
 * tile is one task: u[j, p, r] = <x[t_j], a[s, p, r]> (vdpbf16ps, float32 sums, 16 ranks in the lanes), then for each 16
 * columns of each part sum_r u[j, p, r] * b[s, r, cols] is added to y (rounded once; u rounded to bfloat16
first, as the torch path's matmul output is).  A tile reads its
 * adapter's A and B once for all its rows.  No work for rows without an adapter, none for slots the
 * step does not use: the cost is the adapters' FLOPs, not (slots x rows).
 *
 * Returns 0; 2 for a shape it does not serve (rank or parts over the limits); 1 without AVX512-BF16
 * in this build (the caller keeps the torch path).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "simd.h"

#define TILE 8
#define MAX_RANK 64
#define MAX_PARTS 4

int pdkv_lora_built(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* u[j][q] = <x[t_j], a[q]> for the tile's rows and the pr = P * R rows q of A, A in pairs of input
 * dims (a2[i / 2][q][i % 2]): 16 q at a time in the lanes, each step one broadcast pair of x times 16
 * pairs of A (vdpbf16ps, float32 sums) -- no horizontal sums. */
INLINE void shrink(const uint16_t *x, const int64_t *rows, int n, const uint16_t *a2, int64_t in,
                   int64_t pr, float u[TILE][MAX_PARTS * MAX_RANK]) {
    const int64_t half = in / 2;
    for (int64_t q0 = 0; q0 < pr; q0 += 16) {
        const int64_t left = pr - q0;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        __m512 acc[TILE];
        for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t ip = 0; ip < half; ip++) {
            const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi32(m, a2 + (ip * pr + q0) * 2);
            for (int j = 0; j < n; j++) {
                int32_t xp;
                memcpy(&xp, x + rows[j] * in + 2 * ip, sizeof xp);
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(xp), av);
            }
        }
        for (int j = 0; j < n; j++) _mm512_mask_storeu_ps(&u[j][q0], m, acc[j]);
    }
}

/* y[t_j, c0 .. c1) += sum_r u[j][r] * b[r, c0 .. c1), b in pairs of ranks: b2[r / 2][col][r % 2], and
 * u rounded to bfloat16 pairs (as the torch path rounds it): one vdpbf16ps adds two ranks to 16 columns. */
INLINE void expand(uint16_t *y, const int64_t *rows, int n, const uint16_t *b2, int64_t out, int64_t pairs,
                   int64_t c0, int64_t c1, const uint32_t up[TILE][MAX_RANK / 2]) {
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        __m512 acc[TILE];
        for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t q = 0; q < pairs; q++) {
            const __m512bh bv = (__m512bh)_mm512_loadu_si512(b2 + (q * out + c) * 2);
            for (int j = 0; j < n; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int)up[j][q]), bv);
        }
        for (int j = 0; j < n; j++) {
            uint16_t *yp = y + rows[j] * out + c;
            const __m512 sum = _mm512_add_ps(from_bf16x16(_mm256_loadu_si256((const __m256i *)yp)), acc[j]);
            _mm256_storeu_si256((__m256i *)yp, to_bf16x16(sum));
        }
    }
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
#ifndef __AVX512BF16__
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
    /* rows grouped by slot: order[] holds them, start[s] .. start[s + 1] the rows of slot s */
    int64_t *order = (int64_t *)malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t *start = (int64_t *)calloc((size_t)num_slots + 1, sizeof(int64_t));
    int64_t *tiles = (int64_t *)malloc((size_t)(rows + 1) * sizeof(int64_t));
    if (order == NULL || start == NULL || tiles == NULL) {
        free(order); free(start); free(tiles);
        return 3;
    }
    for (int64_t t = 0; t < rows; t++)
        if (slot[t] >= 0 && slot[t] < num_slots) start[slot[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    {
        int64_t *fill = (int64_t *)malloc((size_t)num_slots * sizeof(int64_t));
        if (fill == NULL) {
            free(order); free(start); free(tiles);
            return 3;
        }
        memcpy(fill, start, (size_t)num_slots * sizeof(int64_t));
        for (int64_t t = 0; t < rows; t++)
            if (slot[t] >= 0 && slot[t] < num_slots) order[fill[slot[t]]++] = t;
        free(fill);
    }
    /* tiles: the first index into order[] of each tile of up to TILE rows of one slot */
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t i = start[s]; i < start[s + 1]; i += TILE) tiles[num_tiles++] = i;
    const int64_t pr = parts * rank;
    const int64_t work = num_tiles * pr * (in + out);
    /* threads from two tiles of SmolLM2's o projection at rank 16 on (32 rows of one adapter: 5.4 -> 3.3 us
     * a call, the down projection 9.2 -> 5.2 us; a parallel region costs ~1 us) */
#pragma omp parallel for schedule(dynamic, 1) if (num_tiles > 1 && work >= 32768)
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
    free(order);
    free(start);
    free(tiles);
    return 0;
#endif
}
