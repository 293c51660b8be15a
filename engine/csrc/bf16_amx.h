/* bf16_linear.c's AMX path: the same packed weights, multiplied in AMX tiles (TDPBF16PS) on CPUs with
 * AMX-BF16 (Intel Sapphire Rapids and later), where AVX512-BF16's vdpbf16ps runs at a quarter of the rate
 * or less from 8 rows up (measured: about 200 GFLOP/s on 2 cores against 600-1900 for the tiles).
 *
 * The packed layout is already a B tile's: for a group of 16 outputs and pair p of inputs, 64 bytes hold
 * the 16 outputs' two weights -- 16 pairs are a 16 x 64-byte tile at stride 64.  A row's inputs are an A
 * tile's row as they lie (32 bfloat16 per K step, stride k).  Each output sums its K steps in input order
 * in one tile accumulator, whatever the number of rows in the call, the block a row lands in (a block's
 * rows are independent in TDPBF16PS) or the threads: batch-invariant, as the vector path.  The bits are
 * not the vector path's (measured: about 3 in 4 outputs of 576-long sums differ in their last bits; the
 * tiles do not round as vdpbf16ps's pairs do), so a process runs one path for every call (pdkv_bf16_amx)
 * and the KV namespace names the tiles (engine/determinism.kv_fingerprint).
 *
 * Linux hands the tiles' 8 KB of state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM). */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDKV_AMX 1
#include "amx.h"

#define AMX_ROW_CHUNK 128 /* rows whose activations stay in L2 while a thread's groups stream past */

/* Tiles: 0..3 accumulators (row block a or b x group 0 or 1), 4 and 5 the two row blocks' inputs, 6 and
 * 7 the two groups' weights.  ra and rb rows in the two blocks (rb may be 0: block b unused). */
static void amx_configure(int ra, int rb) {
    const int rows[8] = {ra, ra, rb, rb, ra, rb, 16, 16}, colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(rows, colsb, 8);
}

/* Accumulator tile T's rows (nr of them, 16 outputs each, column c of n) to bfloat16 out. */
#define AMX_STORE(T, nr, orow, c)                                                                          \
    do {                                                                                                   \
        _tile_stored(T, buf, 64);                                                                          \
        const int64_t nc_ = n - (c) < G16 ? n - (c) : G16;                                                 \
        const __mmask16 mask_ = (__mmask16)(nc_ >= G16 ? 0xffffu : (1u << nc_) - 1u);                      \
        for (int j_ = 0; j_ < (nr); j_++)                                                                  \
            _mm256_mask_storeu_epi16((orow) + j_ * ldo + col0 + (c), mask_,                                \
                                     to_bf16x16(_mm512_load_ps(buf + j_ * 16)));                           \
    } while (0)

/* Rows r.. (ra + rb of them, rb 0 or up to 16 more) times groups g, g + 1 (two: both, else one). */
INLINE void amx_block(const uint16_t *x, int64_t k, const uint16_t *w, int64_t g, const int two,
                      const int rb_on, int ra, int rb, uint16_t *out, int64_t ldo, int64_t col0, int64_t n,
                      float *buf) {
    const int64_t xs = k * 2, steps = k / 32;
    const uint16_t *w0 = w + g * k * G16, *w1 = w0 + k * G16;
    const uint16_t *xa = x, *xb = x + 16 * k;
    _tile_zero(0);
    if (two) _tile_zero(1);
    if (rb_on) _tile_zero(2);
    if (rb_on && two) _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, xa + s * 32, xs);
        _tile_loadd(6, w0 + s * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + s * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rb_on) {
            _tile_loadd(5, xb + s * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t c0 = g * G16, c1 = c0 + G16;
    AMX_STORE(0, ra, out, c0);
    if (two) AMX_STORE(1, ra, out, c1);
    if (rb_on) AMX_STORE(2, rb, out + 16 * ldo, c0);
    if (rb_on && two) AMX_STORE(3, rb, out + 16 * ldo, c1);
}

/* One thread's groups g0..g1 for every row: rows in chunks, each chunk in blocks of up to 32. */
static void amx_rows(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t g0, int64_t g1,
                     uint16_t *out, int64_t ldo, int64_t col0, int64_t n) {
    float buf[16 * 16] __attribute__((aligned(64)));
    int ra_now = -1, rb_now = -1;
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROW_CHUNK) {
        const int64_t m1 = m0 + AMX_ROW_CHUNK < rows ? m0 + AMX_ROW_CHUNK : rows;
        for (int64_t g = g0; g < g1; g += 2) {
            const int two = g + 1 < g1;
            for (int64_t r = m0; r < m1; r += 32) {
                const int ra = (int)(m1 - r < 16 ? m1 - r : 16);
                const int rb = (int)(m1 - r - ra < 16 ? m1 - r - ra : 16);
                if (ra != ra_now || rb != rb_now) amx_configure(ra_now = ra, rb_now = rb);
                const uint16_t *xr = x + r * k;
                uint16_t *orow = out + r * ldo;
                if (rb && two)
                    amx_block(xr, k, w, g, 1, 1, ra, rb, orow, ldo, col0, n, buf);
                else if (rb)
                    amx_block(xr, k, w, g, 0, 1, ra, rb, orow, ldo, col0, n, buf);
                else if (two)
                    amx_block(xr, k, w, g, 1, 0, ra, 0, orow, ldo, col0, n, buf);
                else
                    amx_block(xr, k, w, g, 0, 0, ra, 0, orow, ldo, col0, n, buf);
            }
        }
    }
    if (ra_now >= 0) _tile_release();
}
#endif
