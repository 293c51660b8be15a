/* Helpers the native kernels share (the .c files beside this one): their shape limits, the window rule,
 * grow-only scratch buffers, prefetch streams, bfloat16 conversions rounded as torch rounds, and the vector
 * exponential. */
#ifndef PDKV_SIMD_H
#define PDKV_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* PDKV_V512: the 512-bit vector code of the bfloat16 kernels compiles -- on AVX-512, or on AVX2 + FMA
 * as two 256-bit halves (avx512_avx2.h: PDKV_BF16 3 below). */
#if defined(__AVX512F__)
#define PDKV_V512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PDKV_V512 1
#define PDKV_ON_AVX2 1
#include "avx512_avx2.h"
#else
#define PDKV_V512 0
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* One line of a weight stream prefetched into L1: non-temporally (prefetchnta) where nta, else with
 * prefetcht0 -- the run-time switch of quant.c's row_prefetch (the hint of _mm_prefetch must be a
 * constant, hence the branch).  Not for a loop whose registers are tight: bf16_linear.c's tile, with this
 * branch inside it, kept its broadcast vectors on the stack (it writes one loop per hint instead). */
INLINE void prefetch_l1(const void *p, int nta) {
    if (nta)
        _mm_prefetch((const char *)p, _MM_HINT_NTA);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}
#endif

/* The bfloat16 kernels' floating-point mode: denormal inputs read as zero and denormal results flushed
 * (MXCSR's DAZ and FTZ) -- the rule vdpbf16ps and vcvtneps2bf16 follow whatever MXCSR says.  Every kernel
 * call on bfloat16 data whose arithmetic has a vdpbf16ps or vcvtneps2bf16 form (all but quant.c's, whose
 * dot products are integers and whose float steps are one code in every build) sets it on each thread
 * that runs it (bf16_mode_enter, inside its parallel region)
 * and puts it back before that thread leaves (bf16_mode_leave), so that the three forms of the dot
 * products (PDKV_BF16 below: vdpbf16ps, its FMA emulation, that emulation on AVX2's halves) give the same
 * bits for every input, denormals too, and with them every other operation of the kernel: a deterministic
 * node's KV blocks are the same bits on any of those CPUs (engine/determinism.kv_fingerprint).  float32
 * calls keep IEEE arithmetic (transformers' float32 reference path).  No-op where a build has no SSE. */
#if defined(__SSE__)
#include <xmmintrin.h>
INLINE unsigned bf16_mode_enter(int64_t bf16) {
    if (!bf16) return 0;
    const unsigned before = _mm_getcsr();
    _mm_setcsr(before | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return before;
}
INLINE void bf16_mode_leave(int64_t bf16, unsigned before) {
    if (bf16) _mm_setcsr(before);
}
#else
INLINE unsigned bf16_mode_enter(int64_t bf16) {
    (void)bf16;
    return 0;
}
INLINE void bf16_mode_leave(int64_t bf16, unsigned before) { (void)bf16, (void)before; }
#endif

#define MAX_GROUP 16 /* query heads per KV head; engine/native.py checks both limits */
#define MAX_HEAD_DIM 256

/* The order of the keys and values inside one block's slabs of the paged cache ([num_blocks,
 * num_layers, 2, block_size, num_kv_heads, head_dim], one slab per block, layer and K or V):
 *   KV_CANONICAL  [position][kv head][dim], the layout of the tensor's shape (every kernel reads it);
 *   KV_PAIRED     bfloat16 only, deterministic mode's (engine/determinism.py): the layout
 *                 paged_prefill.c's dot products take, so that its tiles are copies, not transposes --
 *                 keys as pairs of dims by position, element (j, h, d) at ((h D/2 + d/2) bs + j) 2 + d % 2;
 *                 values as pairs of positions by dim, element (j, h, d) at ((h bs/2 + j/2) D + d) 2 + j % 2
 *                 (block_size even).  The bytes per block are the same; engine/attention.py's write_kv and
 *                 tests/engine/test_native_prefill.py give the same map in torch. */
#define KV_CANONICAL 0
#define KV_PAIRED 1

/* One position's keys k and values v ([kv heads][D] bfloat16 each) into slot j of the paired slabs that
 * start slab elements into the cache (the block's K slab; its V slab follows, bs * Hkv * D on). */
static inline void write_paired(void *cache, size_t slab, const uint16_t *k, const uint16_t *v, int64_t j,
                                int64_t bs, int64_t num_kv_heads, int64_t D) {
    uint32_t *kp = (uint32_t *)((uint16_t *)cache + slab);
    uint16_t *vp = (uint16_t *)cache + slab + (size_t)(bs * num_kv_heads * D);
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const uint16_t *kh = k + h * D, *vh = v + h * D;
        for (int64_t p = 0; p < D / 2; p++) {
            uint32_t pair;
            memcpy(&pair, kh + 2 * p, sizeof pair);
            kp[(h * (D / 2) + p) * bs + j] = pair;
        }
        uint16_t *vo = vp + ((h * (bs / 2) + j / 2) * D) * 2 + j % 2;
        for (int64_t d = 0; d < D; d++) vo[2 * d] = vh[d];
    }
}

/* Byte ranges a kernel prefetches a line at a time on the way through its own work (bf16_linear.c's side
 * stream, paged_prefill.c's next decode row): `left` more ranges from base[0] on, of `bytes` each, after
 * the one at hand, whose next line is `cur` (below `end`).  line_stream_next: the next line's address (the
 * caller prefetches it with its hint), NULL once the stream is done, or for an empty one.  A cursor, not
 * (range, offset): its common step is a compare and an add on two registers, which bf16_linear.c's tiles
 * and paged_prefill.c's score and value loops keep in registers on a local copy of the stream (copied in
 * and back around each loop) -- a stream advanced through a pointer cost the score loop of
 * paged_prefill.c's decode rows its registers. */
typedef struct {
    const char *const *base;
    int64_t left, bytes;
    uintptr_t cur, end; /* addresses as integers: the cursor steps past a range's end by up to 63 bytes */
} LineStream;

/* A stream over n ranges of `bytes` from base[0]; empty where n or bytes is not positive or base is NULL. */
static inline LineStream line_stream(const char *const *base, int64_t n, int64_t bytes) {
    const int none = base == NULL || n <= 0 || bytes <= 0;
    return (LineStream){none ? NULL : base, none ? 0 : n, bytes, 0, 0};
}

static inline const char *line_stream_next(LineStream *h) {
    if (h->cur >= h->end) {
        if (h->left <= 0) return NULL;
        h->cur = (uintptr_t)*h->base++;
        h->end = h->cur + (uintptr_t)h->bytes;
        h->left--;
    }
    const char *line = (const char *)h->cur;
    h->cur += 64;
    return line;
}

/* The first key a query at position pos sees: keys max(0, pos - window + 1) .. pos (window 0: none). */
static inline int64_t first_visible_key(int64_t pos, int64_t window) {
    return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

/* *buf with room for `bytes`, grown (never shrunk) where it has less: a kernel's per-thread scratch,
 * kept across calls so that a fresh buffer is not page-faulted in every time.  NULL (the old buffer kept)
 * when memory runs out. */
static inline void *grow_scratch(void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        void *grown = realloc(*buf, bytes);
        if (grown == NULL) return NULL;
        *buf = grown;
        *have = bytes;
    }
    return *buf;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even (as torch does) */
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
/* exp(x) for x <= 0 (a score minus its row's max): Cephes' expf range reduction and polynomial. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x); /* second operand wins on NaN: NaN stays */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp512 on 8 lanes (a CPU with AVX2 and no AVX-512): the same reduction and polynomial; 2^n built in
 * the exponent bits (n >= -126 here, so a normal number). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x); /* second operand wins on NaN: NaN stays */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

#ifdef PDKV_ON_AVX2
/* exp512 on the two halves: the same bits -- vscalefps and the multiply by 2^n (n >= -126) round one exact
 * product alike. */
INLINE __m512 exp512(__m512 x) { return (__m512){exp256(x.lo), exp256(x.hi)}; }
#endif

#if PDKV_V512
/* 16 bfloat16 (as bits) widened to floats: exact, and plain AVX-512 (no AVX512-BF16 needed). */
INLINE __m512 from_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* dst[0 .. n) = src[0 .. n) widened to floats (exact): a broadcast operand kept as floats for the FMAs. */
INLINE void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, from_bf16x16(_mm256_loadu_si256((const __m256i *)(src + i))));
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PDKV_ON_AVX2)
/* 16 floats rounded to bfloat16, nearest even (as torch), in integer arithmetic: what a CPU without
 * AVX512-BF16 has (quant.c's outputs on any CPU; every kernel's below where PDKV_BF16 is 2). */
#ifdef PDKV_ON_AVX2
/* A half's 8 floats rounded as below, NaN blended in by the compare's own lanes (no mask round trip). */
INLINE __m256i bf16_rne8_dwords(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000)); /* NaN stays NaN */
    return _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                                   _mm256_castsi256_ps(quiet), nan)), 16);
}
/* The same bits as the AVX-512 form below, lane for lane: each dword holds its word zero-extended, so
 * the unsigned-saturating pack is exact; the pack interleaves 128-bit halves, the permute puts them back. */
INLINE __m256i bf16_rne16(__m512 x) {
    const __m256i packed = _mm256_packus_epi32(bf16_rne8_dwords(x.lo), bf16_rne8_dwords(x.hi));
    return _mm256_permute4x64_epi64(packed, 0xd8);
}
#else
INLINE __m256i bf16_rne16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000)); /* NaN stays NaN */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif
#endif

/* The bfloat16 dot products of the attention, LoRA and dense-linear kernels (PDKV_BF16):
 *   1  AVX512-BF16: vdpbf16ps adds a pair's two products to a float32 lane, the odd element's first, each
 *      add rounded to nearest even (the SDM's pseudocode; input denormals read as zero, output ones flushed);
 *   2  AVX-512 (F, BW, VL) without it (Skylake to Ice Lake Xeons, or a VM that hides the flag): the same two
 *      adds as two FMAs on the pair split into floats (a bfloat16 is a float's top half, so each product is
 *      exact and each add rounds once, as above) -- the same bits for every input, denormals too, since
 *      every bfloat16 kernel runs with DAZ and FTZ (bf16_mode_enter above, bf16_split below); two FMAs and the
 *      split where vdpbf16ps is one instruction, so slower where a kernel is compute-bound on AMD's cores
 *      (a SmolLM2 step's dense linears at 32 rows: ~700 GFLOP/s with vdpbf16ps on 2 cores of a Zen 5), not
 *      on Intel's, whose vdpbf16ps has half the FMAs' rate (~200 GFLOP/s either way on an Emerald Rapids
 *      VM);
 *   3  AVX2 + FMA, no AVX-512 (AMD's Zen 1-3, Intel's Haswell to Alder Lake): 2's code on avx512_avx2.h's
 *      two 256-bit halves of each vector, the same operations lane for lane.
 * The three give the same bits wherever every row runs the same kernels (deterministic mode: one KV
 * namespace for all three, engine/determinism.kv_fingerprint; tests/engine/test_bf16_forms.py builds each
 * form on one AVX-512 CPU and compares them, denormals included).  Outside it the decode attention has a
 * kernel of each form (paged_decode.c), and the namespace names the form.
 * bf16v holds 32 bfloat16 as the kernel's operand: the raw vector, or its two halves as floats, split once
 * where loaded (a loaded operand feeds several dot products). */
#if defined(__AVX512BF16__)
#define PDKV_BF16 1
typedef __m512bh bf16v;
INLINE bf16v bf16v_of(__m512i v) { return (__m512bh)v; }
INLINE __m512 bf16_dot(__m512 acc, bf16v a, bf16v b) { return _mm512_dpbf16_ps(acc, a, b); }
/* 16 floats rounded to bfloat16 (nearest even, as torch), as the bits. */
INLINE __m256i to_bf16x16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
/* lo's 16 floats then hi's as 32 bfloat16 (paged_prefill.c's probabilities; PDKV_BF16 2 keeps them as
 * floats rounded to bfloat16). */
INLINE __m512i pack_bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDKV_BF16 2
#elif defined(PDKV_ON_AVX2)
#define PDKV_BF16 3 /* 2's form on AVX2's halves (avx512_avx2.h) */
#else
#define PDKV_BF16 0
#endif

#if PDKV_BF16
/* The same dot products as two FMAs on a pair split into floats, on any AVX-512 CPU: PDKV_BF16 2's only
 * form, and bf16_linear.c's FMA form where vdpbf16ps has half the FMAs' throughput (an Emerald Rapids VM:
 * 1.4 G vdpbf16ps a second on a core against 5.7 G FMAs).  Run with MXCSR's DAZ and FTZ (bf16_mode_enter),
 * they give vdpbf16ps's bits for every input, denormals too, bar a NaN's payload (20 M random lanes of
 * every class, ad-hoc, 2026-12-06). */
typedef struct {
    __m512 odd, even; /* each pair's element 2i + 1 and 2i, as floats in lane i */
} bf16_split;
INLINE bf16_split bf16_split_of(__m512i v) {
    const bf16_split r = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))),
                          _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
    return r;
}
INLINE __m512 bf16_split_dot(__m512 acc, bf16_split a, bf16_split b) {
    return _mm512_fmadd_ps(a.even, b.even, _mm512_fmadd_ps(a.odd, b.odd, acc));
}
/* bf16_split_dot with the second operand one pair, given as two floats in memory (element 2i at b[0], 2i
 * + 1 at b[1]): each broadcast from memory into its FMA -- a load, not the split's vector ALU work, where a
 * kernel widened its broadcast operand (activations, queries, probabilities) to floats once. */
INLINE __m512 bf16_dot_pair(__m512 acc, bf16_split a, const float *b) {
    return _mm512_fmadd_ps(a.even, _mm512_set1_ps(b[0]), _mm512_fmadd_ps(a.odd, _mm512_set1_ps(b[1]), acc));
}
#endif

#if PDKV_BF16 >= 2
typedef bf16_split bf16v;
INLINE bf16v bf16v_of(__m512i v) { return bf16_split_of(v); }
INLINE __m512 bf16_dot(__m512 acc, bf16v a, bf16v b) { return bf16_split_dot(acc, a, b); }
INLINE __m256i to_bf16x16(__m512 x) { return bf16_rne16(x); }
#endif

#if PDKV_BF16
INLINE bf16v bf16v_load(const void *p) { return bf16v_of(_mm512_loadu_si512(p)); }
/* One pair of bfloat16 (as a dword) in every lane. */
INLINE bf16v bf16v_pair(int32_t pair) { return bf16v_of(_mm512_set1_epi32(pair)); }
/* 16 floats rounded to bfloat16 and widened back. */
INLINE __m512 round_bf16x16(__m512 x) { return from_bf16x16(to_bf16x16(x)); }
#endif

#endif
