/* Linears over GGUF's quantized block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), run as
 * the file ships them (Q5_0 and Q5_1 in Q8's layout: engine/model/quant_blocks.py).
 *
 *   pdkv_qlinear        out[m, n] = sum_k x[m, k] w[n, k]      (w packed, x and out bfloat16 or float32)
 *   pdkv_qdequant_rows  rows of w as dense floats (embedding lookups, tests, the torch fallback)
 *   pdkv_read_bandwidth the machine's read bandwidth probe (a sum over a buffer)
 *   pdkv_evict          a buffer's lines dropped from the caches (the probe's and the weights', timed cold)
 *
 * Format 2 (FMT_BF16) is dense bfloat16, handed to bf16_linear.c: one entry point for every packed
 * linear, so decode_layer.c runs a layer whatever its weights' format.
 *
 * The packed layout (engine/model/quant_blocks.py writes it from the file's blocks, once, at load).  Output
 * rows go in groups of 16 (the 16 lanes of a vector), the inputs in GGUF's blocks of 32; per group g and
 * block b, contiguous, g-major (a thread streams its groups front to back):
 *
 *   Q4 (Q4_0, Q4_1)  256 bytes of quants, then 16 float16 scales d, then 16 float16 mins m (320 bytes):
 *                    byte [s][r][j] (s < 4, r < 16, j < 4) holds row r's quant of input 4s + j in its low
 *                    nibble and of input 16 + 4s + j in its high one -- GGUF's own byte qs[4s + j] of the
 *                    row's block, so repacking is a transpose.  w = q d + m (Q4_0: m = -8 d, exact).
 *   Q4F (Q4_K)       the same 256 bytes, then 16 float32 scales d and 16 float32 mins m (384 bytes): a
 *                    Q4_K super-block's eight sub-blocks of 32, each its own block here -- d = d_K sc and
 *                    m = -dmin_K mn, float16 times a 6-bit integer, exact in float32 (not in float16).
 *   Q8F (Q5_K)       Q8's 512 bytes (the 5-bit quant as it is), then 16 float32 scales and 16 float32
 *                    mins (640 bytes): Q4F's scales over Q8's bytes.
 *   Q8H (Q6_K)       Q8's 512 bytes (the quant less 32), then 16 float32 scales of inputs 0-15 and 16
 *                    of inputs 16-31 (640 bytes): a Q6_K sub-block of 16 has a scale of its own, d_K sc,
 *                    an 8-bit integer times a float16, exact in float32.  w = q d_half, no min.
 *   Q8 (Q8_0)        512 bytes, byte [s][r][j] (s < 8) = row r's signed quant of input 4s + j, then d
 *                    and m as above (m = 0): w = q d + m again.
 *
 * So each 64-byte run holds, per 32-bit lane r, row r's quants of four consecutive inputs: what one
 * vpdpbusd (four byte products into each int32 lane) and one row of an AMX-INT8 B tile take as they are.
 *
 * Activations are quantized per row and block of 32 to int16: a = da * qa with da = max|a| / QA_MAX and
 * |qa| <= QA_MAX = 32639 (an error of at most 1/65278 of the block's largest value: 256x finer than
 * llama.cpp's int8 activations, which move greedy picks at logit margins of 0.1-0.4 on SmolLM2), then a
 * block's contribution to one output is  d (da sum q qa) + m (da sum qa)  -- the integer sum exact.  QA_MAX
 * (not 32767) lets qa split into two signed bytes, qa = 256 hi + lo with lo = qa's low byte read signed
 * and hi = (qa - lo) / 256, both in -128..127 -- so that
 *
 *     sum q qa = 256 sum q hi + sum q lo,
 *
 * two byte dot products: AVX512-VNNI's vpdpbusd (unsigned by signed bytes, four products into each int32
 * lane; Q8's signed quants go in as q + 128, and 128 sum(qa) comes back out), 16 output rows in the
 * lanes, each four activation bytes broadcast: no horizontal sums.  Against the int16 pairs of vpdpwssd
 * this unpacks the quants with a third of the operations (one 64-byte load and three logic operations
 * per 128 quants) for the same number of dot products: an AMD EPYC Zen 4, one core, a Q4 tile from L1 in
 * 16.7-17.4 cycles against 25 (docs/BENCHMARKS.md).  Each output is summed over the blocks in order by one
 * thread, whatever the number of rows or threads: a row's result depends on that row alone (the engine's
 * determinism rule, engine/determinism.py).
 *
 * Without AVX512-VNNI, a CPU with AVX2 (+ FMA, F16C) runs quant_avx2.h's kernels: the same integer sums
 * from the int16 qa by vpmaddwd, the same float operations, the same bits.
 * On a CPU with AMX-INT8, calls of QAMX_MIN_ROWS rows and more run quant_amx.h's tiles (every format but
 * Q8H, whose half-block scales stay in the vectors): the same integer sums (the same hi and lo bytes), the
 * same float operations after them, the same bits.
 *
 * Returns 0; 1 when this build has neither (the caller keeps its dense path); 2 for a shape or
 * format it does not serve; 3 when memory for the activation buffers runs out.
 */

#define _GNU_SOURCE /* syscall(), for the AMX tiles' permission (quant_amx.h) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "simd.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define FMT_Q8 0
#define FMT_Q4 1
#define FMT_BF16 2 /* dense bfloat16 weights: bf16_linear.c's layout and kernel */
#define FMT_Q4F 3  /* Q4's quants with float32 scales and mins (Q4_K's sub-blocks) */
#define FMT_Q8H 4  /* Q8's quants with a float32 scale per half block (Q6_K's sub-blocks of 16) */
#define FMT_Q8F 5  /* Q8's quants with float32 scales and mins (Q5_K's sub-blocks) */
#define GROUP 16
#define QBLOCK 32
#define MT 8        /* activation rows per tile: the unpacked weights are reused across them */
#define MCHUNK 64   /* activation rows per pass over the weights: their int16 copy stays in L2 */
#define PARALLEL_MIN_WORK 32768
#define PRIVATE_ROWS 4 /* activation rows each thread quantizes for itself (pdkv_qlinear) */
#define QAMX_MIN_ROWS 8 /* rows from which quant_amx.h's tiles serve a call, where they are on */
#define QA_MAX 32639 /* the int16 activations' range, +-: a = 256 hi + lo in two signed bytes (the header) */
#ifndef PREFETCH
#define PREFETCH 1024 /* bytes ahead of the tile being read: the weights stream from memory */
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDKV_QUANT_BUILT 1 /* the AVX-512 kernels below */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDKV_QUANT_BUILT 2 /* quant_avx2.h's: the same arithmetic, the same bits */
#else
#define PDKV_QUANT_BUILT 0
#endif

int pdkv_quant_built(void) { return PDKV_QUANT_BUILT; }

#if PDKV_QUANT_BUILT
/* Each thread's activation buffer for a few rows, kept across calls (pdkv_qlinear). */
static _Thread_local void *private_acts;
static _Thread_local size_t private_bytes;
#endif

/* How a batch-1 call's threads (group_row1, quant_avx2.h's too) prefetch the weights they stream:
 * `near` bytes ahead of the tile they read into L1 -- non-temporally where `nta` (prefetchnta: the
 * weights pass through without pushing out of the caches what the rest of the step reuses, the KV cache,
 * the activations, the interpreter's own data) -- and `far` bytes ahead into L2 (0: not).  Which is
 * fastest is the CPU's: an Intel Xeon (Emerald Rapids) 1 KB and 2 KB, temporal; an AMD EPYC Zen 5 4 KB
 * non-temporal, no L2 prefetch (a Zen 4 too: 4.43 -> 4.07 ms at 31-32 GB/s, docs/BENCHMARKS.md, "An AMD
 * EPYC Zen 4 again").  The Zen 5's batch-1 step from memory, in-process A/Bs with the setting switched
 * between rounds (docs/BENCHMARKS.md, "An AMD EPYC Zen 5 again: the batch-1 weights prefetched further
 * and non-temporally"): 1 KB / 2 KB against 4 KB / 16 KB 2.62-2.66 -> 2.38-2.45 ms at 79-84 GB/s;
 * 4 KB / 16 KB against 4 KB non-temporal 2.68-2.90 -> 2.45-2.63 ms at 45-53 GB/s and 2.63 -> 2.40 at 80.
 * quant_avx2.h's kernel (built with -mno-avx512f on the same Zen 5; it had 1 KB into L1 alone): 3.42 ->
 * 3.22, 3.71 -> 3.56 and 3.68 -> 3.53 ms non-temporal; on an Intel CPU without AVX-512 it now takes the
 * Xeon's 2 KB L2 prefetch too (not measured there).  The same bits whatever they are; engine/native.py
 * sets them as the library loads (engine/native_linear.py's row_prefetch_default). */
static int64_t row_prefetch[3] = {1024, 2048, 0}; /* near, far, nta */
#define PREFETCH_MAX ((int64_t)1 << 20)

/* 0 <= near, far <= 1 MB, nta 0 or 1: the prefetches from now on; else no change.  The setting in use
 * into now[0 .. 2] (near, far, nta) where now is not NULL.  Returns 0, or 2 for a setting refused. */
int pdkv_quant_prefetch(int64_t near, int64_t far, int64_t nta, int64_t *now) {
    const int ok = near >= 0 && far >= 0 && near <= PREFETCH_MAX && far <= PREFETCH_MAX && (nta == 0 || nta == 1);
    if (ok) {
        row_prefetch[0] = near;
        row_prefetch[1] = far;
        row_prefetch[2] = nta;
    }
    if (now != NULL)
        for (int i = 0; i < 3; i++) now[i] = row_prefetch[i];
    return ok ? 0 : 2;
}

#if PDKV_QUANT_BUILT
/* The lines of one tile (tb bytes at t) `near` bytes on into L1, non-temporally where nta, and `far`
 * bytes on into L2 where far > 0 (row_prefetch's meaning). */
INLINE void prefetch_tile(const uint8_t *t, int64_t tb, int64_t near, int64_t far, int nta) {
    for (int64_t line = 0; line < tb; line += 64) {
        prefetch_l1(t + near + line, nta);
        if (far > 0) _mm_prefetch((const char *)t + far + line, _MM_HINT_T2);
    }
}
#endif

/* Whether a format's quants are Q4's nibbles (Q4, Q4F), else Q8's bytes. */
static inline int q4_quants(int64_t fmt) { return fmt == FMT_Q4 || fmt == FMT_Q4F; }

/* Bytes of one (group, block) tile of the packed layout. */
static int64_t tile_bytes(int64_t fmt) {
    return fmt == FMT_Q4 ? 320 : fmt == FMT_Q4F ? 384 : fmt == FMT_Q8H || fmt == FMT_Q8F ? 640 : 576;
}

/* Whether a format's scales (and mins, or the second half's scales) are float32, else float16. */
static inline int float_scales(int64_t fmt) { return fmt == FMT_Q4F || fmt == FMT_Q8H || fmt == FMT_Q8F; }
static int64_t quant_bytes(int64_t fmt) { return q4_quants(fmt) ? 256 : 512; }

/* The quantized activations of rows j, j + 1, ... of a call (quantize_row's: the header's): row i's q at
 * q + 2 i k bytes, its per-block sums of qa, of the first half's qa (Q8H's two scales), steps da and
 * da * sum at i k / 32 on. */
typedef struct {
    const uint8_t *q;
    const int32_t *is, *ih;
    const float *da, *sa;
} Acts;

/* Rows j, j + 1, ... of a. */
static inline Acts acts_from(Acts a, int64_t j, int64_t k) {
    const int64_t s = j * (k / QBLOCK);
    return (Acts){a.q + 2 * j * k, a.is + s, a.ih + s, a.da + s, a.sa + s};
}

void pdkv_side_stream_of(const char *const **base, int64_t *n, int64_t *bytes);
int pdkv_bf16_linear(const void *x, int64_t rows, int64_t k, const void *packed, int64_t n, void *out,
                     int64_t ldo, int64_t col0);
int pdkv_bf16_rows(const void *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out);

int64_t pdkv_qpacked_bytes(int64_t fmt, int64_t n, int64_t k) {
    if (fmt == FMT_BF16) return (n > 0 && k > 0 && k % 2 == 0) ? ((n + GROUP - 1) / GROUP) * GROUP * k * 2 : -1;
    if (fmt < FMT_Q8 || fmt > FMT_Q8F || fmt == FMT_BF16 || n <= 0 || k <= 0 || k % QBLOCK) return -1;
    return ((n + GROUP - 1) / GROUP) * (k / QBLOCK) * tile_bytes(fmt);
}

static float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 113;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One packed row r's weights as floats: out[k] (the layout in the header). */
static void dequant_row(const uint8_t *packed, int64_t fmt, int64_t k, int64_t r, float *out) {
    const int64_t blocks = k / QBLOCK, tb = tile_bytes(fmt), qb = quant_bytes(fmt);
    const int64_t g = r / GROUP, lane = r % GROUP;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *t = packed + (g * blocks + b) * tb;
        float d, m;
        if (float_scales(fmt)) {
            memcpy(&d, t + qb + 4 * lane, 4);
            memcpy(&m, t + qb + 64 + 4 * lane, 4);
        } else {
            uint16_t dh, mh;
            memcpy(&dh, t + qb + 2 * lane, 2);
            memcpy(&mh, t + qb + 32 + 2 * lane, 2);
            d = half_to_f32(dh), m = half_to_f32(mh);
        }
        float *o = out + b * QBLOCK;
        if (q4_quants(fmt)) {
            for (int p = 0; p < 4; p++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t byte = t[(p * GROUP + lane) * 4 + j];
                    o[4 * p + j] = (float)(byte & 0xf) * d + m;
                    o[16 + 4 * p + j] = (float)(byte >> 4) * d + m;
                }
        } else if (fmt == FMT_Q8H) { /* d: inputs 0-15's scale, m: 16-31's; no min */
            for (int p = 0; p < 8; p++)
                for (int j = 0; j < 4; j++)
                    o[4 * p + j] = (float)(int8_t)t[(p * GROUP + lane) * 4 + j] * (p < 4 ? d : m);
        } else {
            for (int p = 0; p < 8; p++)
                for (int j = 0; j < 4; j++) o[4 * p + j] = (float)(int8_t)t[(p * GROUP + lane) * 4 + j] * d + m;
        }
    }
}

static void store_row(const float *src, void *dst, int64_t n, int64_t out_bf16) {
    if (out_bf16) {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* out[j, :] = row ids[j] of w, as bfloat16 (out_bf16) or float32. */
int pdkv_qdequant_rows(const void *packed, int64_t fmt, int64_t n, int64_t k, const int64_t *ids,
                       int64_t count, void *out, int64_t out_bf16) {
    if (pdkv_qpacked_bytes(fmt, n, k) < 0) return 2;
    for (int64_t j = 0; j < count; j++)
        if (ids[j] < 0 || ids[j] >= n) return 2;
    if (fmt == FMT_BF16) {
        if (!out_bf16) return 2;
        return pdkv_bf16_rows(packed, n, k, ids, count, out);
    }
    int failed = 0;
#pragma omp parallel if (count * k >= 65536)
    {
        float *row = (float *)malloc((size_t)k * sizeof(float));
        if (row == NULL) {
#pragma omp atomic write
            failed = 3;
        } else {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < count; j++) {
                dequant_row((const uint8_t *)packed, fmt, k, ids[j], row);
                store_row(row, (char *)out + j * k * (out_bf16 ? 2 : 4), k, out_bf16);
            }
        }
        free(row);
    }
    return failed;
}

/* The machine's read bandwidth probe: the XOR of the buffer's 64-bit words (the caller times it), every
 * thread reading its contiguous share with the widest loads this build has, into four independent
 * accumulators.  A scalar loop here read 15-18 GB/s on an Intel Xeon whose two cores read 36-38 GB/s
 * with vectors -- a probe that understates the machine flatters every fraction taken against it. */
int64_t pdkv_read_bandwidth(const void *buf, int64_t bytes) {
    const int64_t words = bytes / 8;
    const uint64_t *p = (const uint64_t *)buf;
    uint64_t total = 0;
#pragma omp parallel reduction(^ : total)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t chunks = words / 32; /* 256 bytes */
        const int64_t c0 = chunks * tid / nt, c1 = chunks * (tid + 1) / nt;
        uint64_t x = 0;
#if defined(__AVX512F__)
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = c0; c < c1; c++) {
            const uint64_t *q = p + c * 32;
            a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)q));
            a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(q + 8)));
            a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(q + 16)));
            a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(q + 24)));
        }
        uint64_t lanes[8];
        _mm512_storeu_si512((void *)lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
        for (int i = 0; i < 8; i++) x ^= lanes[i];
#elif defined(__AVX2__)
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = c0; c < c1; c++)
            for (int h = 0; h < 32; h += 16) {
                const __m256i *q = (const __m256i *)(p + c * 32 + h);
                a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(q));
                a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(q + 1));
                a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(q + 2));
                a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(q + 3));
            }
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
        for (int i = 0; i < 4; i++) x ^= lanes[i];
#else
        for (int64_t i = c0 * 32; i < c1 * 32; i++) x ^= p[i];
#endif
        if (tid == nt - 1)
            for (int64_t i = chunks * 32; i < words; i++) x ^= p[i]; /* the tail: the last thread's */
        total ^= x;
    }
    return (int64_t)total;
}

/* Writes back and drops every cache line of buf[0 .. bytes) from every level of the caches, so that the
 * next read of it comes from memory: what a benchmark needs on a host whose last-level cache holds the
 * whole model (an Intel Xeon's 300 MB of L3 keeps SmolLM2's 98 MB there).  clflushopt where the CPU has
 * it (after clflush's eviction the Xeon's next batch-1 step took 5.2 ms where it took 4.3-4.7 after
 * clflushopt's, the same lines dropped: clflush's ordering is the likely cost), else clflush.  Returns 0;
 * 1 on a CPU without either. */
int pdkv_evict(const void *buf, int64_t bytes) {
#if defined(__SSE2__)
    const uintptr_t first = (uintptr_t)buf & ~(uintptr_t)63, end = (uintptr_t)buf + (uintptr_t)bytes;
    const int64_t lines = bytes > 0 ? (int64_t)((end - first + 63) / 64) : 0;
#pragma omp parallel for schedule(static) if (lines >= 65536)
    for (int64_t i = 0; i < lines; i++) {
#if defined(__CLFLUSHOPT__)
        _mm_clflushopt((void *)(first + (uintptr_t)i * 64));
#else
        _mm_clflush((const void *)(first + (uintptr_t)i * 64));
#endif
    }
    _mm_mfence();
    return 0;
#else
    (void)buf;
    (void)bytes;
    return 1;
#endif
}

#if PDKV_QUANT_BUILT == 1
/* Row x (k values, bfloat16 or float32) quantized per block of 32 (the header's activations): q holds
 * the hi bytes [k] then the lo bytes [k], is[k/32] the blocks' sums of qa, ih[k/32] those of their first
 * 16 (Q8H's halves), da[k/32] their steps and sa[k/32] = da * is. */
static void quantize_row(const void *x, int64_t in_bf16, int64_t k, uint8_t *q, int32_t *is, int32_t *ih,
                         float *da, float *sa) {
    const __m512i top = _mm512_set1_epi32(QA_MAX), bottom = _mm512_set1_epi32(-QA_MAX);
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        __m512 v[2];
        if (in_bf16) {
            const uint16_t *p = (const uint16_t *)x + b * QBLOCK;
            v[0] = from_bf16x16(_mm256_loadu_si256((const __m256i *)p));
            v[1] = from_bf16x16(_mm256_loadu_si256((const __m256i *)(p + 16)));
        } else {
            const float *p = (const float *)x + b * QBLOCK;
            v[0] = _mm512_loadu_ps(p);
            v[1] = _mm512_loadu_ps(p + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float d = amax / (float)QA_MAX;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        /* round to nearest even (the conversion's default mode), then held to +-QA_MAX */
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], _mm512_set1_ps(id)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], _mm512_set1_ps(id)));
        q0 = _mm512_min_epi32(_mm512_max_epi32(q0, bottom), top);
        q1 = _mm512_min_epi32(_mm512_max_epi32(q1, bottom), top);
        /* the block's 32 qa as int16, then its bytes: lo the low byte read signed, hi = (qa - lo) / 256 */
        const __m512i qa =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q0)), _mm512_cvtepi32_epi16(q1), 1);
        const __m512i lo = _mm512_srai_epi16(_mm512_slli_epi16(qa, 8), 8);
        const __m512i hi = _mm512_srai_epi16(_mm512_sub_epi16(qa, lo), 8); /* exact: a multiple of 256 */
        _mm256_storeu_si256((__m256i *)(q + b * QBLOCK), _mm512_cvtepi16_epi8(hi));
        _mm256_storeu_si256((__m256i *)(q + k + b * QBLOCK), _mm512_cvtepi16_epi8(lo));
        const __m512i sum = _mm512_add_epi32(q0, q1);
        const int32_t total = _mm512_reduce_add_epi32(sum);
        is[b] = total;
        ih[b] = _mm512_reduce_add_epi32(q0);
        da[b] = d;
        sa[b] = d * (float)total;
    }
}

/* acc + w . (*a broadcast to every lane), w's bytes unsigned and a's signed: vpdpbusd with the
 * activations' four bytes as its embedded-broadcast memory operand, {1to16} -- gcc emits a vpbroadcastd
 * per dword instead, a vector uop of its own beside each product (an AMD EPYC Zen 5, the int16 form of
 * these kernels: the Q4_1 model's 120 layer linears at batch 1 from the caches 1.362 -> 1.272 ms on one
 * thread; docs/BENCHMARKS.md).  AT&T syntax (gcc's default; -masm=intel would not take it). */
INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*a));
    return acc;
}

/* Quad p (p < 8) of a tile as unsigned bytes: lane r's four are row r's quants of inputs 4p .. 4p + 3 --
 * Q4 the low nibbles of the tile's 64-byte run p (p < 4) or the high ones of run p - 4, Q8 run p with
 * its sign bits flipped (q + 128: block_sum takes the 128 sum(qa) back out). */
INLINE __m512i tile_quad(const uint8_t *t, int64_t fmt, int p) {
    if (q4_quants(fmt)) {
        const __m512i v = _mm512_loadu_si512((const void *)(t + 64 * (p & 3))), low = _mm512_set1_epi8(0x0f);
        return _mm512_and_si512(p < 4 ? v : _mm512_srli_epi16(v, 4), low);
    }
    return _mm512_xor_si512(_mm512_loadu_si512((const void *)(t + 64 * p)), _mm512_set1_epi8((char)0x80));
}

/* A block's integer sums per lane, sum q qa, from its hi and lo byte sums:  256 H + L, less 128 sum(qa)
 * for Q8 (tile_quad's offset). */
INLINE __m512i block_sum(__m512i h, __m512i l, int64_t fmt, int32_t qsum) {
    const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
    return q4_quants(fmt) ? s : _mm512_sub_epi32(s, _mm512_set1_epi32(128 * qsum));
}

/* A tile's 16 scales d as floats (scales: its bytes after the quants; float16, or float32 for Q4F, Q8F
 * and Q8H). */
INLINE __m512 tile_scales(const uint8_t *scales, int64_t fmt) {
    return float_scales(fmt) ? _mm512_loadu_ps(scales)
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
}

/* The mins, or Q8H's second scales (inputs 16-31). */
INLINE __m512 tile_mins(const uint8_t *scales, int64_t fmt) {
    return float_scales(fmt) ? _mm512_loadu_ps(scales + 64)
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
}

/* A Q8H block's two halves, sums s0 (inputs 0-15) and s1 (16-31) with scales d0 and d1: each half's
 * scale term, in this order (quant_avx2.h's the same). */
INLINE __m512 add_halves(__m512 acc, __m512i s0, __m512i s1, __m512 d0, __m512 d1, float dj) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, _mm512_set1_ps(dj)), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, _mm512_set1_ps(dj)), acc);
}

/* The block's scale term then its min term, per lane: every kernel's float operations, in this order. */
INLINE __m512 add_block(__m512 acc, __m512i s, __m512 d, __m512 m, float dj, float sj) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dj)), acc);
    return _mm512_fmadd_ps(m, _mm512_set1_ps(sj), acc);
}

INLINE void store_tile(const __m512 *acc, int nrows, void *out, int64_t ldo, int64_t col, int64_t ncols,
                       int64_t out_bf16);

/* Rows 0 .. nrows - 1 (nrows <= MT) of a's rows over one group: acc[j] over every block, stored to out.
 * HALVES (a constant): Q8H, whose halves of a block are summed and scaled apart. */
INLINE void group_tile_as(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, int64_t k, int nrows,
                          void *out, int64_t ldo, int64_t col, int64_t ncols, int64_t out_bf16, const int HALVES,
                          const int64_t SCALES) {
    __m512 acc[MT];
    for (int j = 0; j < MT; j++) acc[j] = _mm512_setzero_ps();
    const int64_t tb = tile_bytes(fmt), qb = quant_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *t = wg + b * tb;
        prefetch_tile(t, tb, PREFETCH, 0, 0); /* into L1 (non-temporal: batch 8 0.7-2.4 % slower on a Zen 5) */
        __m512i w[8];
        for (int p = 0; p < 8; p++) w[p] = tile_quad(t, fmt, p);
        const __m512 d = tile_scales(t + qb, SCALES), m = tile_mins(t + qb, SCALES);
        for (int j = 0; j < nrows; j++) {
            const int32_t *hi = (const int32_t *)(a.q + 2 * j * k + b * QBLOCK), *lo = hi + k / 4;
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
            if (HALVES) { /* quads 0-3 (inputs 0-15) and 4-7 apart: their scales differ */
                for (int p = 0; p < 4; p++) {
                    h0 = dpbusd_bcast(h0, w[p], hi + p);
                    l0 = dpbusd_bcast(l0, w[p], lo + p);
                    h1 = dpbusd_bcast(h1, w[p + 4], hi + p + 4);
                    l1 = dpbusd_bcast(l1, w[p + 4], lo + p + 4);
                }
            } else {
                for (int p = 0; p < 8; p += 2) {
                    h0 = dpbusd_bcast(h0, w[p], hi + p);
                    l0 = dpbusd_bcast(l0, w[p], lo + p);
                    h1 = dpbusd_bcast(h1, w[p + 1], hi + p + 1);
                    l1 = dpbusd_bcast(l1, w[p + 1], lo + p + 1);
                }
            }
            /* the halves' and the whole block's arithmetic side by side, not one helper: the helper (the
             * same operations) made gcc allocate this loop's registers otherwise, 3 % slower at 8 rows */
            const int64_t s = j * blocks + b;
            if (HALVES)
                acc[j] = add_halves(acc[j], block_sum(h0, l0, fmt, a.ih[s]), block_sum(h1, l1, fmt, a.is[s] - a.ih[s]),
                                    d, m, a.da[s]);
            else
                acc[j] = add_block(acc[j],
                                   block_sum(_mm512_add_epi32(h0, h1), _mm512_add_epi32(l0, l1), fmt, a.is[s]),
                                   d, m, a.da[s], a.sa[s]);
        }
    }
    store_tile(acc, nrows, out, ldo, col, ncols, out_bf16);
}

/* group_tile_as, Q8H's copy apart: a copy per format was 3-4 % slower at 8 rows (an AMD EPYC Zen 5, the
 * Q4_1 model's 120 layer linears), a runtime test for the halves 25 % at 32. */
INLINE void group_tile(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, int64_t k, int nrows, void *out,
                       int64_t ldo, int64_t col, int64_t ncols, int64_t out_bf16) {
    if (fmt == FMT_Q8H)
        group_tile_as(wg, FMT_Q8H, blocks, a, k, nrows, out, ldo, col, ncols, out_bf16, 1, FMT_Q8H);
    else if (fmt == FMT_Q4F)
        group_tile_as(wg, FMT_Q4F, blocks, a, k, nrows, out, ldo, col, ncols, out_bf16, 0, FMT_Q4F);
    else if (fmt == FMT_Q8F)
        group_tile_as(wg, FMT_Q8F, blocks, a, k, nrows, out, ldo, col, ncols, out_bf16, 0, FMT_Q8F);
    else /* Q4, Q8: float16 scales */
        group_tile_as(wg, fmt, blocks, a, k, nrows, out, ldo, col, ncols, out_bf16, 0, FMT_Q4);
}

/* One tile's hi and lo byte sums for one activation row (hi, lo: its block's dwords), in four chains --
 * quads p and p + 4 side by side (Q4's one 64-byte run, its two nibbles). */
INLINE void row1_sums(const uint8_t *t, int64_t fmt, const int32_t *hi, const int32_t *lo, __m512i h[2],
                      __m512i l[2]) {
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int p = 0; p < 4; p++) {
        const __m512i w0 = tile_quad(t, fmt, p), w1 = tile_quad(t, fmt, p + 4);
        h0 = dpbusd_bcast(h0, w0, hi + p);
        l0 = dpbusd_bcast(l0, w0, lo + p);
        h1 = dpbusd_bcast(h1, w1, hi + 4 + p);
        l1 = dpbusd_bcast(l1, w1, lo + 4 + p);
    }
    h[0] = h0, h[1] = h1, l[0] = l0, l[1] = l1; /* inputs 0-15, 16-31 */
}

/* One activation row of NG (1 to 4) consecutive groups: group_tile's arithmetic for nrows = 1 -- the
 * same integer sums (in four chains: integer addition is exact, so the split changes no bit) and the
 * same float operations in the same block order, per group -- streamed without holding the tile's
 * vectors, so that the chains, not one long dependency, set the pace of a batch-1 step; groups side by
 * side give the core more streams and accumulators to overlap (an Intel Xeon, a batch-1 step of the Q4_1
 * model's linears: 5.2-5.4 ms one group at a time, 4.8 two, 4.1-4.3 four), or -- an AMD EPYC -- get in
 * its prefetchers' way: how many is row_groups (pdkv_quant_row_groups). */
INLINE void group_row1_as(const uint8_t *wg, const int64_t fmt, int64_t blocks, Acts a, int64_t k, void *out,
                          int64_t col, int64_t n_out, int64_t out_bf16, const int NG) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t tb = tile_bytes(fmt), qb = quant_bytes(fmt), near = row_prefetch[0], far = row_prefetch[1];
    const int nta = row_prefetch[2] != 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int32_t *hi = (const int32_t *)(a.q + b * QBLOCK), *lo = hi + k / 4;
        for (int gi = 0; gi < NG; gi++) {
            const uint8_t *t = wg + (gi * blocks + b) * tb;
            prefetch_tile(t, tb, near, far, nta);
            __m512i h[2], l[2];
            row1_sums(t, fmt, hi, lo, h, l);
            const __m512 d = tile_scales(t + qb, fmt), m = tile_mins(t + qb, fmt);
            if (fmt == FMT_Q8H)
                acc[gi] = add_halves(acc[gi], block_sum(h[0], l[0], fmt, a.ih[b]),
                                     block_sum(h[1], l[1], fmt, a.is[b] - a.ih[b]), d, m, a.da[b]);
            else
                acc[gi] = add_block(acc[gi],
                                    block_sum(_mm512_add_epi32(h[0], h[1]), _mm512_add_epi32(l[0], l[1]), fmt, a.is[b]),
                                    d, m, a.da[b], a.sa[b]);
        }
    }
    for (int gi = 0; gi < NG; gi++) {
        const int64_t c = col + gi * GROUP;
        store_tile(acc + gi, 1, out, 0, c, n_out - c < GROUP ? n_out - c : GROUP, out_bf16);
    }
}

/* group_row1_as with the format a constant in each copy: tile_quad's and the scales' branches out of the
 * loop. */
INLINE void group_row1(const uint8_t *wg, int64_t fmt, int64_t blocks, Acts a, int64_t k, void *out, int64_t col,
                       int64_t n_out, int64_t out_bf16, const int NG) {
    if (fmt == FMT_Q4) group_row1_as(wg, FMT_Q4, blocks, a, k, out, col, n_out, out_bf16, NG);
    else if (fmt == FMT_Q4F) group_row1_as(wg, FMT_Q4F, blocks, a, k, out, col, n_out, out_bf16, NG);
    else if (fmt == FMT_Q8H) group_row1_as(wg, FMT_Q8H, blocks, a, k, out, col, n_out, out_bf16, NG);
    else if (fmt == FMT_Q8F) group_row1_as(wg, FMT_Q8F, blocks, a, k, out, col, n_out, out_bf16, NG);
    else group_row1_as(wg, FMT_Q8, blocks, a, k, out, col, n_out, out_bf16, NG);
}

/* acc[j] (16 columns from col, ncols of them real) into rows 0 .. nrows - 1 of out. */
INLINE void store_tile(const __m512 *acc, int nrows, void *out, int64_t ldo, int64_t col, int64_t ncols,
                       int64_t out_bf16) {
    const __mmask16 mask = ncols >= GROUP ? (__mmask16)0xffff : (__mmask16)((1u << ncols) - 1u);
    for (int j = 0; j < nrows; j++) {
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + j * ldo + col;
            _mm256_mask_storeu_epi16(o, mask, bf16_rne16(acc[j]));
        } else {
            float *o = (float *)out + j * ldo + col;
            _mm512_mask_storeu_ps(o, mask, acc[j]);
        }
    }
}
#include "quant_amx.h"
#elif PDKV_QUANT_BUILT == 2
#include "quant_avx2.h"
#endif

#ifndef PDKV_QUANT_AMX
int pdkv_quant_amx(int64_t want) { /* this build has no AMX-INT8 path (quant_amx.h) */
    (void)want;
    return 0;
}
#endif

/* Groups a batch-1 call streams side by side (group_row1's NG): their weights are consecutive runs of the
 * packed matrix, read at once.  Which is faster is the CPU's: an Intel Xeon (a batch-1 step of the Q4_1
 * model's linears) 5.2-5.4 ms one group at a time, 4.1-4.3 four side by side; an AMD EPYC Zen 5 the
 * other way round (the whole batch-1 step, weights from memory: 2.75-3.0 ms one at a time, 3.6-4.1 four
 * -- its prefetchers follow one stream per core far better than four short ones).  The same bits either
 * way (each group's arithmetic is its own); engine/native.py sets it once by the CPU's vendor. */
static int64_t row_groups = 4;

/* want 1..4: groups side by side from now on; else no change.  Returns the number in use. */
int64_t pdkv_quant_row_groups(int64_t want) {
    if (want >= 1 && want <= 4) row_groups = want;
    return row_groups;
}

/* out[m, col0 + n] (row stride ldo elements) = sum_k x[m, k] w[n, k] for m < rows, n < n_out; x [rows, k]
 * contiguous.  in_bf16 / out_bf16: bfloat16 (else float32) input / output. */
int pdkv_qlinear(const void *x, int64_t in_bf16, int64_t rows, int64_t k, const void *packed, int64_t fmt,
                 int64_t n_out, void *out, int64_t ldo, int64_t out_bf16) {
#if !PDKV_QUANT_BUILT
    (void)x; (void)in_bf16; (void)rows; (void)k; (void)packed; (void)fmt; (void)n_out; (void)out; (void)ldo;
    (void)out_bf16;
    return 1;
#else
    if (pdkv_qpacked_bytes(fmt, n_out, k) < 0 || rows < 0 || ldo < n_out) return 2;
    if (rows == 0) return 0;
    if (fmt == FMT_BF16) {
        if (!in_bf16 || !out_bf16) return 2;
        return pdkv_bf16_linear(x, rows, k, packed, n_out, out, ldo, 0);
    }
    const int64_t blocks = k / QBLOCK, groups = (n_out + GROUP - 1) / GROUP, tb = tile_bytes(fmt);
#ifdef PDKV_QUANT_AMX
    /* quant_amx.h: the same bits in AMX tiles -- for every format whose block has one scale (Q8H's halves
     * take the vectors) */
    const int tiles = qamx_on && rows >= QAMX_MIN_ROWS && fmt != FMT_Q8H;
#else
    const int tiles = 0;
#endif
    /* per row: its quantized activations (2 k bytes, the build's layout: quantize_row), then per block
     * the sums of qa and of its first half's (int32), the steps da and sa (floats) */
    const size_t q_bytes = (size_t)(rows * 2 * k), s_bytes = (size_t)(rows * blocks) * sizeof(float);
    /* A few rows (a small batch's decode step): every thread quantizes them all into its own buffer, kept
     * across calls -- no allocation, and no barrier between quantizing and the groups.  More rows: one
     * shared buffer, each thread quantizing its share of the rows first. */
    const int private_rows = rows <= PRIVATE_ROWS;
    const size_t buf_bytes = q_bytes + 4 * s_bytes;
    char *shared = private_rows ? NULL : (char *)malloc(buf_bytes);
    if (!private_rows && shared == NULL) return 3;
    const int64_t esize = in_bf16 ? 2 : 4, osize = out_bf16 ? 2 : 4;
    const int parallel = rows * n_out * k >= PARALLEL_MIN_WORK;
    /* read once: another thread may change it meanwhile (a benchmark's switch) */
    const int64_t rg = __atomic_load_n(&row_groups, __ATOMIC_RELAXED);
    const char *const *sbase;
    int64_t sn, sbytes;
    pdkv_side_stream_of(&sbase, &sn, &sbytes); /* the caller's side stream (decode_layer.c), if any */
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        char *buf = shared;
        if (private_rows) {
            buf = grow_scratch(&private_acts, &private_bytes, buf_bytes);
            if (buf == NULL) {
#pragma omp atomic write
                failed = 3;
            }
        }
        /* the rows' activations: row r's q at 2 r k bytes, its sums, da and sa at r blocks (Acts) */
        uint8_t *q = (uint8_t *)buf;
        int32_t *is = buf ? (int32_t *)(buf + q_bytes) : NULL, *ih = buf ? is + rows * blocks : NULL;
        float *da = buf ? (float *)(buf + q_bytes + 2 * s_bytes) : NULL, *sa = buf ? da + rows * blocks : NULL;
        const Acts a = {q, is, ih, da, sa};
#define QUANTIZE(r)                                                                                    \
    quantize_row((const char *)x + (r) * k * esize, in_bf16, k, q + (r) * 2 * k, is + (r) * blocks, \
                 ih + (r) * blocks, da + (r) * blocks, sa + (r) * blocks)
        if (private_rows) {
            for (int64_t r = 0; buf != NULL && r < rows; r++) QUANTIZE(r);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) QUANTIZE(r);
        }
#undef QUANTIZE
#ifdef PDKV_QUANT_AMX
        if (tiles && buf != NULL) { /* this thread's even share of the groups for every row */
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
            if (qamx_rows((const uint8_t *)packed, fmt, k, n_out, g0, g1, a, rows, out, ldo, out_bf16)) {
#pragma omp atomic write
                failed = 3;
            }
        }
#endif
        if (rows == 1 && buf != NULL && !tiles) {
            /* one row: this thread's even share of the groups, row_groups at a time (group_row1) */
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
            /* this thread's share of the side stream, a few lines after each run of groups */
            const int64_t s0 = sn * tid / nt, s1 = sn * (tid + 1) / nt, runs = (g1 - g0 + rg - 1) / rg;
            LineStream side = line_stream(sbase ? sbase + s0 : NULL, s1 - s0, sbytes);
            const int64_t per_run = runs > 0 ? ((s1 - s0) * ((sbytes + 63) / 64) + runs - 1) / runs : 0;
            for (int64_t g = g0; g < g1; g += rg) {
                for (int64_t i = 0; i < per_run; i++) {
                    const char *line = line_stream_next(&side);
                    if (line == NULL) break;
                    _mm_prefetch(line, _MM_HINT_T2);
                }
                const uint8_t *wg = (const uint8_t *)packed + g * blocks * tb;
                const int64_t ng = g1 - g < rg ? g1 - g : rg;
                if (ng == 4)
                    group_row1(wg, fmt, blocks, a, k, out, g * GROUP, n_out, out_bf16, 4);
                else if (ng == 3)
                    group_row1(wg, fmt, blocks, a, k, out, g * GROUP, n_out, out_bf16, 3);
                else if (ng == 2)
                    group_row1(wg, fmt, blocks, a, k, out, g * GROUP, n_out, out_bf16, 2);
                else
                    group_row1(wg, fmt, blocks, a, k, out, g * GROUP, n_out, out_bf16, 1);
            }
        }
        for (int64_t m0 = 0; rows > 1 && !tiles && m0 < rows; m0 += MCHUNK) {
            const int64_t m1 = m0 + MCHUNK < rows ? m0 + MCHUNK : rows;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                if (buf == NULL) continue; /* this thread's buffer failed: the call returns 3 */
                const uint8_t *wg = (const uint8_t *)packed + g * blocks * tb;
                const int64_t col = g * GROUP;
                const int64_t ncols = n_out - col < GROUP ? n_out - col : GROUP;
                for (int64_t j = m0; j < m1; j += MT) {
                    const int n = (int)(m1 - j < MT ? m1 - j : MT);
                    char *o = (char *)out + j * ldo * osize;
                    const Acts aj = acts_from(a, j, k);
                    if (n == MT)
                        group_tile(wg, fmt, blocks, aj, k, MT, o, ldo, col, ncols, out_bf16);
                    else if (n == 1) /* the last row of a chunk: its own output row */
                        group_row1(wg, fmt, blocks, aj, k, o, col, n_out, out_bf16, 1);
                    else
                        group_tile(wg, fmt, blocks, aj, k, n, o, ldo, col, ncols, out_bf16);
                }
            }
        }
    }
    free(shared);
    return failed;
#endif
}
