/* The AVX-512 intrinsics the bfloat16 kernels use, on a CPU with AVX2 and FMA and no AVX-512 (simd.h's
 * PDKV_BF16 3): a 512-bit vector is two 256-bit halves (lanes 0-7, 8-15), and each intrinsic below gives
 * the AVX-512 one's result lane for lane -- the same float operation on each lane, the same tree for a
 * horizontal sum or max (gcc's _mm512_reduce_add_ps: halves, then 128-bit halves, then pairs), masks as
 * the 16 (or 32) bits they are.  So the kernels keep one source, and their sums run in the order the
 * AVX-512 build runs them in simd.h's FMA form (PDKV_BF16 2) -- the same bits, compared on one AVX-512
 * CPU by tests/engine/test_bf16_forms.py (a build with -mno-avx512f), so deterministic nodes of either
 * kind share one KV namespace (engine/determinism.kv_fingerprint).  A kernel that leaves vector code to
 * __AVX512F__ alone (scalar here) sums in another order: PDKV_V512 is the guard for bfloat16 code.
 *
 * Only what the kernels call, with the AVX-512 names (macros over the immintrin.h declarations, which stay
 * unused): __m512 and __m512i become the two-half structs.  The shuffles of paged_prefill.c's canonical
 * pack (transpose16, vpermt2w) are not here: that file packs with plain loops in this build.  Only
 * included by simd.h. */
#ifndef PDKV_AVX512_AVX2_H
#define PDKV_AVX512_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} p5_ps;
typedef struct {
    __m256i lo, hi; /* bytes 0-31, 32-63 */
} p5_si;

#define __m512 p5_ps
#define __m512i p5_si

/* Bits 0-7 of m as 8 dword lanes of all ones or zeros. */
static inline __attribute__((always_inline)) __m256i p5_lanes8(unsigned m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(m & 0xffu)), bit), bit);
}
/* Bits 0-15 of m as 16 word lanes of all ones or zeros. */
static inline __attribute__((always_inline)) __m256i p5_lanes16(unsigned m) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          (short)0x8000);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)(m & 0xffffu)), bit), bit);
}
/* A half's 8 dword lanes (all ones or zeros) as mask bits. */
static inline __attribute__((always_inline)) unsigned p5_bits8(__m256i v) {
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(v));
}

#define P5_PS(lo_, hi_) ((p5_ps){(lo_), (hi_)})
#define P5_SI(lo_, hi_) ((p5_si){(lo_), (hi_)})
/* an operation on both halves of its vector operands */
#define P5_MAP2(f, a, b) P5_PS(f((a).lo, (b).lo), f((a).hi, (b).hi))
#define P5_MAPI2(f, a, b) P5_SI(f((a).lo, (b).lo), f((a).hi, (b).hi))

static inline __attribute__((always_inline)) p5_ps p5_setzero_ps(void) {
    return P5_PS(_mm256_setzero_ps(), _mm256_setzero_ps());
}
static inline __attribute__((always_inline)) p5_ps p5_set1_ps(float x) {
    return P5_PS(_mm256_set1_ps(x), _mm256_set1_ps(x));
}
static inline __attribute__((always_inline)) p5_ps p5_loadu_ps(const void *p) {
    return P5_PS(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
static inline __attribute__((always_inline)) void p5_storeu_ps(void *p, p5_ps v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
static inline __attribute__((always_inline)) p5_ps p5_add_ps(p5_ps a, p5_ps b) { return P5_MAP2(_mm256_add_ps, a, b); }
static inline __attribute__((always_inline)) p5_ps p5_sub_ps(p5_ps a, p5_ps b) { return P5_MAP2(_mm256_sub_ps, a, b); }
static inline __attribute__((always_inline)) p5_ps p5_mul_ps(p5_ps a, p5_ps b) { return P5_MAP2(_mm256_mul_ps, a, b); }
static inline __attribute__((always_inline)) p5_ps p5_div_ps(p5_ps a, p5_ps b) { return P5_MAP2(_mm256_div_ps, a, b); }
static inline __attribute__((always_inline)) p5_ps p5_max_ps(p5_ps a, p5_ps b) { return P5_MAP2(_mm256_max_ps, a, b); }
static inline __attribute__((always_inline)) p5_ps p5_fmadd_ps(p5_ps a, p5_ps b, p5_ps c) {
    return P5_PS(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline __attribute__((always_inline)) p5_ps p5_fnmadd_ps(p5_ps a, p5_ps b, p5_ps c) {
    return P5_PS(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline __attribute__((always_inline)) p5_ps p5_abs_ps(p5_ps a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return P5_PS(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
/* gcc's _mm512_reduce_add_ps tree: the halves (upper + lower), their 128-bit halves, lanes 0 + 2 and
 * 1 + 3, then those two */
static inline __attribute__((always_inline)) float p5_reduce_add_ps(p5_ps v) {
    const __m256 t3 = _mm256_add_ps(v.hi, v.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, 0x4e));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 0x55));
}
/* gcc's _mm512_reduce_max_ps tree, its operand order kept (max_ps returns the second operand on a NaN) */
static inline __attribute__((always_inline)) float p5_reduce_max_ps(p5_ps v) {
    const __m256 t3 = _mm256_max_ps(v.hi, v.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, 0x4e));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, 0x11)));
}
static inline __attribute__((always_inline)) p5_ps p5_mask_blend(p5_ps src, __mmask16 m, p5_ps v) {
    return P5_PS(_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(p5_lanes8(m))),
                 _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(p5_lanes8((unsigned)m >> 8))));
}
static inline __attribute__((always_inline)) float p5_mask_reduce_max_ps(__mmask16 m, p5_ps v) {
    return p5_reduce_max_ps(p5_mask_blend(p5_set1_ps(-__builtin_inff()), m, v));
}
static inline __attribute__((always_inline)) p5_ps p5_maskz_mov_ps(__mmask16 m, p5_ps v) {
    return P5_PS(_mm256_and_ps(v.lo, _mm256_castsi256_ps(p5_lanes8(m))),
                 _mm256_and_ps(v.hi, _mm256_castsi256_ps(p5_lanes8((unsigned)m >> 8))));
}
static inline __attribute__((always_inline)) p5_ps p5_mask_mul_ps(p5_ps src, __mmask16 m, p5_ps a, p5_ps b) {
    return p5_mask_blend(src, m, p5_mul_ps(a, b));
}
/* masked loads and stores touch no lane outside the mask (vmaskmov, as AVX-512's masked moves) */
static inline __attribute__((always_inline)) p5_ps p5_maskz_loadu_ps(__mmask16 m, const void *p) {
    return P5_PS(_mm256_maskload_ps((const float *)p, p5_lanes8(m)),
                 _mm256_maskload_ps((const float *)p + 8, p5_lanes8((unsigned)m >> 8)));
}
static inline __attribute__((always_inline)) p5_ps p5_mask_loadu_ps(p5_ps src, __mmask16 m, const void *p) {
    return p5_mask_blend(src, m, p5_maskz_loadu_ps(m, p));
}
static inline __attribute__((always_inline)) void p5_mask_storeu_ps(void *p, __mmask16 m, p5_ps v) {
    _mm256_maskstore_ps((float *)p, p5_lanes8(m), v.lo);
    _mm256_maskstore_ps((float *)p + 8, p5_lanes8((unsigned)m >> 8), v.hi);
}
#define P5_CMP_PS_MASK(a, b, imm)                                                                          \
    ((__mmask16)((unsigned)_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (imm))) |                      \
                 (unsigned)_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (imm))) << 8))

static inline __attribute__((always_inline)) p5_si p5_setzero_si512(void) {
    return P5_SI(_mm256_setzero_si256(), _mm256_setzero_si256());
}
static inline __attribute__((always_inline)) p5_si p5_set1_epi32(int x) {
    return P5_SI(_mm256_set1_epi32(x), _mm256_set1_epi32(x));
}
static inline __attribute__((always_inline)) p5_si p5_set1_epi16(short x) {
    return P5_SI(_mm256_set1_epi16(x), _mm256_set1_epi16(x));
}
static inline __attribute__((always_inline)) p5_si p5_loadu_si512(const void *p) {
    return P5_SI(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
static inline __attribute__((always_inline)) void p5_storeu_si512(void *p, p5_si v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
}
static inline __attribute__((always_inline)) p5_si p5_and_si512(p5_si a, p5_si b) {
    return P5_MAPI2(_mm256_and_si256, a, b);
}
static inline __attribute__((always_inline)) p5_si p5_add_epi32(p5_si a, p5_si b) {
    return P5_MAPI2(_mm256_add_epi32, a, b);
}
static inline __attribute__((always_inline)) p5_si p5_add_epi16(p5_si a, p5_si b) {
    return P5_MAPI2(_mm256_add_epi16, a, b);
}
static inline __attribute__((always_inline)) p5_si p5_slli_epi32(p5_si a, int n) {
    return P5_SI(_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n));
}
static inline __attribute__((always_inline)) p5_si p5_srli_epi32(p5_si a, int n) {
    return P5_SI(_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n));
}
static inline __attribute__((always_inline)) p5_ps p5_castsi512_ps(p5_si a) {
    return P5_PS(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi));
}
static inline __attribute__((always_inline)) p5_si p5_castps_si512(p5_ps a) {
    return P5_SI(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi));
}
/* 16 uint16 zero-extended to dwords */
static inline __attribute__((always_inline)) p5_si p5_cvtepu16_epi32(__m256i h) {
    return P5_SI(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                 _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
/* 16 dwords truncated to their low words (vpmovdw) */
static inline __attribute__((always_inline)) __m256i p5_cvtepi32_epi16(p5_si a) {
    const __m256i low_words = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4,
                                               5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.lo, low_words), 0x08);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.hi, low_words), 0x08);
    return _mm256_inserti128_si256(lo, _mm256_castsi256_si128(hi), 1);
}
static inline __attribute__((always_inline)) p5_si p5_mask_or_epi32(p5_si src, __mmask16 m, p5_si a, p5_si b) {
    return p5_castps_si512(p5_mask_blend(p5_castsi512_ps(src), m, p5_castsi512_ps(P5_MAPI2(_mm256_or_si256, a, b))));
}
static inline __attribute__((always_inline)) p5_si p5_maskz_loadu_epi32(__mmask16 m, const void *p) {
    return P5_SI(_mm256_maskload_epi32((const int *)p, p5_lanes8(m)),
                 _mm256_maskload_epi32((const int *)p + 8, p5_lanes8((unsigned)m >> 8)));
}
/* words where m has their bit: the dwords that hold one loaded (vmaskmov), then the others zeroed */
static inline __attribute__((always_inline)) p5_si p5_maskz_loadu_epi16(__mmask32 m, const void *p) {
    unsigned dwords = 0;
    for (int i = 0; i < 16; i++) dwords |= (unsigned)((m >> (2 * i) & 3u) != 0) << i;
    const p5_si v = p5_maskz_loadu_epi32((__mmask16)dwords, p);
    return P5_SI(_mm256_and_si256(v.lo, p5_lanes16(m & 0xffffu)), _mm256_and_si256(v.hi, p5_lanes16(m >> 16)));
}
static inline __attribute__((always_inline)) __mmask16 p5_cmpgt_epi32_mask(p5_si a, p5_si b) {
    return (__mmask16)(p5_bits8(_mm256_cmpgt_epi32(a.lo, b.lo)) | p5_bits8(_mm256_cmpgt_epi32(a.hi, b.hi)) << 8);
}
static inline __attribute__((always_inline)) __mmask16 p5_cmple_epi32_mask(p5_si a, p5_si b) {
    return (__mmask16)~p5_cmpgt_epi32_mask(a, b);
}
static inline __attribute__((always_inline)) __mmask16 p5_cmpge_epi32_mask(p5_si a, p5_si b) {
    return (__mmask16)~p5_cmpgt_epi32_mask(b, a);
}
/* AVX512-BW + VL's masked store of 16 words: whole where m is, else word by word */
static inline __attribute__((always_inline)) void p5_mask_storeu_epi16(void *p, __mmask16 m, __m256i v) {
    if (m == 0xffff) {
        _mm256_storeu_si256((__m256i *)p, v);
        return;
    }
    uint16_t w[16];
    _mm256_storeu_si256((__m256i *)w, v);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((uint16_t *)p)[i] = w[i];
}

/* _mm512_set_epi32's order: the last argument is lane 0 */
#define P5_SET_EPI32(e15, e14, e13, e12, e11, e10, e9, e8, e7, e6, e5, e4, e3, e2, e1, e0)                 \
    P5_SI(_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0), _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8))

#define _mm512_set_epi32 P5_SET_EPI32
#define _mm512_setzero_ps p5_setzero_ps
#define _mm512_set1_ps p5_set1_ps
#define _mm512_loadu_ps p5_loadu_ps
#define _mm512_storeu_ps p5_storeu_ps
#define _mm512_add_ps p5_add_ps
#define _mm512_sub_ps p5_sub_ps
#define _mm512_mul_ps p5_mul_ps
#define _mm512_div_ps p5_div_ps
#define _mm512_max_ps p5_max_ps
#define _mm512_fmadd_ps p5_fmadd_ps
#define _mm512_fnmadd_ps p5_fnmadd_ps
#define _mm512_abs_ps p5_abs_ps
#define _mm512_reduce_add_ps p5_reduce_add_ps
#define _mm512_reduce_max_ps p5_reduce_max_ps
#define _mm512_mask_reduce_max_ps p5_mask_reduce_max_ps
#define _mm512_maskz_mov_ps p5_maskz_mov_ps
#define _mm512_mask_mul_ps p5_mask_mul_ps
#define _mm512_maskz_loadu_ps p5_maskz_loadu_ps
#define _mm512_mask_loadu_ps p5_mask_loadu_ps
#define _mm512_mask_storeu_ps p5_mask_storeu_ps
#define _mm512_cmp_ps_mask P5_CMP_PS_MASK
#define _mm512_setzero_si512 p5_setzero_si512
#define _mm512_set1_epi32 p5_set1_epi32
#define _mm512_set1_epi16 p5_set1_epi16
#define _mm512_loadu_si512 p5_loadu_si512
#define _mm512_storeu_si512 p5_storeu_si512
#define _mm512_and_si512 p5_and_si512
#define _mm512_add_epi32 p5_add_epi32
#define _mm512_add_epi16 p5_add_epi16
#define _mm512_slli_epi32 p5_slli_epi32
#define _mm512_srli_epi32 p5_srli_epi32
#define _mm512_castsi512_ps p5_castsi512_ps
#define _mm512_castps_si512 p5_castps_si512
#define _mm512_cvtepu16_epi32 p5_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 p5_cvtepi32_epi16
#define _mm512_mask_or_epi32 p5_mask_or_epi32
#define _mm512_maskz_loadu_epi32 p5_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi16 p5_maskz_loadu_epi16
#define _mm512_cmple_epi32_mask p5_cmple_epi32_mask
#define _mm512_cmpge_epi32_mask p5_cmpge_epi32_mask
#define _mm256_mask_storeu_epi16 p5_mask_storeu_epi16

#endif
