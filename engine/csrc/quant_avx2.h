/* quant.c's kernels for CPUs with AVX2 (+ FMA, F16C) and no AVX512-VNNI: the same packed layout, the
 * same int16 activations and the same arithmetic, so the same bits as the AVX-512 kernels.
 *
 * A group's 16 output rows are two halves of 8 lanes (rows 0-7, 8-15).  The AVX-512 kernels sum a row's
 * products by bytes (qa's hi and lo); here the int16 qa itself goes into vpmaddwd: 16 bytes of a 64-byte
 * run of the packed layout (4 rows' quants of 4 consecutive inputs) widen to 16 int16, and each int32 lane
 * of the product with the 4 activations broadcast holds one row's sum over two of the inputs -- the two
 * lanes of a row added at the block's end (vphaddd).  The integer sums are exact either way (quants are
 * at most 8 bits, activations 16: no pair overflows), and the float operations per lane -- the block's
 * scale, then its min term, fused multiply-adds in block order -- are the AVX-512 kernels' own.  Only
 * included by quant.c, after its helpers. */
#ifndef PDKV_QUANT_AVX2_H
#define PDKV_QUANT_AVX2_H

#include <immintrin.h>

/* 8 bfloat16 (as bits) widened to floats: exact. */
INLINE __m256 from_bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 floats rounded to bfloat16 bits (nearest even, NaN stays NaN: simd.h's bf16_rne16), as int32. */
INLINE __m256i bf16_bits8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_srli_epi32(r, 16);
}

/* Two vectors of 8 int32 as 16 int16 in order (signed saturation, as _mm512_cvtsepi32_epi16). */
INLINE __m256i pack16(__m256i lo, __m256i hi) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
}

INLINE int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0x4e));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0xb1));
    return _mm_cvtss_f32(m);
}

/* quant.c's quantize_row: row x's blocks of 32 to int16 qa (at q: this build's layout), their sums in
 * is (and their first halves' in ih), their steps da and da * sum(qa) in sa. */
static void quantize_row(const void *x, int64_t in_bf16, int64_t k, uint8_t *q, int32_t *is, int32_t *ih,
                         float *da, float *sa) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i top = _mm256_set1_epi32(QA_MAX), bottom = _mm256_set1_epi32(-QA_MAX);
    int16_t *qa = (int16_t *)q;
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            if (in_bf16) {
                v[i] = from_bf16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + b * QBLOCK + 8 * i)));
            } else {
                v[i] = _mm256_loadu_ps((const float *)x + b * QBLOCK + 8 * i);
            }
        }
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float amax = hmax8(a);
        const float d = amax / (float)QA_MAX;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++) {
            qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            qi[i] = _mm256_min_epi32(_mm256_max_epi32(qi[i], bottom), top);
        }
        _mm256_storeu_si256((__m256i *)(qa + b * QBLOCK), pack16(qi[0], qi[1]));
        _mm256_storeu_si256((__m256i *)(qa + b * QBLOCK + 16), pack16(qi[2], qi[3]));
        const int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
        is[b] = sum;
        ih[b] = hsum8(_mm256_add_epi32(qi[0], qi[1]));
        da[b] = d;
        sa[b] = d * (float)sum;
    }
}

/* The 16 bytes at `at` of a tile's 64-byte run p (four rows' four quants each: rows 4i .. 4i + 3 at
 * offset 16 i) as int16: Q4's low nibbles (quad p) into *lo and high ones (quad p + 4) into *hi; Q8's
 * signed quants (quad p). */
INLINE void q4_piece(const uint8_t *at, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)at));
    *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
    *hi = _mm256_srli_epi16(v, 4);
}

INLINE __m256i q8_piece(const uint8_t *at) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at)); }

/* Quads of rows 8h .. 8h + 3 and 8h + 4 .. 8h + 7 of a tile, as int16: w[2p + i] holds rows 8h + 4i ..
 * 8h + 4i + 3's quants of inputs 4p .. 4p + 3 (p < 8), four to a row -- Q4's from the low nibbles of run
 * p (p < 4) or the high ones of run p - 4, Q8's from run p. */
INLINE void load_quads_half(const uint8_t *t, int64_t fmt, int h, __m256i w[16]) {
    if (q4_quants(fmt)) {
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < 2; i++) q4_piece(t + 64 * p + 32 * h + 16 * i, &w[2 * p + i], &w[2 * (p + 4) + i]);
    } else {
        for (int p = 0; p < 8; p++)
            for (int i = 0; i < 2; i++) w[2 * p + i] = q8_piece(t + 64 * p + 32 * h + 16 * i);
    }
}

/* Lanes 8h .. 8h + 7's scales d of a tile as floats (scales: its bytes after the quants; float16, or
 * float32 for Q4F, Q8F and Q8H). */
INLINE __m256 half_scales(const uint8_t *scales, int64_t fmt, int h) {
    return float_scales(fmt) ? _mm256_loadu_ps((const float *)(scales + 32 * h))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * h)));
}

/* The mins, or Q8H's second scales (inputs 16-31). */
INLINE __m256 half_mins(const uint8_t *scales, int64_t fmt, int h) {
    return float_scales(fmt) ? _mm256_loadu_ps((const float *)(scales + 64 + 32 * h))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * h)));
}

/* The 4 int16 activations of inputs 4p .. 4p + 3 in every 64-bit lane. */
INLINE __m256i act_quad(const int16_t *a, int p) {
    int64_t v;
    memcpy(&v, a + 4 * p, sizeof v);
    return _mm256_set1_epi64x(v);
}

/* Eight rows' sums from the lanes of two quads' products (x: rows 0-3, y: rows 4-7, each row's two
 * lanes side by side), in row order. */
INLINE __m256i row_sums(__m256i x, __m256i y) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(x, y), 0xd8);
}

/* acc[j][h] (16 columns from col, ncols of them real) into rows 0 .. nrows - 1 of out. */
INLINE void store_tile2(__m256 acc[][2], int nrows, void *out, int64_t ldo, int64_t col, int64_t ncols,
                        int64_t out_bf16) {
    for (int j = 0; j < nrows; j++) {
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + j * ldo + col;
            const __m256i bits = _mm256_permute4x64_epi64(
                _mm256_packus_epi32(bf16_bits8(acc[j][0]), bf16_bits8(acc[j][1])), 0xd8);
            if (ncols >= GROUP) {
                _mm256_storeu_si256((__m256i *)o, bits);
            } else {
                uint16_t tmp[GROUP];
                _mm256_storeu_si256((__m256i *)tmp, bits);
                memcpy(o, tmp, (size_t)ncols * sizeof(uint16_t));
            }
        } else {
            float *o = (float *)out + j * ldo + col;
            if (ncols >= GROUP) {
                _mm256_storeu_ps(o, acc[j][0]);
                _mm256_storeu_ps(o + 8, acc[j][1]);
            } else {
                float tmp[GROUP];
                _mm256_storeu_ps(tmp, acc[j][0]);
                _mm256_storeu_ps(tmp + 8, acc[j][1]);
                memcpy(o, tmp, (size_t)ncols * sizeof(float));
            }
        }
    }
}

/* A Q8H block's two halves (sums s0 of inputs 0-15, s1 of 16-31): quant.c's add_halves. */
INLINE __m256 add_halves(__m256 acc, __m256i s0, __m256i s1, __m256 d0, __m256 d1, float dj) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, _mm256_set1_ps(dj)), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, _mm256_set1_ps(dj)), acc);
}

/* The block's scale term then its min term, per lane as the AVX-512 kernels do them. */
INLINE __m256 add_block(__m256 acc, __m256i s, __m256 d, __m256 m, float dj, float sj) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dj)), acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(sj), acc);
}

/* quant.c's group_tile: rows 0 .. nrows - 1 (nrows <= MT) of a's rows over one group, every block. */
INLINE void group_tile(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, int64_t k, int nrows, void *out,
                       int64_t ldo, int64_t col, int64_t ncols, int64_t out_bf16) {
    __m256 acc[MT][2];
    for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    const int64_t tb = tile_bytes(fmt), qb = quant_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *t = wg + b * tb;
        for (int64_t line = 0; line < tb; line += 64) _mm_prefetch((const char *)t + PREFETCH + line, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i w[16];
            load_quads_half(t, fmt, h, w);
            const __m256 d = half_scales(t + qb, fmt, h), m = half_mins(t + qb, fmt, h);
            for (int j = 0; j < nrows; j++) {
                const int16_t *qa = (const int16_t *)(a.q + 2 * j * k) + b * QBLOCK;
                __m256i x[2], y[2]; /* inputs 0-15, 16-31 (Q8H scales them apart; the others add them) */
                for (int half = 0; half < 2; half++) {
                    x[half] = y[half] = _mm256_setzero_si256();
                    for (int p = 4 * half; p < 4 * half + 4; p++) {
                        const __m256i ap = act_quad(qa, p);
                        x[half] = _mm256_add_epi32(x[half], _mm256_madd_epi16(w[2 * p], ap));
                        y[half] = _mm256_add_epi32(y[half], _mm256_madd_epi16(w[2 * p + 1], ap));
                    }
                }
                const int64_t s = j * blocks + b;
                if (fmt == FMT_Q8H)
                    acc[j][h] = add_halves(acc[j][h], row_sums(x[0], y[0]), row_sums(x[1], y[1]), d, m, a.da[s]);
                else
                    acc[j][h] = add_block(acc[j][h],
                                          row_sums(_mm256_add_epi32(x[0], x[1]), _mm256_add_epi32(y[0], y[1])), d,
                                          m, a.da[s], a.sa[s]);
            }
        }
    }
    store_tile2(acc, nrows, out, ldo, col, ncols, out_bf16);
}

/* quant.c's group_row1: one activation row of one group, streamed without holding the tile: both halves
 * in one pass, so each activation quad is broadcast once per block, not once per half. */
INLINE void group_row1_one(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, void *out, int64_t col,
                           int64_t ncols, int64_t out_bf16) {
    __m256 acc[1][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
    const int64_t tb = tile_bytes(fmt), qb = quant_bytes(fmt), near = row_prefetch[0], far = row_prefetch[1];
    const int nta = row_prefetch[2] != 0;
    const int16_t *qa = (const int16_t *)a.q;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *t = wg + b * tb;
        prefetch_tile(t, tb, near, far, nta); /* quant.c's row_prefetch, as the AVX-512 kernel does */
        const int16_t *ab = qa + b * QBLOCK;
        __m256i s[4], s1[4]; /* rows 4i .. 4i + 3; s1: Q8H's inputs 16-31 apart */
        for (int i = 0; i < 4; i++) s[i] = s1[i] = _mm256_setzero_si256();
        if (q4_quants(fmt)) {
            for (int p = 0; p < 4; p++) { /* inputs 4p .. 4p + 3 (low nibbles) and 16 + 4p .. (high) */
                const __m256i lo_quad = act_quad(ab, p), hi_quad = act_quad(ab, p + 4);
                for (int i = 0; i < 4; i++) {
                    __m256i lo, hi;
                    q4_piece(t + 64 * p + 16 * i, &lo, &hi);
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(lo, lo_quad));
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(hi, hi_quad));
                }
            }
        } else if (fmt == FMT_Q8H) {
            for (int p = 0; p < 4; p++) {
                const __m256i lo_quad = act_quad(ab, p), hi_quad = act_quad(ab, p + 4);
                for (int i = 0; i < 4; i++) {
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(q8_piece(t + 64 * p + 16 * i), lo_quad));
                    s1[i] = _mm256_add_epi32(s1[i], _mm256_madd_epi16(q8_piece(t + 64 * (p + 4) + 16 * i), hi_quad));
                }
            }
        } else {
            for (int p = 0; p < 8; p++) {
                const __m256i quad = act_quad(ab, p);
                for (int i = 0; i < 4; i++)
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(q8_piece(t + 64 * p + 16 * i), quad));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = half_scales(t + qb, fmt, h), m = half_mins(t + qb, fmt, h);
            if (fmt == FMT_Q8H)
                acc[0][h] = add_halves(acc[0][h], row_sums(s[2 * h], s[2 * h + 1]), row_sums(s1[2 * h], s1[2 * h + 1]),
                                       d, m, a.da[b]);
            else
                acc[0][h] = add_block(acc[0][h], row_sums(s[2 * h], s[2 * h + 1]), d, m, a.da[b], a.sa[b]);
        }
    }
    store_tile2(acc, 1, out, 0, col, ncols, out_bf16);
}

/* NG (1 to 4) consecutive groups, one after the other (quant.c's signature). */
INLINE void group_row1(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, int64_t k, void *out,
                       int64_t col, int64_t n_out, int64_t out_bf16, const int NG) {
    (void)k;
    for (int gi = 0; gi < NG; gi++) {
        const int64_t c = col + gi * GROUP;
        group_row1_one(wg + gi * blocks * tile_bytes(fmt), fmt, blocks, a, out, c,
                       n_out - c < GROUP ? n_out - c : GROUP, out_bf16);
    }
}

#endif
