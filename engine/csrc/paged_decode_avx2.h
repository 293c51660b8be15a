/* paged_decode.c's decode attention for CPUs with AVX2 + FMA and no AVX-512: head_avx's two passes on
 * 8 lanes.  Without it such a CPU ran the plain loops, whose float sums the compiler may not reorder
 * (no -ffast-math), so every score was a scalar dot product and every key row a memcpy first: 100 us a
 * layer at 160 keys of SmolLM2's heads on an AVX2 EPYC, a fifth of a batch-1 step.
 *
 *   scores   8 keys at a time, each a chain of fused multiply-adds over its head_dim / 8 vectors, the 8
 *            sums by a reduction tree;
 *   softmax  the maximum 8 lanes at a time (any NaN makes it NaN, as in the scalar loop), the
 *            numerators by exp256 (simd.h: exp512's polynomial);
 *   values   8 dims per accumulator, 8 accumulators per pass over the keys.
 *
 * float32 sums in another order than the scalar loops (and than head_avx's 16 lanes): within rounding of
 * each other, as tests/engine/test_native_attention.py checks against the torch path.  Only included by
 * paged_decode.c, after its helpers. */
#ifndef PDKV_PAGED_DECODE_AVX2_H
#define PDKV_PAGED_DECODE_AVX2_H

#include <immintrin.h>

/* r[t] = sum of the 8 lanes of v[t], for t < 8. */
INLINE __m256 sum8(const __m256 v[8]) {
    /* hadd: per 128-bit half [a0+a1, a2+a3, b0+b1, b2+b3]; twice: each half holds 4 vectors' half-sums */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 elements of a bf16 or f32 row from element i, as floats. */
INLINE __m256 load8(const void *row, size_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* scores[i] = <q, K[i]> for i < n (q already scaled), K[i] = the row at rows[i] + off bytes; C = head_dim
 * / 8 and bf16 constants where inlined. */
INLINE void scores_avx2(const float *q, const char *const *rows, size_t off, int64_t n, float *scores,
                        const int C, const int bf16) {
    for (int64_t i = 0; i < n; i += 8) {
        const int m = n - i < 8 ? (int)(n - i) : 8;
        __m256 part[8];
        for (int t = 0; t < 8; t++) {
            part[t] = _mm256_setzero_ps();
            if (t < m) {
                if (i + t + PREFETCH_AHEAD < n) prefetch_row(rows[i + t + PREFETCH_AHEAD] + off, (bf16 ? 2 : 4) * 8 * C);
                const char *k = rows[i + t] + off;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k, 0, bf16));
                for (int c = 1; c < C; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(k, 8 * c, bf16), acc);
                part[t] = acc;
            }
        }
        const __m256 s = sum8(part);
        if (m == 8) {
            _mm256_storeu_ps(scores + i, s);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, s);
            memcpy(scores + i, tmp, sizeof(float) * (size_t)m);
        }
    }
}

/* out = sum_i p[i] * V[i] for i < n (D = 8 C floats): 8 accumulators per pass over the keys. */
INLINE void weighted_sum_avx2(const float *p, const char *const *rows, size_t off, int64_t n, float *out,
                              const int C, const int bf16) {
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int cn = C - c0 < 8 ? C - c0 : 8;
        __m256 acc[8];
        for (int c = 0; c < cn; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const __m256 w = _mm256_set1_ps(p[i]);
            if (i + PREFETCH_AHEAD < n) prefetch_row(rows[i + PREFETCH_AHEAD] + off, (bf16 ? 2 : 4) * 8 * C);
            const char *v = rows[i] + off;
            for (int c = 0; c < cn; c++) acc[c] = _mm256_fmadd_ps(w, load8(v, 8 * (c0 + c), bf16), acc[c]);
        }
        for (int c = 0; c < cn; c++) _mm256_storeu_ps(out + 8 * (c0 + c), acc[c]);
    }
}

/* The largest of s[0 .. n8) (n8 a multiple of 8), NaN where any is NaN. */
static float max8_lanes(const float *s, int64_t n8) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        const __m256 x = _mm256_loadu_ps(s + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, x);
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0x4e));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0xb1));
    return _mm_cvtss_f32(m);
}

/* s[i] = exp(s[i] - m) for i < n8 (a multiple of 8); returns their sum. */
static float exp_sum8_lanes(float *s, int64_t n8, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    t = _mm_add_ps(t, _mm_shuffle_ps(t, t, 0x4e));
    t = _mm_add_ps(t, _mm_shuffle_ps(t, t, 0xb1));
    return _mm_cvtss_f32(t);
}

/* One query head (head_dim = 8 C): `q` its float32 values times the scale. */
static void head_avx2(const float *q, const char *const *krows, const char *const *vrows, size_t off, int64_t n,
                      float *scores, float *out, int C, int bf16) {
    BY_HEAD_DIM(8, scores_avx2, q, krows, off, n, scores)
    const float inv = 1.0f / softmax_numerators(scores, n);
    BY_HEAD_DIM(8, weighted_sum_avx2, scores, vrows, off, n, out)
    for (int d = 0; d < 8 * C; d++) out[d] *= inv;
}

#endif
