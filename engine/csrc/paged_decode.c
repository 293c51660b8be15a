/* Decode attention read straight from the paged KV cache: one query token per sequence.
 *
 * The torch path (engine/attention.py) gathers each sequence's blocks into a contiguous buffer and then
 * runs SDPA over it: every key and value is read, written and read again.  Here each (sequence, KV head)
 * task walks its block table and reads each key and value once, for all the query heads that share that
 * KV head (grouped-query attention), in two passes:
 *
 *     pass 1   s[g][i] = scale * <q[g], k[j]>          for the visible keys j = first + i, g in the group
 *     softmax  p[g][i] = exp(s[g][i] - max_g)           (float32; 1 / sum_g applied at the end)
 *     pass 2   out[g]  = sum_i p[g][i] * v[j] / sum_g   (float32 accumulators, rounded once at the end)
 *
 * Cache layout (contiguous): [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; the
 * element (b, layer, kv, off, h, d) sits at ((((b * L + layer) * 2 + kv) * bs + off) * Hkv + h) * D + d.
 * Key j of a sequence lives in block table[j / bs] at offset j % bs.  Keys visible to the query at
 * position p: max(0, p - window + 1) <= j <= p (window 0: no window).  Padding entries of the table are
 * never read.
 *
 * With AVX-512 (built with -march=native) rows are converted and multiplied 16 floats at a time and the
 * exponentials are a vector polynomial (Cephes' expf, within 2 ulp); elsewhere plain loops the compiler
 * vectorizes as it can.  NaN in a score propagates to the output, as in SDPA.
 *
 * Parallel over (sequence, KV head) with OpenMP; libgomp is linked by soname and torch has loaded its
 * own already, so these threads are torch's pool.  No torch headers: the Python side (engine/native.py)
 * passes raw pointers, which keeps the build to one gcc call of about a second.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_GROUP 16 /* query heads per KV head; engine/native.py checks both limits */
#define MAX_HEAD_DIM 256


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
#ifdef __AVX512F__
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

/* s[i] = exp(s[i] - max(s)); returns the sum. */
static float softmax_numerators(float *s, int64_t n) {
    float m = s[0];
    for (int64_t i = 1; i < n; i++) m = (s[i] > m || s[i] != s[i]) ? s[i] : m;
    int64_t i = 0;
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
    int64_t num_seqs;
} Args;

/* A run of consecutive key rows (kv 0) and the matching value rows (kv 1), `stride` bytes apart. */
typedef struct {
    const char *start[2];
    int64_t len;
} Run;

/* The G query heads at `q` (G * D contiguous elements) against the n keys and values of `runs`; writes
 * G * D elements at `out`.  `scores` has room for G * n floats. */
static void attend(const Args *a, const Run *runs, int64_t num_runs, size_t stride, int64_t n, const char *q,
                   char *out, float *restrict scores) {
    const int D = a->head_dim, G = a->group;
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
    for (int g = 0; g < G; g++) {
        load_row(q + (size_t)(g * D) * (a->bf16 ? 2 : 4), a->bf16, qf[g], D);
        for (int d = 0; d < D; d++) {
            qf[g][d] *= a->scale;
            acc[g][d] = 0.0f;
        }
    }
    for (int kv = 0; kv < 2; kv++) {
        int64_t i = 0;
        for (int64_t r = 0; r < num_runs; r++) {
            const char *src = runs[r].start[kv];
            for (int64_t end = i + runs[r].len; i < end; i++, src += stride) {
                load_row(src, a->bf16, row, D);
                if (kv == 0)
                    for (int g = 0; g < G; g++) scores[g * n + i] = dot(qf[g], row, D);
                else
                    for (int g = 0; g < G; g++) axpy(acc[g], scores[g * n + i], row, D);
            }
        }
        if (kv == 0)
            for (int g = 0; g < G; g++) {
                const float inv = 1.0f / softmax_numerators(scores + g * n, n);
                for (int64_t j = 0; j < n; j++) scores[g * n + j] *= inv; /* pass 2 needs no division */
            }
    }
    for (int g = 0; g < G; g++) {
        if (a->bf16) {
            uint16_t *o = (uint16_t *)out + g * D;
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[g][d]);
        } else {
            memcpy((float *)out + g * D, acc[g], sizeof(float) * (size_t)D);
        }
    }
}

/* Per-thread scratch, kept across calls (the pool's threads live as long as the process): a fresh
 * multi-MB buffer per call would be page-faulted in every time.  Grows to the longest context seen. */
static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;

static void *scratch_get(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *grown = realloc(scratch, bytes);
        if (grown == NULL) return NULL;
        scratch = grown;
        scratch_bytes = bytes;
    }
    return scratch;
}

/* The visible keys of sequence b: [first, pos]. */
static inline int64_t first_key(const Args *a, int64_t pos) {
    return (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
}

/* The cache rows of sequence b's keys [first, pos] (all KV heads), as runs of up to a block each. */
static int64_t block_runs(const Args *a, int64_t b, int64_t first, int64_t pos, size_t head_offset,
                          Run *runs) {
    const int64_t bs = a->block_size, *table = a->block_table + b * a->table_width;
    const size_t token = (size_t)(a->num_kv_heads * a->head_dim) * (a->bf16 ? 2 : 4);
    int64_t count = 0;
    for (int64_t j = first; j <= pos; count++) {
        const int64_t off = j % bs, len = (bs - off < pos + 1 - j) ? bs - off : pos + 1 - j;
        for (int kv = 0; kv < 2; kv++)
            runs[count].start[kv] = (const char *)a->cache
                                    + (size_t)(((table[j / bs] * a->num_layers + a->layer) * 2 + kv) * bs + off)
                                          * token
                                    + head_offset;
        runs[count].len = len;
        j += len;
    }
    return count;
}

/* Start loading sequence b's rows into L2 (the next sequence of this thread, while it computes on the
 * current one's copy): memory and arithmetic overlap instead of taking turns. */
static void prefetch_sequence(const Args *a, int64_t b, Run *runs) {
#ifdef __AVX512F__
    const size_t token = (size_t)(a->num_kv_heads * a->head_dim) * (a->bf16 ? 2 : 4);
    const int64_t pos = a->positions[b];
    const int64_t num_runs = block_runs(a, b, first_key(a, pos), pos, 0, runs);
    for (int64_t r = 0; r < num_runs; r++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t o = 0; o < (size_t)runs[r].len * token; o += 64) _mm_prefetch(runs[r].start[kv] + o, _MM_HINT_T1);
#else
    (void)a, (void)b, (void)runs;
#endif
}

/* One whole sequence: its blocks' rows copied side by side into scratch first (long contiguous copies,
 * which the memory system streams; the strided reads of one KV head at a time in place would wait on
 * each block), then each KV head attends over the copy. */
static int attend_sequence(const Args *a, int64_t b, Run *runs) {
    const size_t elem = a->bf16 ? 2 : 4, token = (size_t)(a->num_kv_heads * a->head_dim) * elem;
    const int64_t pos = a->positions[b], first = first_key(a, pos), n = pos + 1 - first;
    char *mem = scratch_get(2 * (size_t)n * token + sizeof(float) * (size_t)(a->group * n));
    if (mem == NULL) return 1;
    char *keys = mem, *values = mem + (size_t)n * token;
    float *scores = (float *)(mem + 2 * (size_t)n * token);
    const int64_t num_runs = block_runs(a, b, first, pos, 0, runs);
    size_t at = 0;
    for (int64_t r = 0; r < num_runs; r++) {
        memcpy(keys + at, runs[r].start[0], (size_t)runs[r].len * token);
        memcpy(values + at, runs[r].start[1], (size_t)runs[r].len * token);
        at += (size_t)runs[r].len * token;
    }
    if (b + 1 < a->num_seqs) prefetch_sequence(a, b + 1, runs);
    for (int64_t kvh = 0; kvh < a->num_kv_heads; kvh++) {
        const size_t head = (size_t)(kvh * a->head_dim) * elem;
        const Run all = {{keys + head, values + head}, n};
        const size_t q0 = (size_t)((b * a->num_heads + kvh * a->group) * a->head_dim) * elem;
        attend(a, &all, 1, token, n, (const char *)a->q + q0, (char *)a->out + q0, scores);
    }
    return 0;
}

/* One KV head of one sequence, read in place (a small batch: every thread gets a share). */
static int attend_head(const Args *a, int64_t b, int64_t kvh, Run *runs) {
    const size_t elem = a->bf16 ? 2 : 4, token = (size_t)(a->num_kv_heads * a->head_dim) * elem;
    const int64_t pos = a->positions[b], first = first_key(a, pos), n = pos + 1 - first;
    float *scores = scratch_get(sizeof(float) * (size_t)(a->group * n));
    if (scores == NULL) return 1;
    const int64_t num_runs = block_runs(a, b, first, pos, (size_t)(kvh * a->head_dim) * elem, runs);
    const size_t q0 = (size_t)((b * a->num_heads + kvh * a->group) * a->head_dim) * elem;
    attend(a, runs, num_runs, token, n, (const char *)a->q + q0, (char *)a->out + q0, scores);
    return 0;
}

/* Returns 0, or 1 when scratch memory could not be allocated, 2 for a shape the kernel cannot take. */
int pdkv_paged_decode(const void *q, const void *cache, void *out, const int64_t *block_table,
                      const int64_t *positions, int64_t num_seqs, int64_t table_width, int64_t num_layers,
                      int64_t layer, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t window, float scale, int64_t max_keys, int64_t bf16) {
    (void)max_keys;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 || table_width <= 0)
        return 2;
    Args a = {q, cache, out, block_table, positions, table_width, num_layers, layer, block_size,
              num_heads, num_kv_heads, (int)head_dim, (int)(num_heads / num_kv_heads), (int)(bf16 != 0),
              window, scale, num_seqs};
    int failed = 0;
#pragma omp parallel
    {
        /* a run per block of a table row, at most; + 1 for a context that starts inside a block */
        Run *runs = malloc(sizeof(Run) * (size_t)(table_width + 1));
        const int whole = num_seqs >= 2 * omp_get_num_threads();
        int bad = runs == NULL;
        if (whole) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_seqs; b++)
                if (!bad) bad = attend_sequence(&a, b, runs);
        } else {
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < num_seqs; b++)
                for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
                    if (!bad) bad = attend_head(&a, b, kvh, runs);
        }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
        free(runs);
    }
    return failed;
}

/* RMSNorm of `rows` rows of `hidden` elements, as transformers computes it (float32 inside):
 *     out = weight * dtype(x * rsqrt(mean(x^2) + eps))
 * The sum of squares is accumulated 16 lanes at a time, so the mean may differ from torch's in its last
 * bit; everything after it rounds exactly as torch does. */
int pdkv_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t hidden, float eps,
                  int64_t bf16) {
    const int n = (int)hidden;
    if (n <= 0 || n > 65536) return 2;
    int failed = 0;
#pragma omp parallel if (rows * hidden >= 65536)
    {
        float *row = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)n);
        if (row == NULL || w == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            load_row(weight, (int)bf16, w, n);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (row == NULL || w == NULL) continue;
            const size_t at = (size_t)r * (size_t)n;
            load_row((const char *)x + at * (bf16 ? 2 : 4), (int)bf16, row, n);
            const float inv = 1.0f / sqrtf(dot(row, row, n) / (float)n + eps);
            if (bf16) {
                uint16_t *o = (uint16_t *)out + at;
                for (int i = 0; i < n; i++) o[i] = f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(row[i] * inv)));
            } else {
                float *o = (float *)out + at;
                for (int i = 0; i < n; i++) o[i] = w[i] * (row[i] * inv);
            }
        }
        free(row);
        free(w);
    }
    return failed;
}
