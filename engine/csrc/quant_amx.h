/* quant.c's AMX path for two rows and more: the same integer sums in AMX-INT8 tiles (TDPBSSD) on CPUs
 * with AMX (Intel Sapphire Rapids and later), then the same float operations in the same order -- so its
 * results are the vector kernels' bits, and a row's bits still depend on that row alone (one row runs in
 * vectors, more in tiles: the same bits either way).
 *
 * A block's sum  sum_k q[k] qa[k]  splits exactly into the two signed bytes quantize_row makes of each
 * qa (quant.c's header):
 *
 *     sum q qa = 256 sum q hi + sum q lo,
 *
 * two byte dot products of signed bytes the tiles take with TDPBSSD (q: 0..15 for Q4, -128..127 for Q8;
 * every partial sum far inside int32).
 *
 * Tiles: a block of 32 inputs is a K step: A tiles of up to 16 rows x 32 bytes (the rows' hi or lo bytes
 * of the block, at the activations' row stride of 2 k bytes), a B tile of 8 rows x 64 bytes (row i: for
 * each of the group's 16 outputs, its quants of inputs 4i .. 4i + 3 -- the packed layout's 64-byte run i
 * as it is for Q8, and for Q4 run i's low nibbles in row i and its high ones in row 4 + i), two
 * accumulators of 16 rows x 16 int32 -- zeroed per block, since each block has its own scales.  A thread
 * makes its group's B tiles once per call and runs every row block over them.
 *
 * Measured on an Intel Xeon (Emerald Rapids, 2 cores), SmolLM2's Q4_1 linears: see docs/quantized.md. */

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PDKV_QUANT_AMX 1
#include "amx.h"

#define QAMX_ROWS 128 /* rows per pass over a thread's groups: their hi and lo bytes stay in L2 */

/* Tiles 0 and 1: the row block's hi and lo bytes (m rows x 32 bytes); 2 and 5: the weights of an even and
 * an odd block (8 x 64 bytes); 3, 4 and 6, 7: their hi and lo sums (m rows x 16 int32) -- two blocks in
 * flight, so that one block's sums are read back while the next one's are made. */
static void qamx_configure(int m) {
    const int rows[8] = {m, m, 8, m, m, 8, m, m}, colsb[8] = {32, 32, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(rows, colsb, 8);
}

/* The B tiles of one group (blocks of them, 512 bytes each) from its packed tiles. */
static void qamx_weights(const uint8_t *wg, int64_t fmt, int64_t blocks, uint8_t *bt) {
    const int64_t tb = tile_bytes(fmt);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *t = wg + b * tb;
        uint8_t *o = bt + b * 512;
        _mm_prefetch((const char *)t + PREFETCH, _MM_HINT_T0);
        if (q4_quants(fmt)) {
            for (int i = 0; i < 4; i++) { /* inputs 4i .. 4i + 3 and 16 more */
                const __m512i v = _mm512_loadu_si512((const void *)(t + 64 * i));
                _mm512_store_si512((void *)(o + 64 * i), _mm512_and_si512(v, low));
                _mm512_store_si512((void *)(o + 64 * (4 + i)), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        } else {
            memcpy(o, t, 512);
        }
    }
}

/* Block b's two byte sums into the tiles of its parity (B tile TB, sums TH and TL). */
#define QAMX_ISSUE(b, TB, TH, TL)                                                                          \
    do {                                                                                                   \
        _tile_loadd(0, a.q + (b) * QBLOCK, 2 * k);                                                         \
        _tile_loadd(1, a.q + k + (b) * QBLOCK, 2 * k);                                                     \
        _tile_loadd(TB, bt + (b) * 512, 64);                                                               \
        _tile_zero(TH);                                                                                    \
        _tile_zero(TL);                                                                                    \
        _tile_dpbssd(TH, 0, TB);                                                                           \
        _tile_dpbssd(TL, 1, TB);                                                                           \
    } while (0)

/* Block b's sums (tiles TH, TL) into the rows' float accumulators: group_tile's operations, in its
 * order. */
#define QAMX_ADD(b, TH, TL)                                                                                \
    do {                                                                                                   \
        _tile_stored(TH, sums, 64);                                                                        \
        _tile_stored(TL, sums + 256, 64);                                                                  \
        const uint8_t *t_ = wg + (b) * tb;                                                                 \
        const __m512 d_ = tile_scales(t_ + qb, fmt), m_ = tile_mins(t_ + qb, fmt);                         \
        for (int j = 0; j < m; j++) {                                                                      \
            const __m512i s_ = _mm512_add_epi32(                                                           \
                _mm512_slli_epi32(_mm512_load_si512((const void *)(sums + 16 * j)), 8),                    \
                _mm512_load_si512((const void *)(sums + 256 + 16 * j)));                                   \
            const float dj_ = a.da[j * blocks + (b)], sj_ = a.sa[j * blocks + (b)];                        \
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_), _mm512_mul_ps(d_, _mm512_set1_ps(dj_)), acc[j]); \
            acc[j] = _mm512_fmadd_ps(m_, _mm512_set1_ps(sj_), acc[j]);                                     \
        }                                                                                                  \
    } while (0)

/* Rows 0 .. m - 1 (m <= 16) of a's rows over one group (B tiles bt, its scales in the packed tiles wg):
 * out's 16 columns from col, ncols of them real. */
INLINE void qamx_block(const uint8_t *wg, const uint8_t *bt, int64_t fmt, int64_t blocks, Acts a, int64_t k,
                       int m, void *out, int64_t ldo, int64_t col, int64_t ncols, int64_t out_bf16,
                       int32_t *sums) {
    __m512 acc[16];
    for (int j = 0; j < m; j++) acc[j] = _mm512_setzero_ps();
    const int64_t tb = tile_bytes(fmt), qb = quant_bytes(fmt);
    for (int64_t b = 0; b < blocks; b += 2) {
        QAMX_ISSUE(b, 2, 3, 4);
        if (b + 1 < blocks) QAMX_ISSUE(b + 1, 5, 6, 7);
        QAMX_ADD(b, 3, 4);
        if (b + 1 < blocks) QAMX_ADD(b + 1, 6, 7);
    }
    store_tile(acc, m, out, ldo, col, ncols, out_bf16);
}

/* One thread's groups g0 .. g1 for a's rows 0 .. rows - 1.  Returns 3 when its B tiles' buffer cannot be
 * had. */
static int qamx_rows(const uint8_t *packed, int64_t fmt, int64_t k, int64_t n_out, int64_t g0, int64_t g1, Acts a,
                     int64_t rows, void *out, int64_t ldo, int64_t out_bf16) {
    static _Thread_local void *btiles;
    static _Thread_local size_t btiles_bytes;
    const int64_t blocks = k / QBLOCK, tb = tile_bytes(fmt), osize = out_bf16 ? 2 : 4;
    uint8_t *raw = grow_scratch(&btiles, &btiles_bytes, (size_t)blocks * 512 + 64);
    if (raw == NULL) return 3;
    uint8_t *bt = (uint8_t *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
    int32_t sums[512] __attribute__((aligned(64)));
    int m_now = -1;
    for (int64_t m0 = 0; m0 < rows; m0 += QAMX_ROWS) {
        const int64_t m1 = m0 + QAMX_ROWS < rows ? m0 + QAMX_ROWS : rows;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *wg = packed + g * blocks * tb;
            qamx_weights(wg, fmt, blocks, bt);
            const int64_t col = g * GROUP, ncols = n_out - col < GROUP ? n_out - col : GROUP;
            for (int64_t r = m0; r < m1; r += 16) {
                const int m = (int)(m1 - r < 16 ? m1 - r : 16);
                if (m != m_now) qamx_configure(m_now = m);
                qamx_block(wg, bt, fmt, blocks, acts_from(a, r, k), k, m, (char *)out + r * ldo * osize, ldo,
                           col, ncols, out_bf16, sums);
            }
        }
    }
    if (m_now >= 0) _tile_release();
    return 0;
}

/* Whether the tiles serve quant.c's calls: 1 ask Linux for them (once) and use them if granted, 0 do not,
 * -1 no change.  Returns the state now.  Both give the same bits. */
static int qamx_on;
int pdkv_quant_amx(int64_t want) {
    if (want < 0) return qamx_on;
    qamx_on = want && amx_granted() == 1;
    return qamx_on;
}
#endif
