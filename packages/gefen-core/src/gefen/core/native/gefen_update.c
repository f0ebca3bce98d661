/* The fused Gefen update for CPUs (docs/core.md §6.1, §6.2, §11), one pass per block.
 *
 * For each block of P elements: decode the stored momentum into an L1-resident buffer while
 * lerping in the gradient and taking the absolute maximum, then encode, apply and write in a
 * second pass over the same buffer. Parameters, codes, scales and second moments are updated
 * in place. Built on first use by gefen.core.native (plain C, no Python or torch headers) and
 * called through ctypes; the eager kernels of gefen.core.kernels stay the reference it is
 * tested against. Float arithmetic follows the eager order (fp32 except where noted).
 *
 * Nearest rounding counts thresholds instead of comparing neighbours: T_j (gefen_tables.h) is
 * the largest fp32 value §6.3's rule sends to codeword j or below, so the index of x is
 * #{T_j < x}, exactly the eager result. On AVX-512 (with VBMI) the block passes of
 * gefen_avx512.h run instead of the portable loops here, and on AVX2 those of gefen_avx2.h
 * (also where the AVX-512 passes decline a block); all give the same bits (tested).
 *
 * codebook4 (a codebook of at most 16 values, ``gefen_tables.size``) keeps two 4-bit codes per
 * byte, element 2j in the low nibble of byte j: a block of P elements takes ceil(P/2) bytes and
 * always starts on a byte. The SIMD passes read and write one code per byte, so a packed block
 * is unpacked into the thread's scratch before them and packed after; the portable loops read
 * and write the nibbles in place.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CODEBOOK_SIZE 256
#define PACKED_CODEBOOK_SIZE 16
#define TABLE_BUCKETS 4096

#define COARSE_BUCKETS 512

/* What the encode reads besides the codebook, built once per codebook by gefen_build_tables.
 * ``count``/``window``: #{codewords in lower buckets} and the most codewords in one bucket
 * (stochastic rounding needs both neighbours). ``threshold``: T_j, the largest fp32 value whose
 * nearest codeword (§6.3's rule, ties to the lower) is at most j, so that the nearest index of x
 * is #{j : T_j < x}; T_255 = +inf. ``threshold_count``/``threshold_window``: the same bucket
 * table over the thresholds. The SIMD path keeps its tables in registers: ``coarse`` is the
 * threshold count over 256 buckets (one byte each) with ``coarse_window``, and ``*_planes`` hold
 * byte k of every codeword / threshold (plane k, 256 bytes), for 64-lane byte lookups.
 * ``size``: the codewords (256, or at most 16 for packed 4-bit codes); the codebook planes
 * hold ``size`` of them, and T_j = +inf from j = size - 1 on. */
typedef struct {
    int32_t count[TABLE_BUCKETS];
    int32_t threshold_count[TABLE_BUCKETS];
    float threshold[CODEBOOK_SIZE];
    int32_t window, threshold_window, coarse_window, size;
    uint8_t coarse[COARSE_BUCKETS];
    uint8_t codebook_planes[4][CODEBOOK_SIZE];
    uint8_t threshold_planes[4][CODEBOOK_SIZE];
} gefen_tables;

typedef struct {
    float lr, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, inv_bc1, decay;
    /* portable: 0 the fastest passes the build has, 1 the portable loops only, 2 the AVX2
     * passes where they apply (the AVX-512 ones skipped; as 1 in a build without AVX2) */
    int32_t has_decay, write, stochastic, threads, portable;
    int32_t factored_floor; /* floor the factored estimate by (1 - beta2) g^2 (§6.2) */
    int32_t nesterov;       /* apply lerp(m, g, 1 - beta1) instead of the stored m */
    uint64_t stream;
} gefen_scalars;

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if (value != value) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch */
    return (uint16_t)(bits >> 16);
}

static inline float load(const void *base, int dtype, int64_t i) {
    return dtype == DTYPE_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

static inline void store(void *base, int dtype, int64_t i, float value) {
    if (dtype == DTYPE_F32) ((float *)base)[i] = value;
    else ((uint16_t *)base)[i] = f32_to_bf16(value);
}

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline float draw(uint64_t stream, int64_t k) {
    uint64_t hashed = mix64(stream + 0x9E3779B97F4A7C15ULL * (uint64_t)(k + 1));
    return (float)(hashed >> 40) * (1.0f / 16777216.0f);
}

/* The bucket of x in [-1, 1] (NaN -> 0): monotone non-decreasing, branch-free. */
static inline int32_t bucket(float x) {
    float b = floorf((x + 1.0f) * (float)(TABLE_BUCKETS / 2));
    b = b > 0.0f ? b : 0.0f;
    b = b < (float)(TABLE_BUCKETS - 1) ? b : (float)(TABLE_BUCKETS - 1);
    return (int32_t)b;
}

/* The coarse bucket of x in [-1, 1] (NaN -> 0), for the SIMD path's byte table. */
static inline int32_t coarse_bucket(float x) {
    float b = floorf((x + 1.0f) * (float)(COARSE_BUCKETS / 2));
    b = b > 0.0f ? b : 0.0f;
    b = b < (float)(COARSE_BUCKETS - 1) ? b : (float)(COARSE_BUCKETS - 1);
    return (int32_t)b;
}

static inline float step_size(float second_moment, const gefen_scalars *s) {
    return (1.0f / (sqrtf(second_moment) / s->sqrt_bc2 + s->eps)) * s->inv_bc1;
}

/* Elements of a block handled per pass: the scratch buffers (32 KB at most) stay in L1/L2. */
#define SCRATCH 2048

/* The larger of two block maxima, NaN if either is (the bit order of advance()). */
static inline float nan_max(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    uint32_t top = x > y ? x : y;
    float out;
    memcpy(&out, &top, sizeof out);
    return out;
}

/* Code j of a block whose codes start at ``codes`` (two per byte when ``packed``). */
static inline int32_t code_at(const uint8_t *codes, int64_t j, int packed) {
    return packed ? (codes[j >> 1] >> ((j & 1) << 2)) & 15 : codes[j];
}

static inline void set_code(uint8_t *codes, int64_t j, int32_t value, int packed) {
    if (!packed) {
        codes[j] = (uint8_t)value;
        return;
    }
    int shift = (int)((j & 1) << 2);
    uint8_t *byte = codes + (j >> 1);
    *byte = (uint8_t)((*byte & ~(15 << shift)) | (value << shift));
}

/* Bytes of codes from a block's start to its element ``o`` (``o`` even when packed). */
static inline int64_t code_bytes(int64_t o, int packed) { return packed ? (o + 1) / 2 : o; }

/* ``len`` packed codes as one byte each, and back (an odd length's last high nibble is 0). */
static void unpack_codes(const uint8_t *restrict codes, int64_t len, uint8_t *restrict out) {
    for (int64_t j = 0; j < len; ++j) out[j] = (codes[j >> 1] >> ((j & 1) << 2)) & 15;
}

static void pack_codes(const uint8_t *restrict in, int64_t len, uint8_t *restrict codes) {
    int64_t j = 0;
    for (; j + 1 < len; j += 2) codes[j >> 1] = (uint8_t)(in[j] | (in[j + 1] << 4));
    if (j < len) codes[j >> 1] = in[j];
}

/* Block-sized scratch of one thread: the decoded/advanced momentum, the normalised values,
 * the search counts and the per-element step sizes (factored family). */
typedef struct {
    float *advanced, *normalised, *factor;
    int32_t *count;
    uint8_t *bytes; /* a packed block's codes, one per byte, for the SIMD passes */
} scratch;

static int scratch_init(scratch *w, int64_t period) {
    size_t n = (size_t)period;
    w->advanced = (float *)malloc(sizeof(float) * n);
    w->normalised = (float *)malloc(sizeof(float) * n);
    w->factor = (float *)malloc(sizeof(float) * n);
    w->count = (int32_t *)malloc(sizeof(int32_t) * n);
    w->bytes = (uint8_t *)malloc(n);
    return w->advanced && w->normalised && w->factor && w->count && w->bytes;
}

static void scratch_free(scratch *w) {
    free(w->advanced);
    free(w->normalised);
    free(w->factor);
    free(w->count);
    free(w->bytes);
}

/* torch.lerp's formula for a scalar weight in [0, 1], operation for operation. */
static inline float lerp_float(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

/* Pass 1: advanced = lerp(cb[codes]·scale, g, w); returns max |advanced| (NaN if any is NaN:
 * on the bit patterns of |x|, integer order is float order and NaNs sort above +Inf, so the
 * integer maximum vectorises and still propagates NaN). */
static float advance(const void *grad, int dtype, int64_t first, int64_t period,
                     const uint8_t *codes, float old_scale, const float *cb, float weight,
                     float *advanced, int packed) {
    uint32_t top = 0;
    for (int64_t j = 0; j < period; ++j) {
        float start = cb[code_at(codes, j, packed)] * old_scale;
        float end = dtype == DTYPE_F32 ? ((const float *)grad)[first + j]
                                       : bf16_to_f32(((const uint16_t *)grad)[first + j]);
        float value = lerp_float(start, end, weight);
        advanced[j] = value;
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    float maximum;
    memcpy(&maximum, &top, sizeof maximum);
    return maximum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VBMI__)
#define GEFEN_AVX512 1
#include "gefen_avx512.h"
#else
#define GEFEN_AVX512 0
#endif

#if defined(__AVX2__)
#define GEFEN_AVX2 1
#include "gefen_avx2.h"
#else
#define GEFEN_AVX2 0
#endif

/* advance() on the fastest path the build has (the SIMD one unless ``portable``; ``bytes``
 * holds a packed block's codes unpacked for it). */
static float advance_any(const void *grad, int dtype, int64_t first, int64_t period,
                         const uint8_t *codes, float old_scale, const float *cb, float weight,
                         float *advanced, const gefen_tables *t, int portable, uint8_t *bytes) {
    int packed = t->size <= PACKED_CODEBOOK_SIZE;
#if GEFEN_AVX512
    if (portable == 0) {
        if (packed) unpack_codes(codes, period, bytes);
        return advance_simd(grad, dtype, first, period, packed ? bytes : codes, old_scale, t,
                            weight, advanced);
    }
#endif
#if GEFEN_AVX2
    if (portable != 1) {
        if (packed) unpack_codes(codes, period, bytes);
        return advance_avx2(grad, dtype, first, period, packed ? bytes : codes, old_scale, cb,
                            weight, advanced);
    }
#endif
    (void)portable;
    (void)bytes;
    return advance(grad, dtype, first, period, codes, old_scale, cb, weight, advanced, packed);
}

/* The absolute maximum of a whole block's advanced momentum, ``sub`` elements at a time; when
 * the block fits one pass (period <= sub) ``buffer`` keeps its advanced values. */
static float block_maximum(const void *grad, int dtype, int64_t first, int64_t period,
                           int64_t sub, const uint8_t *codes, float old_scale, const float *cb,
                           float weight, float *buffer, const gefen_tables *t, int portable,
                           uint8_t *bytes) {
    float maximum = 0.0f;
    for (int64_t o = 0; o < period; o += sub) {
        int64_t len = period - o < sub ? period - o : sub;
        float part = advance_any(grad, dtype, first + o, len,
                                 codes + code_bytes(o, t->size <= PACKED_CODEBOOK_SIZE),
                                 old_scale, cb, weight, buffer, t, portable, bytes);
        maximum = nan_max(maximum, part);
    }
    return maximum;
}

/* Pass 2: the §6.3 index of every element, in vectorisable sweeps over the block; on return
 * ``advanced`` holds each element's chosen codeword (the apply pass scales it). */
static void encode_block(float *restrict advanced, float maximum, int64_t period,
                         const float *restrict cb, const gefen_tables *t, const gefen_scalars *s,
                         int64_t first, scratch *w, uint8_t *restrict codes) {
    float *restrict x = w->normalised;
    int32_t *restrict count = w->count;
    int size = t->size, packed = size <= PACKED_CODEBOOK_SIZE;
    int nearest = !s->stochastic;
    const int32_t *restrict table = nearest ? t->threshold_count : t->count;
    const float *restrict probes = nearest ? t->threshold : cb;
    int window = nearest ? t->threshold_window : t->window;
    int64_t begin = 0; /* elements before ``begin`` are encoded by the AVX2 pass */
#if GEFEN_AVX2
    if (nearest && s->portable != 1) {
        begin = period & ~(int64_t)7;
        encode_nearest_avx2(advanced, maximum, begin, cb, t, packed ? w->bytes : codes);
        if (packed) pack_codes(w->bytes, begin, codes); /* ``begin`` is even: whole bytes */
    }
#endif
    for (int64_t j = begin; j < period; ++j) {
        float value = maximum > 0.0f ? advanced[j] / maximum : 0.0f;
        value = value == value ? value : 0.0f;
        x[j] = value;
        count[j] = table[bucket(value)];
    }
    /* nearest: count = #{T < x} (T_255 = +inf ends every scan); stochastic: #{cb < x}. */
    for (int step = 0; step < window; ++step) {
        for (int64_t j = begin; j < period; ++j) {
            int32_t c = count[j];
            int32_t probe = c < size ? c : size - 1;
            count[j] = c + ((c < size) & (probes[probe] < x[j]));
        }
    }
    if (nearest) {
        for (int64_t j = begin; j < period; ++j) {
            set_code(codes, j, count[j], packed);
            advanced[j] = cb[count[j]]; /* the chosen codeword, for the apply pass */
        }
        return;
    }
    for (int64_t j = 0; j < period; ++j) {
        int32_t c = count[j];
        int32_t lower = c > 0 ? c - 1 : 0;
        int32_t upper = c < size ? c : size - 1;
        float low = cb[lower], high = cb[upper];
        float gap = high - low;
        float p_up = (x[j] - low) / (gap > 0.0f ? gap : 1.0f);
        int up = (gap > 0.0f) & (draw(s->stream, first + j) < p_up);
        set_code(codes, j, up ? upper : lower, packed);
        advanced[j] = up ? high : low;
    }
}

/* The floored estimate's root, max(sqrt(v̂)/sqrt(bc2), |g|·k) with k = sqrt(1 - beta2)/sqrt(bc2):
 * the root of §6.2's max(v̂, (1 - beta2) g²) over bc2, as sqrt is monotone (NaN propagates
 * through ``estimate`` as in the reference: a NaN g makes its row's root NaN too). */
static void floor_roots(const void *grad, int dtype, int64_t first, int64_t run, float r,
                        const float *restrict v_col, float k, float *restrict root) {
    if (dtype == DTYPE_F32) {
        const float *restrict g = (const float *)grad + first;
        for (int64_t i = 0; i < run; ++i) {
            float estimate = r * v_col[i], own = fabsf(g[i]) * k;
            root[i] = own > estimate ? own : estimate;
        }
    } else {
        const uint16_t *restrict g = (const uint16_t *)grad + first;
        for (int64_t i = 0; i < run; ++i) {
            float estimate = r * v_col[i], own = fabsf(bf16_to_f32(g[i])) * k;
            root[i] = own > estimate ? own : estimate;
        }
    }
}

/* k of floor_roots(): the gradient's factor in the floored root. */
static inline float floor_k(const gefen_scalars *s) {
    return sqrtf(s->one_minus_beta2) / s->sqrt_bc2;
}

/* The factored family's step size of each element of the block, row segment by row segment
 * (``grad``/``dtype``: the gradient, read only with ``factored_floor``). */
static void factored_factors(const void *grad, int dtype, int64_t first, int64_t period,
                             const float *restrict v_row, const float *restrict v_col,
                             int64_t cols, const gefen_scalars *s, float *restrict factor) {
    float eps = s->eps, inv_bc1 = s->inv_bc1, k = floor_k(s);
    int64_t j = 0;
    while (j < period) {
        int64_t row = (first + j) / cols, col = (first + j) % cols;
        int64_t run = cols - col < period - j ? cols - col : period - j;
        /* ``v_row``/``v_col`` hold sqrt(v_row / norm) and sqrt(v_col) / sqrt(bc2) here:
         * sqrt(v̂)/sqrt(bc2) as a product of per-row and per-column roots, within 2 ulp of the
         * reference and far inside the parameter bounds of §11 (it never reaches the codes). */
        float r = v_row[row];
        if (s->factored_floor) {
            floor_roots(grad, dtype, first + j, run, r, v_col + col, k, factor + j);
            for (int64_t i = 0; i < run; ++i) factor[j + i] = inv_bc1 / (factor[j + i] + eps);
        } else {
            for (int64_t i = 0; i < run; ++i) factor[j + i] = inv_bc1 / (r * v_col[col + i] + eps);
        }
        j += run;
    }
}

/* Pass 3: apply the re-quantized momentum and write the parameter (one final rounding).
 * ``factor`` holds per-element step sizes (factored family) or is NULL (``block_s``); with
 * ``nesterov`` the momentum applied is lerp(m, g, 1 - beta1), ``grad`` read once more. */
#define APPLY_LOOP(LOAD, STORE, FACTOR)                                                        \
    for (int64_t j = 0; j < period; ++j) {                                                   \
        float momentum = chosen[j] * maximum;                                                \
        if (nesterov) momentum = lerp_float(momentum, load(grad, dtype, first + j), weight); \
        float update = (momentum * (FACTOR)) * lr;                                           \
        float current = LOAD;                                                                \
        current = has_decay ? current * decay : current;                                     \
        STORE(current - update);                                                             \
    }

static void apply_block(void *restrict param, const void *restrict grad, int dtype,
                        int64_t first, int64_t period, const float *restrict chosen,
                        float maximum, const float *restrict factor, float block_s,
                        const gefen_scalars *s) {
    float lr = s->lr, decay = s->decay, weight = s->one_minus_beta1;
    int nesterov = s->nesterov;
    int has_decay = s->has_decay;
    float *restrict p32 = (float *)param + first;
    uint16_t *restrict p16 = (uint16_t *)param + first;
#define STORE32(v) p32[j] = (v)
#define STORE16(v) p16[j] = f32_to_bf16(v)
    if (dtype == DTYPE_F32 && factor) APPLY_LOOP(p32[j], STORE32, factor[j])
    else if (dtype == DTYPE_F32) APPLY_LOOP(p32[j], STORE32, block_s)
    else if (factor) APPLY_LOOP(bf16_to_f32(p16[j]), STORE16, factor[j])
    else APPLY_LOOP(bf16_to_f32(p16[j]), STORE16, block_s)
#undef STORE32
#undef STORE16
}

/* The block's mean of g² (float partial sums in a fixed lane order: vectorisable and
 * deterministic, as accurate as torch's own float reduction). */
static float mean_square_portable(const void *grad, int dtype, int64_t first, int64_t period) {
    enum { LANES = 16 };
    float partial[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= period; j += LANES)
        for (int lane = 0; lane < LANES; ++lane) {
            float g = load(grad, dtype, first + j + lane);
            partial[lane] += g * g;
        }
    float total = 0.0f;
    for (; j < period; ++j) {
        float g = load(grad, dtype, first + j);
        total += g * g;
    }
    for (int lane = 0; lane < LANES; ++lane) total += partial[lane];
    return total / (float)period;
}

/* mean_square() on the fastest path the build has; ``column_sums`` as in mean_square_simd. */
static float mean_square(const void *grad, int dtype, int64_t first, int64_t period,
                         float *column_sums, int portable) {
#if GEFEN_AVX512
    if (portable == 0) return mean_square_simd(grad, dtype, first, period, column_sums);
#endif
    (void)portable;
    if (column_sums)
        for (int64_t c = 0; c < period; ++c) {
            float value = load(grad, dtype, first + c);
            column_sums[c] += value * value;
        }
    return mean_square_portable(grad, dtype, first, period);
}

static void update_blocks(void *param, const void *grad, int dtype, uint8_t *codes, float *scale,
                          float *v_block, const float *v_row, const float *v_col, int64_t cols,
                          int64_t blocks, int64_t period, const float *cb,
                          const gefen_tables *t, const gefen_scalars *s, int *failed) {
    int64_t sub = period < SCRATCH ? period : SCRATCH;
    int packed = t->size <= PACKED_CODEBOOK_SIZE;
#pragma omp parallel num_threads(s->threads) if (s->threads > 1 && blocks > 1)
    {
        scratch w;
        if (!scratch_init(&w, sub)) {
            *failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; ++b) {
                int64_t first = b * period;
                uint8_t *block_codes = codes + b * code_bytes(period, packed);
                float block_s = 0.0f;
                if (v_block) {
                    float mean = mean_square(grad, dtype, first, period, NULL, s->portable);
                    float fresh = v_block[b] * s->beta2 + mean * s->one_minus_beta2;
                    v_block[b] = fresh;
                    block_s = step_size(fresh, s);
                }
                /* A block longer than the scratch is decoded twice (once for its maximum),
                 * so every pass stays in L1 whatever the period. */
                float old_scale = scale[b];
                float maximum = block_maximum(grad, dtype, first, period, sub, block_codes,
                                              old_scale, cb, s->one_minus_beta1, w.advanced,
                                              t, s->portable, w.bytes);
                scale[b] = maximum;
                for (int64_t o = 0; o < period; o += sub) {
                    int64_t len = period - o < sub ? period - o : sub;
                    uint8_t *sub_codes = block_codes + code_bytes(o, packed);
                    if (period > sub)
                        advance_any(grad, dtype, first + o, len, sub_codes, old_scale, cb,
                                    s->one_minus_beta1, w.advanced, t, s->portable, w.bytes);
                    const float *factor = v_block ? NULL : w.factor;
#if GEFEN_AVX512
                    if (!s->stochastic && s->portable == 0 && t->coarse_window <= SIMD_MAX_WINDOW) {
                        /* within one row the step sizes are computed in the pass itself */
                        int64_t row = v_block ? 0 : (first + o) / cols;
                        int64_t col = v_block ? 0 : (first + o) % cols;
                        const float *column = !v_block && col + len <= cols ? v_col + col : NULL;
                        if (!v_block && !column)
                            factored_factors(grad, dtype, first + o, len, v_row, v_col, cols, s,
                                             w.factor);
                        commit_nearest_simd(w.advanced, maximum, len, t,
                                            packed ? w.bytes : sub_codes,
                                            param, dtype, first + o, column ? NULL : factor,
                                            block_s, column, column ? v_row[row] : 0.0f,
                                            grad, floor_k(s), s);
                        if (packed) pack_codes(w.bytes, len, sub_codes);
                        continue;
                    }
#endif
                    if (!v_block)
                        factored_factors(grad, dtype, first + o, len, v_row, v_col, cols, s,
                                         w.factor);
                    encode_block(w.advanced, maximum, len, cb, t, s, first + o, &w, sub_codes);
                    if (s->write)
                        apply_block(param, grad, dtype, first + o, len, w.advanced, maximum,
                                    factor, block_s, s);
                }
            }
        }
        scratch_free(&w);
    }
}

/* §6.2's reduction over the whole (R, C) gradient, in one read of it: each row's mean of g² into
 * ``row_means`` and each column's sum of g² into ``column_sums`` (accumulated row after row, row
 * sums in fixed lanes, both in float as torch's own reductions are). It doubles as the step
 * preflight's finiteness check (§7.2) of a factored gradient: returns 0 when every row mean and
 * every column sum is finite, and then so is every element (squares are non-negative, so a NaN
 * or ±Inf element makes its row's sum NaN or +Inf); 1 otherwise, and the caller checks the
 * elements themselves (a finite |g| above about 1.8e19 overflows g² as well, and a few rows
 * near it overflow a column's sum, which the second moment would keep at +Inf for good). */
int gefen_factored_sums(const void *grad, int32_t dtype, int64_t rows, int64_t cols,
                        float *row_means, float *column_sums, int32_t portable) {
    /* Each column is summed in float over runs of SUM_RUN rows, the runs in double: summed
     * row after row in float, a column of R rows drifts by about R * 2^-24 (2.8e-5 at 131072
     * rows), past the 1e-6 that §11 allows against torch's cascaded mean. */
    enum { SUM_RUN = 16 };
    double *totals = rows > SUM_RUN ? (double *)calloc((size_t)cols, sizeof(double)) : NULL;
    memset(column_sums, 0, sizeof(float) * (size_t)cols);
    int finite = 1;
    for (int64_t r = 0; r < rows; ++r) {
        float mean = mean_square(grad, dtype, r * cols, cols, column_sums, portable);
        row_means[r] = mean;
        finite &= isfinite(mean) != 0;
        if (totals && ((r + 1) % SUM_RUN == 0 || r + 1 == rows))
            for (int64_t c = 0; c < cols; ++c) {
                totals[c] += (double)column_sums[c];
                column_sums[c] = 0.0f;
            }
    }
    if (totals) {
        for (int64_t c = 0; c < cols; ++c) column_sums[c] = (float)totals[c];
        free(totals);
    }
    /* the column sums too: R rows of |g| near 1e19 in one column overflow it, not any row */
    for (int64_t c = 0; c < cols; ++c) finite &= isfinite(column_sums[c]) != 0;
    return finite ? 0 : 1;
}

/* §6.2: the row and column EMAs of g² from the sums above; returns the normaliser
 * max(mean(v_row), FLT_MIN), the mean taken in double. */
static float factored_moments(float *restrict v_row, float *restrict v_col, int64_t rows,
                              int64_t cols, const float *row_means, const float *column_sums,
                              const gefen_scalars *s) {
    double row_total = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
        v_row[r] = v_row[r] * s->beta2 + row_means[r] * s->one_minus_beta2;
        row_total += (double)v_row[r];
    }
    for (int64_t c = 0; c < cols; ++c)
        v_col[c] = v_col[c] * s->beta2 + (column_sums[c] / (float)rows) * s->one_minus_beta2;
    float mean = (float)(row_total / (double)rows);
    const float flt_min = 1.17549435e-38f;
    return mean > flt_min ? mean : flt_min;
}

/* The entry point: one codebook8 parameter of ``blocks`` x ``period`` elements, contiguous.
 * v_block != NULL selects the block family; otherwise v_row (rows) and v_col (cols), with
 * ``sums`` the gradient's row means then column sums from gefen_factored_sums (the preflight
 * computed them), or NULL to compute them here. */
int gefen_update_codebook8(void *param, const void *grad, int32_t dtype, uint8_t *codes,
                           float *scale, float *v_block, float *v_row, float *v_col,
                           int64_t rows, int64_t cols, int64_t blocks, int64_t period,
                           const float *codebook, const gefen_tables *tables,
                           const gefen_scalars *s, const float *sums) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    float norm = 1.0f;
    int failed = 0;
    float *roots = NULL, *own = NULL;
    if (!v_block) {
        /* one buffer: the sums when not given, then the row and column roots */
        size_t size = (size_t)(rows + cols) * (sums ? 1 : 2);
        roots = (float *)malloc(sizeof(float) * size);
        if (!roots) return 2;
        if (!sums) {
            own = roots + rows + cols;
            gefen_factored_sums(grad, dtype, rows, cols, own, own + rows, s->portable);
            sums = own;
        }
        norm = factored_moments(v_row, v_col, rows, cols, sums, sums + rows, s);
        for (int64_t r = 0; r < rows; ++r) roots[r] = sqrtf(v_row[r] / norm);
        for (int64_t c = 0; c < cols; ++c) roots[rows + c] = sqrtf(v_col[c]) / s->sqrt_bc2;
    }
    update_blocks(param, grad, dtype, codes, scale, v_block, roots, roots ? roots + rows : NULL,
                  cols, blocks, period, codebook, tables, s, &failed);
    free(roots);
    return failed ? 2 : 0;
}

#include "gefen_momentum.h"
#include "gefen_tables.h"
#include "gefen_finite.h"

/* The SIMD passes of this build: bit 0 the AVX-512 ones, bit 1 the AVX2 ones (``portable``
 * selects among them and the portable loops). */
int32_t gefen_simd_available(void) { return GEFEN_AVX512 | (GEFEN_AVX2 << 1); }
