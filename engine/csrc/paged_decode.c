/* The engine's native kernels (engine/native.py builds and loads this file, with paged_prefill.c):
 *
 *   pdkv_paged_decode    decode attention read straight from the paged KV cache
 *   pdkv_rms_norm        RMSNorm, float32 inside, rounded as transformers rounds
 *   pdkv_rope_write_kv   rotary embedding of q and k, and the step's K/V into their cache slots
 *   pdkv_silu_mul        SwiGLU's silu(gate) * up
 *   pdkv_argmax_f32      greedy sampling: each row's first maximum (its first NaN if it has one)
 *   pdkv_argmax_bf16     the same over bfloat16 logits (the LM head's output, widened exactly)
 *
 * Decode attention.  The torch path (engine/attention.py) gathers each sequence's blocks into a
 * contiguous buffer and runs SDPA over it: every key and value is read, written and read again.  Here
 * each task -- a whole sequence in a large batch, one KV head of one sequence in a small one -- collects
 * the addresses of its visible keys' rows in the cache and reads each key and value in place, for each
 * query head that shares the KV head (grouped-query attention), in two passes:
 *
 *     pass 1   s[i] = scale * <q, k[i]>          for the visible keys i
 *     softmax  p[i] = exp(s[i] - max) / sum      (float32)
 *     pass 2   out  = sum_i p[i] * v[i]          (float32 accumulators, rounded once at the end)
 *
 * Cache layout (contiguous): [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; the
 * element (b, layer, kv, off, h, d) sits at ((((b * L + layer) * 2 + kv) * bs + off) * Hkv + h) * D + d.
 * Key j of a sequence lives in block table[j / bs] at offset j % bs.  Keys visible to the query at
 * position p: max(0, p - window + 1) <= j <= p (window 0: no window).  Padding entries of the table are
 * never read.
 *
 * With AVX-512 (built with -march=native): scores for 16 keys at a time, summed by a reduction tree;
 * with AVX512-BF16, bfloat16 keys multiply straight from the cache's bytes (vdpbf16ps); rows ahead are
 * prefetched; the exponentials are a vector polynomial (Cephes' expf, within 2 ulp).  With AVX2 + FMA and
 * no AVX-512, the same two passes on 8 lanes (paged_decode_avx2.h).  Elsewhere plain loops the compiler
 * vectorizes as it can.  NaN in a score propagates to the output, as in SDPA.
 *
 * Parallel with OpenMP; libgomp is linked by soname and torch has loaded its own already, so these
 * threads are torch's pool.  No torch headers: the Python side passes raw pointers, which keeps the build
 * to one gcc call of about a second.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "simd.h"

/* Keys ahead that the score and sum loops prefetch: the rows of a sequence are scattered over blocks far
 * apart (and one KV head's part of a row is strided), which the hardware prefetchers do not follow.
 * Measured here: 24-48 alike; prefetching a whole next sequence instead was slower for long ones. */
#define PREFETCH_AHEAD 32
/* Elements below which the elementwise kernels (norm, SiLU-mul, RoPE) stay on one thread: starting the
 * parallel region costs a few us.  At 16384 a batch-32 decode step's SiLU-mul takes 12 us instead of 21. */
#define PARALLEL_MIN 16384
/* AVX2 + FMA without AVX-512: paged_decode_avx2.h's vector attention (else the plain loops) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define AVX2_ATTENTION 1
#else
#define AVX2_ATTENTION 0
#endif

#if defined(__AVX512F__) || AVX2_ATTENTION
INLINE void prefetch_row(const char *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
#endif

static float softmax_numerators(float *s, int64_t n);
/* F(..., C, bf16) for a head's kernels on LANES-float vectors (C = head_dim / LANES, and bf16, in scope at
 * the call): unrolled with both as constants for head_dim 64 and 128, the sizes models use, in each
 * dtype; any other multiple of LANES with the run-time values. */
#define BY_HEAD_DIM(LANES, F, ...)                                                                          \
    switch (C * 2 + bf16) {                                                                                \
    case 64 / LANES * 2: F(__VA_ARGS__, 64 / LANES, 0); break;                                             \
    case 64 / LANES * 2 + 1: F(__VA_ARGS__, 64 / LANES, 1); break;                                         \
    case 128 / LANES * 2: F(__VA_ARGS__, 128 / LANES, 0); break;                                           \
    case 128 / LANES * 2 + 1: F(__VA_ARGS__, 128 / LANES, 1); break;                                       \
    default: F(__VA_ARGS__, C, bf16);                                                                      \
    }
#if AVX2_ATTENTION
#include "paged_decode_avx2.h"
#endif


/* n elements of a row (bf16 or f32) into dst as float32. */
static inline void load_row(const void *src, int bf16, float *dst, int n) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *s = src;
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#if PDKV_V512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* acc += p * x */
static inline void axpy(float *acc, float p, const float *x, int n) {
    int i = 0;
#ifdef __AVX512F__
    __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += p * x[i];
}

/* s[i] = exp(s[i] - max(s)); returns the sum. */
static float softmax_numerators(float *s, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#ifdef __AVX512F__
    /* the max 16 lanes at a time; max_ps drops a NaN, so NaNs are looked for apart: any makes the max
     * NaN, as in the scalar loop below */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 x = _mm512_mask_loadu_ps(mx, k, s + i);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, x);
    }
    m = nan ? NAN : _mm512_reduce_max_ps(mx);
#elif AVX2_ATTENTION
    i = n / 8 * 8;
    m = max8_lanes(s, i);
#endif
    for (; i < n; i++) m = (s[i] > m || s[i] != s[i]) ? s[i] : m;
    i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(m), acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
        _mm512_mask_storeu_ps(s + i, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
        i = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#elif AVX2_ATTENTION
    i = n / 8 * 8;
    sum = exp_sum8_lanes(s, i, m);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

typedef struct {
    const void *q;
    const void *cache;
    void *out;
    const int64_t *block_table;
    const int64_t *positions;
    int64_t table_width, num_layers, layer, block_size, num_heads, num_kv_heads;
    int head_dim, group, bf16;
    int64_t window;
    float scale;
    int64_t num_seqs, max_keys;
    int64_t q_stride; /* elements from one query row to the next (its heads are contiguous) */
} Args;

#if PDKV_V512
/* 16 elements of a bf16 or f32 row from element i, as floats. */
INLINE __m512 load16(const void *row, size_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + i);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#ifdef __AVX512F__

/* r[t] = sum of the 16 lanes of v[t], for t < 16: a reduction tree (45 shuffles and adds for 16 sums,
 * where 16 separate horizontal sums take about 160). */
INLINE __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* per 128-bit lane: the lane's sum for each of 4 vectors */
        u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44), _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
    /* u[k] holds vectors 4k..4k+3 in each of its four 128-bit lanes; add the lanes together */
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}


/* scores[i] = <q, K[i]> for i < n, K[i] = the row at rows[i] + off bytes; C = head_dim / 16 and bf16
 * are constants where inlined, so q and the sums stay in registers. */
INLINE void scores_avx(const float *q, const char *const *rows, size_t off, int64_t n, float *scores,
                       const int C, const int bf16) {
    __m512 qv[16];
    for (int c = 0; c < C; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t i = 0; i < n; i += 16) {
        const int m = n - i < 16 ? (int)(n - i) : 16;
        __m512 part[16];
        for (int t = 0; t < 16; t++) {
            if (t < m) {
                if (i + t + PREFETCH_AHEAD < n) prefetch_row(rows[i + t + PREFETCH_AHEAD] + off, (bf16 ? 2 : 4) * 16 * C);
                const char *k = rows[i + t] + off;
                __m512 acc = _mm512_mul_ps(qv[0], load16(k, 0, bf16));
                for (int c = 1; c < C; c++) acc = _mm512_fmadd_ps(qv[c], load16(k, 16 * c, bf16), acc);
                part[t] = acc;
            } else {
                part[t] = _mm512_setzero_ps();
            }
        }
        _mm512_mask_storeu_ps(scores + i, (__mmask16)((1u << m) - 1u), sum16(part));
    }
}

/* acc = sum_i p[i] * V[i] for i < n, into out (D = 16 C floats). */
INLINE void weighted_sum_avx(const float *p, const char *const *rows, size_t off, int64_t n, float *out,
                             const int C, const int bf16) {
    __m512 acc[16];
    for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const __m512 w = _mm512_set1_ps(p[i]);
        if (i + PREFETCH_AHEAD < n) prefetch_row(rows[i + PREFETCH_AHEAD] + off, (bf16 ? 2 : 4) * 16 * C);
        const char *v = rows[i] + off;
        for (int c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(w, load16(v, 16 * c, bf16), acc[c]);
    }
    for (int c = 0; c < C; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

#ifdef __AVX512BF16__
/* scores[i] = scale * <q, K[i]> on bfloat16 rows with the AVX512-BF16 dot product: 32 products per
 * instruction straight from the cache's bytes (no conversion); float32 sums.  C2 = head_dim / 32. */
INLINE void scores_dpbf16(const uint16_t *q, const char *const *rows, size_t off, int64_t n, float *scores,
                          float scale, const int C2, const int prefetch) {
    __m512bh qv[8];
    for (int c = 0; c < C2; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const int m = n - i < 16 ? (int)(n - i) : 16;
        __m512 part[16];
        for (int t = 0; t < 16; t++) {
            part[t] = _mm512_setzero_ps();
            if (t < m) {
                if (prefetch && i + t + PREFETCH_AHEAD < n)
                    prefetch_row(rows[i + t + PREFETCH_AHEAD] + off, 2 * 32 * C2);
                const uint16_t *k = (const uint16_t *)(rows[i + t] + off);
                for (int c = 0; c < C2; c++)
                    part[t] = _mm512_dpbf16_ps(part[t], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
            }
        }
        _mm512_mask_storeu_ps(scores + i, (__mmask16)((1u << m) - 1u), _mm512_mul_ps(sum16(part), sv));
    }
}
#endif

/* One query head: `q` its float32 values times the scale, `qraw` the same head in the cache's dtype. */
static void head_avx(const float *q, const char *qraw, float scale, const char *const *krows,
                     const char *const *vrows, size_t off, int64_t n, float *scores, float *out, int C, int bf16) {
#ifdef __AVX512BF16__
    if (bf16 && C % 2 == 0) {
        if (C == 4)
            scores_dpbf16((const uint16_t *)qraw, krows, off, n, scores, scale, 2, 1);
        else
            scores_dpbf16((const uint16_t *)qraw, krows, off, n, scores, scale, C / 2, 1);
    } else
#else
    (void)qraw, (void)scale; /* the dot products on raw bfloat16 are AVX512-BF16's */
#endif
    {
        BY_HEAD_DIM(16, scores_avx, q, krows, off, n, scores)
    }
    const float inv = 1.0f / softmax_numerators(scores, n);
    BY_HEAD_DIM(16, weighted_sum_avx, scores, vrows, off, n, out)
    for (int d = 0; d < 16 * C; d++) out[d] *= inv;
}
#endif

#ifdef __AVX512BF16__
#define GROUP_ACCS 16 /* accumulators of the grouped weighted sum: G * head_dim / 16 at most */

/* All G query heads of one KV head at once (bfloat16, head_dim = 16 C, C even, G * C <= GROUP_ACCS):
 * each head's scores as head_avx makes them (the first head's pass prefetches the rows, the others find
 * them in cache), then one pass over the values for every head, so each value row is loaded and widened
 * to float32 once rather than G times.  Each head's sums run over the keys in the same order as in
 * head_avx, so the results are the same bits.  `scores` has room for G * n floats; accs gets G * D. */
INLINE void group_dpbf16(const uint16_t *q, float scale, const char *const *krows, const char *const *vrows,
                         size_t off, int64_t n, float *scores, float *accs, const int G, const int C) {
    float inv[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        scores_dpbf16(q + (size_t)g * 16 * C, krows, off, n, scores + (size_t)g * n, scale, C / 2, g == 0);
        inv[g] = 1.0f / softmax_numerators(scores + (size_t)g * n, n);
    }
    __m512 acc[GROUP_ACCS];
    for (int j = 0; j < G * C; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_row(vrows[i + PREFETCH_AHEAD] + off, 2 * 16 * C);
        __m512 v[GROUP_ACCS];
        for (int c = 0; c < C; c++) v[c] = load16(vrows[i] + off, 16 * c, 1);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(scores[(size_t)g * n + i]);
            for (int c = 0; c < C; c++) acc[g * C + c] = _mm512_fmadd_ps(w, v[c], acc[g * C + c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(accs + (size_t)(g * C + c) * 16, acc[g * C + c]);
    for (int g = 0; g < G; g++)
        for (int d = 0; d < 16 * C; d++) accs[g * 16 * C + d] *= inv[g];
}
#endif

/* Whether attend() takes the G query heads of a KV head together (group_dpbf16), which needs G * n
 * floats of scores rather than n. */
static inline int grouped(const Args *a) {
#ifdef __AVX512BF16__
    return a->bf16 && a->head_dim % 32 == 0 && a->group * (a->head_dim / 16) <= GROUP_ACCS;
#else
    (void)a;
    return 0;
#endif
}

/* The G query heads at `q` (G * D contiguous elements) against n keys and values read in place: key i
 * at krows[i] + off bytes, value i at vrows[i] + off; writes G * D elements at `out`.  `scores` has
 * room for n floats, G * n where grouped(a). */
static void attend(const Args *a, const char *const *krows, const char *const *vrows, size_t off, int64_t n,
                   const char *q, char *out, float *restrict scores) {
    const int D = a->head_dim, G = a->group;
    float qf[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], row[MAX_HEAD_DIM];
#ifdef __AVX512BF16__
    if (grouped(a)) {
        float accs[GROUP_ACCS * 16];
        if (D == 64 && G == 3) /* SmolLM2's heads, unrolled */
            group_dpbf16((const uint16_t *)q, a->scale, krows, vrows, off, n, scores, accs, 3, 4);
        else
            group_dpbf16((const uint16_t *)q, a->scale, krows, vrows, off, n, scores, accs, G, D / 16);
        uint16_t *o = (uint16_t *)out;
        for (int j = 0; j < G * D; j++) o[j] = f32_to_bf16(accs[j]);
        return;
    }
#endif
    for (int g = 0; g < G; g++) {
        load_row(q + (size_t)(g * D) * (a->bf16 ? 2 : 4), a->bf16, qf, D);
        for (int d = 0; d < D; d++) qf[d] *= a->scale;
#ifdef __AVX512F__
        if (D % 16 == 0) {
            head_avx(qf, q + (size_t)(g * D) * (a->bf16 ? 2 : 4), a->scale, krows, vrows, off, n, scores, acc,
                     D / 16, a->bf16);
        } else
#elif AVX2_ATTENTION
        if (D % 8 == 0) {
            head_avx2(qf, krows, vrows, off, n, scores, acc, D / 8, a->bf16);
        } else
#endif
        {
            for (int64_t i = 0; i < n; i++) {
                load_row(krows[i] + off, a->bf16, row, D);
                scores[i] = dot(qf, row, D);
            }
            const float inv = 1.0f / softmax_numerators(scores, n);
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                load_row(vrows[i] + off, a->bf16, row, D);
                axpy(acc, scores[i], row, D);
            }
            for (int d = 0; d < D; d++) acc[d] *= inv;
        }
        if (a->bf16) {
            uint16_t *o = (uint16_t *)out + g * D;
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[d]);
        } else {
            memcpy((float *)out + g * D, acc, sizeof(float) * (size_t)D);
        }
    }
}

/* Per-thread scratch, kept across calls (the pool's threads live as long as the process): a fresh
 * multi-MB buffer per call would be page-faulted in every time.  Grows to the longest context seen. */
static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;

/* The visible keys of sequence b: [first, pos]. */
static inline int64_t first_key(const Args *a, int64_t pos) { return first_visible_key(pos, a->window); }

/* Where each visible key's and value's token row (every KV head) of sequence b sits in the cache. */
static int64_t token_rows(const Args *a, int64_t b, const char **krows, const char **vrows) {
    const int64_t bs = a->block_size, *table = a->block_table + b * a->table_width;
    const size_t token = (size_t)(a->num_kv_heads * a->head_dim) * (a->bf16 ? 2 : 4);
    const int64_t pos = a->positions[b], first = first_key(a, pos);
    for (int64_t j = first; j <= pos; j++) {
        const size_t row = (size_t)(((table[j / bs] * a->num_layers + a->layer) * 2) * bs + j % bs);
        krows[j - first] = (const char *)a->cache + row * token;
        vrows[j - first] = (const char *)a->cache + (row + (size_t)bs) * token;
    }
    return pos + 1 - first;
}

/* KV heads [h0, h1) of sequence b. */
static int attend_heads(const Args *a, int64_t b, int64_t h0, int64_t h1) {
    const size_t elem = a->bf16 ? 2 : 4;
    const int64_t n = a->positions[b] + 1 - first_key(a, a->positions[b]);
    /* the row pointers of its keys and values, then the scores */
    const size_t num_scores = (size_t)(grouped(a) ? a->group * n : n);
    const char **rows =
        grow_scratch(&scratch, &scratch_bytes, 2 * sizeof(char *) * (size_t)a->max_keys + sizeof(float) * num_scores);
    if (rows == NULL) return 1;
    const char **krows = rows, **vrows = rows + a->max_keys;
    float *scores = (float *)(rows + 2 * a->max_keys);
    token_rows(a, b, krows, vrows);
    for (int64_t kvh = h0; kvh < h1; kvh++) {
        const size_t q0 = (size_t)(b * a->q_stride + kvh * a->group * a->head_dim) * elem;
        const size_t o0 = (size_t)((b * a->num_heads + kvh * a->group) * a->head_dim) * elem;
        attend(a, krows, vrows, (size_t)(kvh * a->head_dim) * elem, n, (const char *)a->q + q0,
               (char *)a->out + o0, scores);
    }
    return 0;
}

/* Returns 0, or 1 when scratch memory could not be allocated, 2 for a shape the kernel cannot take, 3 for
 * a position, block id or layer outside the table or the cache (nothing is read then). */
int pdkv_paged_decode(const void *q, const void *cache, void *out, const int64_t *block_table,
                      const int64_t *positions, int64_t num_seqs, int64_t table_width, int64_t num_layers,
                      int64_t layer, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t window, float scale, int64_t bf16, int64_t q_stride,
                      int64_t num_blocks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 || table_width <= 0)
        return 2;
    Args a = {q, cache, out, block_table, positions, table_width, num_layers, layer, block_size,
              num_heads, num_kv_heads, (int)head_dim, (int)(num_heads / num_kv_heads), (int)(bf16 != 0),
              window, scale, num_seqs, table_width * block_size, /* keys of the longest row, at most */
              q_stride};
    /* Every address read must lie in the cache: a bad table raises in Python instead of faulting here. */
    if (layer < 0 || layer >= num_layers) return 3;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t pos = positions[b];
        if (pos < 0 || pos >= a.max_keys) return 3;
        for (int64_t k = first_key(&a, pos) / block_size; k <= pos / block_size; k++)
            if (block_table[b * table_width + k] < 0 || block_table[b * table_width + k] >= num_blocks) return 3;
    }
    int failed = 0;
#pragma omp parallel
    {
        /* Whole sequences per task while there are enough to share out; one KV head per task
         * otherwise, so a small batch still uses every thread. */
        const int whole = num_seqs >= 2 * omp_get_num_threads();
        const unsigned csr = bf16_mode_enter(bf16);
        int bad = 0;
        if (whole) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_seqs; b++)
                if (!bad) bad = attend_heads(&a, b, 0, num_kv_heads);
        } else {
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < num_seqs; b++)
                for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
                    if (!bad) bad = attend_heads(&a, b, kvh, kvh + 1);
        }
        bf16_mode_leave(bf16, csr);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}

/* RMSNorm of `rows` rows of `hidden` elements, as transformers computes it (float32 inside):
 *     h   = x + delta                                  (rounded to the dtype; only when delta != NULL)
 *     out = weight * dtype(h * rsqrt(mean(h^2) + eps))
 * With delta, h is written to h_out: the residual add of a decoder layer and the norm after it in one
 * call.  The sum of squares is accumulated 16 lanes at a time, so the mean may differ from torch's in its
 * last bit; everything else rounds exactly as torch does. */
#define NORM_STACK 2048

/* Rows [r0, r1) of pdkv_rms_norm on the calling thread; returns 1 where its buffers could not be had. */
static int rms_norm_rows(const void *x, const void *delta, void *h_out, const void *weight, void *out, int64_t r0,
                         int64_t r1, int n, float eps, int64_t bf16) {
    const size_t elem = bf16 ? 2 : 4;
    const unsigned csr = bf16_mode_enter(bf16);
    float stack[3 * NORM_STACK]; /* a model's rows up to NORM_STACK wide: no allocation per call */
    const int small = n <= NORM_STACK;
    float *row = small ? stack : malloc(sizeof(float) * (size_t)n);
    float *w = small ? stack + NORM_STACK : malloc(sizeof(float) * (size_t)n);
    float *d = delta == NULL ? NULL : small ? stack + 2 * NORM_STACK : malloc(sizeof(float) * (size_t)n);
    const int bad = row == NULL || w == NULL || (delta != NULL && d == NULL);
    if (!bad) load_row(weight, (int)bf16, w, n);
    for (int64_t r = r0; r < r1 && !bad; r++) {
        const size_t at = (size_t)r * (size_t)n;
        load_row((const char *)x + at * elem, (int)bf16, row, n);
        if (delta != NULL) {
            load_row((const char *)delta + at * elem, (int)bf16, d, n);
            if (bf16) {
                uint16_t *h = (uint16_t *)h_out + at;
                int i = 0;
#if PDKV_BF16
                for (; i + 16 <= n; i += 16) {
                    const __m256i sum = to_bf16x16(_mm512_add_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(d + i)));
                    _mm256_storeu_si256((__m256i *)(h + i), sum);
                    _mm512_storeu_ps(row + i, from_bf16x16(sum));
                }
#endif
                for (; i < n; i++) {
                    h[i] = f32_to_bf16(row[i] + d[i]);
                    row[i] = bf16_to_f32(h[i]);
                }
            } else {
                float *h = (float *)h_out + at;
                for (int i = 0; i < n; i++) h[i] = row[i] = row[i] + d[i];
            }
        }
        const float inv = 1.0f / sqrtf(dot(row, row, n) / (float)n + eps);
        if (bf16) {
            uint16_t *o = (uint16_t *)out + at;
            int i = 0;
#if PDKV_BF16
            /* to_bf16x16 rounds to nearest even, as torch does (NaN stays NaN) */
            const __m512 iv = _mm512_set1_ps(inv);
            for (; i + 16 <= n; i += 16) {
                const __m512 yf = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(row + i), iv));
                const __m512 yw = _mm512_mul_ps(_mm512_loadu_ps(w + i), yf);
                _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(yw));
            }
#endif
            for (; i < n; i++) o[i] = f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(row[i] * inv)));
        } else {
            float *o = (float *)out + at;
            for (int i = 0; i < n; i++) o[i] = w[i] * (row[i] * inv);
        }
    }
    if (!small) {
        free(row);
        free(w);
        free(d);
    }
    bf16_mode_leave(bf16, csr);
    return bad;
}

int pdkv_rms_norm(const void *x, const void *delta, void *h_out, const void *weight, void *out, int64_t rows,
                  int64_t hidden, float eps, int64_t bf16) {
    const int n = (int)hidden;
    if (n <= 0 || n > 65536) return 2;
    /* a call too small to share out runs here, without an OpenMP region (~0.35 us even when serial) */
    if (rows * hidden < PARALLEL_MIN) return rms_norm_rows(x, delta, h_out, weight, out, 0, rows, n, eps, bf16);
    int failed = 0;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        if (rms_norm_rows(x, delta, h_out, weight, out, rows * tid / nt, rows * (tid + 1) / nt, n, eps, bf16)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* silu16 on 8 lanes (float32 activations on AVX2; the bfloat16 ones on both halves, below). */
INLINE __m256 silu8(__m256 x) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_mul_ps(x, _mm256_blendv_ps(sig, _mm256_mul_ps(sig, e), neg));
}
#endif
#if PDKV_V512 && !defined(PDKV_ON_AVX2)
/* x * sigmoid(x): exp(-|x|) from the polynomial (its range is x <= 0), then 1 / (1 + exp(-x)) either
 * way -- x >= 0: x / (1 + e);  x < 0: x * e / (1 + e)  (= x / (1 + 1/e)). */
INLINE __m512 silu16(__m512 x) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    return _mm512_mul_ps(x, _mm512_mask_mul_ps(sig, neg, sig, e));
}
#endif
#ifdef PDKV_ON_AVX2
/* silu16 on the halves: the compare's lanes blend directly (the same bits: each lane's operations are
 * silu16's, and exp512 is exp256 on each half here). */
INLINE __m512 silu16(__m512 x) { return (__m512){silu8(x.lo), silu8(x.hi)}; }
#endif

/* Rows [r0, r1) of pdkv_silu_mul on the calling thread. */
static void silu_mul_rows(const void *gate_up, void *out, int64_t r0, int64_t r1, int64_t inter, int64_t bf16) {
    const size_t elem = bf16 ? 2 : 4;
    const unsigned csr = bf16_mode_enter(bf16);
    for (int64_t r = r0; r < r1; r++) {
        const char *g = (const char *)gate_up + (size_t)(r * 2 * inter) * elem;
        const char *u = g + (size_t)inter * elem;
        char *o = (char *)out + (size_t)(r * inter) * elem;
        int64_t i = 0;
#if PDKV_BF16
        for (; bf16 && i + 16 <= inter; i += 16) {
            const __m512 x = load16(g, (size_t)i, 1), up = load16(u, (size_t)i, 1);
            const __m512 sf = round_bf16x16(silu16(x));
            _mm256_storeu_si256((__m256i *)((uint16_t *)o + i), to_bf16x16(_mm512_mul_ps(sf, up)));
        }
#endif
        /* float32 (the fused decode layer on packed weights): silu(x) * up with the same exponential */
#ifdef __AVX512F__
        for (; !bf16 && i + 16 <= inter; i += 16) {
            const __m512 x = _mm512_loadu_ps((const float *)g + i), up = _mm512_loadu_ps((const float *)u + i);
            _mm512_storeu_ps((float *)o + i, _mm512_mul_ps(silu16(x), up));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; !bf16 && i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps((const float *)g + i), up = _mm256_loadu_ps((const float *)u + i);
            _mm256_storeu_ps((float *)o + i, _mm256_mul_ps(silu8(x), up));
        }
#endif
        for (; i < inter; i++) {
            if (bf16) {
                const float x = bf16_to_f32(((const uint16_t *)g)[i]);
                const float s = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
                ((uint16_t *)o)[i] = f32_to_bf16(s * bf16_to_f32(((const uint16_t *)u)[i]));
            } else {
                const float x = ((const float *)g)[i];
                ((float *)o)[i] = (x / (1.0f + expf(-x))) * ((const float *)u)[i];
            }
        }
    }
    bf16_mode_leave(bf16, csr);
}

/* SwiGLU's activation: gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] with
 *     out = dtype(silu(gate)) * up,   silu(x) = x / (1 + exp(-x))
 * rounded where torch rounds (after the SiLU, after the product).  exp is the polynomial above for
 * -x <= 0 and exp(-x) = 1 / exp(x) otherwise; it may differ from torch's in the last bit of float32. */
int pdkv_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t bf16) {
    if (inter <= 0) return 2;
    if (rows * inter < PARALLEL_MIN) { /* here, without an OpenMP region (see pdkv_rms_norm) */
        silu_mul_rows(gate_up, out, 0, rows, inter, bf16);
        return 0;
    }
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        silu_mul_rows(gate_up, out, rows * tid / nt, rows * (tid + 1) / nt, inter, bf16);
    }
    return 0;
}

/* Rows [r0, r1) of pdkv_rope_write_kv on the calling thread (its arguments checked there). */
static void rope_rows(const void *qkv, const void *cos, const void *sin, void *qk, void *cache,
                      const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t r0, int64_t r1,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_layers, int64_t layer,
                      int64_t block_size, int64_t bf16, int64_t kv_order) {
    const int64_t D = head_dim, half = D / 2, heads = num_heads + num_kv_heads;
    const size_t elem = bf16 ? 2 : 4, token = (size_t)(num_kv_heads * D) * elem;
    const unsigned csr = bf16_mode_enter(bf16);
    for (int64_t t = r0; t < r1; t++) {
        const size_t at = (size_t)(t * (heads + num_kv_heads) * D), cs = (size_t)(t * half);
        const size_t slot = (size_t)(((slot_blocks[t] * num_layers + layer) * 2) * block_size + slot_offsets[t]);
        char *k_slot = (char *)cache + slot * token, *v_slot = (char *)cache + (slot + (size_t)block_size) * token;
        for (int64_t h = 0; h < heads; h++) {
            const size_t x0 = at + (size_t)(h * D), o0 = (size_t)((t * heads + h) * D);
            if (bf16) {
                const uint16_t *x = (const uint16_t *)qkv + x0, *c = (const uint16_t *)cos + cs;
                const uint16_t *s = (const uint16_t *)sin + cs;
                uint16_t *o = (uint16_t *)qk + o0;
                int64_t i = 0;
#if PDKV_BF16
                for (; i + 16 <= half; i += 16) {
                    const __m512 x1 = load16(x, (size_t)i, 1), x2 = load16(x, (size_t)(i + half), 1);
                    const __m512 ci = load16(c, (size_t)i, 1), si = load16(s, (size_t)i, 1);
                    const __m512 a = round_bf16x16(_mm512_mul_ps(x1, ci)), b = round_bf16x16(_mm512_mul_ps(x2, si));
                    const __m512 e = round_bf16x16(_mm512_mul_ps(x2, ci)), f = round_bf16x16(_mm512_mul_ps(x1, si));
                    _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_sub_ps(a, b)));
                    _mm256_storeu_si256((__m256i *)(o + i + half), to_bf16x16(_mm512_add_ps(e, f)));
                }
#endif
                for (; i < half; i++) {
                    const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                    const float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                    const float a = bf16_to_f32(f32_to_bf16(x1 * ci)), b = bf16_to_f32(f32_to_bf16(x2 * si));
                    const float e = bf16_to_f32(f32_to_bf16(x2 * ci)), f = bf16_to_f32(f32_to_bf16(x1 * si));
                    o[i] = f32_to_bf16(a - b);
                    o[i + half] = f32_to_bf16(e + f);
                }
            } else {
                const float *x = (const float *)qkv + x0, *c = (const float *)cos + cs, *s = (const float *)sin + cs;
                float *o = (float *)qk + o0;
                for (int64_t i = 0; i < half; i++) {
                    const float a = x[i] * c[i], b = x[i + half] * s[i];
                    const float e = x[i + half] * c[i], f = x[i] * s[i];
                    o[i] = a - b;
                    o[i + half] = e + f;
                }
            }
            if (h >= num_heads && kv_order == KV_CANONICAL) /* a key: into its slot */
                memcpy(k_slot + (size_t)((h - num_heads) * D) * elem, (const char *)qk + o0 * elem, (size_t)D * elem);
        }
        const char *values = (const char *)qkv + (at + (size_t)(heads * D)) * elem;
        if (kv_order == KV_CANONICAL) {
            memcpy(v_slot, values, token);
        } else { /* simd.h's paired order: the block's slabs of this layer, position slot_offsets[t] */
            const size_t slab = (size_t)((slot_blocks[t] * num_layers + layer) * 2 * block_size * num_kv_heads * D);
            write_paired(cache, slab, (const uint16_t *)qk + (size_t)(t * heads + num_heads) * D,
                         (const uint16_t *)values, slot_offsets[t], block_size, num_kv_heads, D);
        }
    }
    bf16_mode_leave(bf16, csr);
}

/* Rotary embedding of the queries and keys of a step, and the keys and values into their cache slots:
 *     qkv [T, (H + 2 Hkv) * D]  (the fused projection's output, contiguous)
 *     cos, sin [T, D / 2]       (in the activation dtype)
 *     qk [T, H + Hkv, D]        out: rotated queries, then rotated keys
 *     cache slot of row t: block slot_blocks[t], offset slot_offsets[t]: rotated K and V of every KV head
 * Rotation in the half-split convention, each product and the sum rounded to the dtype as torch does:
 *     out[i] = x[i] cos[i] - x[i + D/2] sin[i],   out[i + D/2] = x[i + D/2] cos[i] + x[i] sin[i]. */
int pdkv_rope_write_kv(const void *qkv, const void *cos, const void *sin, void *qk, void *cache,
                       const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t rows, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t num_layers, int64_t layer,
                       int64_t block_size, int64_t bf16, int64_t num_blocks, int64_t kv_order) {
    if (head_dim <= 0 || head_dim % 2 || head_dim > MAX_HEAD_DIM) return 2;
    if (kv_order != KV_CANONICAL && (kv_order != KV_PAIRED || !bf16 || block_size % 2)) return 2;
    if (layer < 0 || layer >= num_layers) return 3; /* 3: a slot outside the cache; nothing written */
    for (int64_t t = 0; t < rows; t++)
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks || slot_offsets[t] < 0 || slot_offsets[t] >= block_size)
            return 3;
    const int64_t heads = num_heads + num_kv_heads;
    /* In the paired order a row's keys go to every line of its block's K slab (one dword each): writes
     * that wait on their lines' reads, the slabs long gone from the caches since the last step, so a
     * few rows already take both threads (an Emerald Rapids Xeon, batch 8, 30 layers: 0.26 -> 0.17 ms). */
    const int parallel = rows * heads * head_dim >= PARALLEL_MIN || (kv_order == KV_PAIRED && rows >= 4);
    const int threads = rows < omp_get_max_threads() ? (int)rows : omp_get_max_threads(); /* a row each */
    if (!parallel) { /* here, without an OpenMP region (see pdkv_rms_norm) */
        rope_rows(qkv, cos, sin, qk, cache, slot_blocks, slot_offsets, 0, rows, num_heads, num_kv_heads, head_dim,
                  num_layers, layer, block_size, bf16, kv_order);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        rope_rows(qkv, cos, sin, qk, cache, slot_blocks, slot_offsets, rows * tid / nt, rows * (tid + 1) / nt,
                  num_heads, num_kv_heads, head_dim, num_layers, layer, block_size, bf16, kv_order);
    }
    return 0;
}

/* Greedy sampling over logits [rows, cols] (contiguous), float32 or bfloat16 (widened exactly): out[r] is
 * the index of row r's first NaN if it has one, else of its first maximum -- what torch's
 * max(dim=-1).indices returns over the float32 values, which reduces with indices one element at a time
 * (1.3 ms for 32 x 49152 here, against ~0.1 ms for these two vector passes: the maximum, then the first
 * index that equals it).  The bfloat16 entry reads the LM head's output as it is, with no float32 copy
 * made first (a batch-32 step's 6 MB written and read again). */
INLINE float logit_at(const void *row, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#ifdef __AVX512F__
INLINE __m512 logits16(const void *row, int64_t i, const int bf16) {
    return bf16 ? from_bf16x16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)))
                : _mm512_loadu_ps((const float *)row + i);
}
#endif

INLINE int64_t argmax_row(const void *row, int64_t cols, const int bf16) {
    int64_t i = 0;
    float best = -INFINITY;
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= cols; i += 16) {
        const __m512 v = logits16(row, i, bf16);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break; /* a NaN in these 16: found below */
        m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
#endif
    for (; i < cols; i++) { /* the tail, or from the 16 that hold the first NaN */
        const float v = logit_at(row, i, bf16);
        if (v != v) return i;
        if (v > best) best = v;
    }
    i = 0;
#ifdef __AVX512F__
    const __m512 b = _mm512_set1_ps(best);
    for (; i + 16 <= cols; i += 16)
        if (_mm512_cmp_ps_mask(logits16(row, i, bf16), b, _CMP_EQ_OQ)) break;
#endif
    for (; i < cols; i++)
        if (logit_at(row, i, bf16) == best) return i;
    return 0; /* every value -inf: the first */
}

static int argmax_rows(const void *x, int64_t *out, int64_t rows, int64_t cols, const int bf16) {
    if (rows < 0 || cols <= 0) return 2;
    const size_t row_bytes = (size_t)cols * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++)
        out[r] = bf16 ? argmax_row((const char *)x + (size_t)r * row_bytes, cols, 1)
                      : argmax_row((const char *)x + (size_t)r * row_bytes, cols, 0);
    return 0;
}

int pdkv_argmax_f32(const float *x, int64_t *out, int64_t rows, int64_t cols) {
    return argmax_rows(x, out, rows, cols, 0);
}

int pdkv_argmax_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t cols) {
    return argmax_rows(x, out, rows, cols, 1);
}
