/* The AVX-512 block passes of gefen_update.c: the same arithmetic, in the same order, as the
 * portable loops there (which stay as the fallback and are tested against these). Included by
 * gefen_update.c only when the compiler targets AVX-512 F/BW/DQ/VL/VBMI (``-march=native`` on
 * such a CPU).
 *
 * Gathers are slow (about 20 cycles for sixteen lanes on the CPUs measured), so no table is read
 * with one: sixty-four elements at a time, every table lookup is a byte lookup in registers
 * (VBMI ``vpermt2b`` over a 256-byte table held in four registers). An fp32 table is four such
 * byte tables (``*_planes``); the four byte results are interleaved back into sixteen-lane
 * floats. The nearest index is #{T_j < x}: a coarse 512-bucket byte table gives a lower bound,
 * then ``coarse_window`` threshold comparisons finish it. Tails are handled with masks. */
#include <immintrin.h>

#define SIMD_MAX_WINDOW 8 /* more comparisons than this: the portable loops are faster */

typedef struct {
    __m512i q[4];
} byte_table; /* 256 bytes in four registers */

typedef struct {
    byte_table plane[4];
} float_table; /* 256 floats as four byte planes */

static inline byte_table load_bytes(const uint8_t *table) {
    byte_table out;
    for (int k = 0; k < 4; ++k) out.q[k] = _mm512_loadu_si512(table + 64 * k);
    return out;
}

static inline float_table load_planes(const uint8_t planes[4][CODEBOOK_SIZE]) {
    float_table out;
    for (int k = 0; k < 4; ++k) out.plane[k] = load_bytes(planes[k]);
    return out;
}

static inline __m512i lookup_bytes(const byte_table *t, __m512i index) {
    __m512i low = _mm512_permutex2var_epi8(t->q[0], index, t->q[1]);
    __m512i high = _mm512_permutex2var_epi8(t->q[2], index, t->q[3]);
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high);
}

/* The unpacks below interleave within 128-bit lanes; feeding them the indices in this order
 * makes out[r] hold elements 16r .. 16r + 15 in order: ORDER[16L + 4r + q] = 16r + 4L + q. */
static const uint8_t LANE_ORDER[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63,
};

static inline __m512i lane_order(void) { return _mm512_loadu_si512(LANE_ORDER); }

/* Four sixteen-lane masks as one 64-lane mask, m[0] lowest. */
static inline __mmask64 join_masks(const __mmask16 m[4]) {
    return _kunpackd_mask64(_kunpackw_mask32(m[3], m[2]), _kunpackw_mask32(m[1], m[0]));
}

/* out[r] = table[element 16r + i] for 64 byte indices given in LANE_ORDER (``k``). */
static inline void lookup_floats_lane(const float_table *t, __m512i k, __m512 out[4]) {
    __m512i b0 = lookup_bytes(&t->plane[0], k), b1 = lookup_bytes(&t->plane[1], k);
    __m512i b2 = lookup_bytes(&t->plane[2], k), b3 = lookup_bytes(&t->plane[3], k);
    __m512i low01 = _mm512_unpacklo_epi8(b0, b1), high01 = _mm512_unpackhi_epi8(b0, b1);
    __m512i low23 = _mm512_unpacklo_epi8(b2, b3), high23 = _mm512_unpackhi_epi8(b2, b3);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23));
}

/* out[r] = table[index[16r + i]] for the 64 byte indices of ``index`` (element order). */
static inline void lookup_floats(const float_table *t, __m512i order, __m512i index, __m512 out[4]) {
    lookup_floats_lane(t, _mm512_permutexvar_epi8(order, index), out);
}

static inline __mmask16 lanes(int64_t left) {
    if (left <= 0) return 0;
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

static inline __mmask64 byte_lanes(int64_t left) {
    return left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
}

/* Masked stores are slow on some CPUs (several cycles each on Zen 4, against one for a plain
 * store), so a full chunk takes the plain store; only tails are masked. */
static inline void store_floats(float *at, __mmask16 m, __m512 value) {
    if (m == (__mmask16)0xFFFF) _mm512_storeu_ps(at, value);
    else _mm512_mask_storeu_ps(at, m, value);
}

static inline void store_bytes(uint8_t *at, __mmask64 m, __m512i value) {
    if (m == ~(__mmask64)0) _mm512_storeu_si512(at, value);
    else _mm512_mask_storeu_epi8(at, m, value);
}

/* A hint to fetch the 64 elements 4 KB ahead of element ``i`` (a hint: never faults, even past
 * the end). Each pass interleaves short streams (one row of gradient and codes, then one row of
 * parameter), which the hardware prefetchers follow too late on their own. */
static inline void prefetch_ahead(const void *base, int dtype, int64_t i) {
    const char *at = (const char *)base + (dtype == DTYPE_F32 ? 4 : 2) * i + 4096;
    for (int line = 0; line < (dtype == DTYPE_F32 ? 4 : 2); ++line)
        _mm_prefetch(at + 64 * line, _MM_HINT_T0);
}

static inline __m512 load16(const void *base, int dtype, int64_t i, __mmask16 m) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)base + i);
    __m256i half = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* fp32 -> bf16 as f32_to_bf16: round to nearest even, NaN made quiet. */
static inline void store16(void *base, int dtype, int64_t i, __mmask16 m, __m512 value) {
    if (dtype == DTYPE_F32) {
        store_floats((float *)base + i, m, value);
        return;
    }
    __m512i bits = _mm512_castps_si512(value);
    __m512i high = _mm512_srli_epi32(bits, 16);
    __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
    __m256i packed = _mm512_cvtepi32_epi16(rounded);
    if (m == (__mmask16)0xFFFF) _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), packed);
    else _mm256_mask_storeu_epi16((uint16_t *)base + i, m, packed);
}

/* lerp_float() on sixteen lanes (``rest`` = 1 - weight, ``low`` = weight < 0.5). */
static inline __m512 lerp_simd(__m512 start, __m512 end, __m512 weight, __m512 rest, int low) {
    __m512 diff = _mm512_sub_ps(end, start);
    return low ? _mm512_add_ps(start, _mm512_mul_ps(weight, diff))
               : _mm512_sub_ps(end, _mm512_mul_ps(diff, rest));
}

/* advance(): decode, lerp, store, and the block's |max| on the bit patterns. */
static float advance_simd(const void *grad, int dtype, int64_t first, int64_t period,
                          const uint8_t *codes, float old_scale, const gefen_tables *t,
                          float weight, float *advanced) {
    const float_table cb = load_planes(t->codebook_planes);
    const __m512i order = lane_order(), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 scale = _mm512_set1_ps(old_scale), w = _mm512_set1_ps(weight);
    const __m512 rest = _mm512_set1_ps(1.0f - weight);
    int low = weight < 0.5f;
    __m512i top = _mm512_setzero_si512();
    for (int64_t j = 0; j < period; j += 64) {
        __m512i index = _mm512_maskz_loadu_epi8(byte_lanes(period - j), codes + j);
        prefetch_ahead(grad, dtype, first + j);
        __m512 decoded[4];
        lookup_floats(&cb, order, index, decoded);
        for (int r = 0; r < 4; ++r) {
            int64_t at = j + 16 * r;
            __mmask16 m = lanes(period - at);
            __m512 start = _mm512_mul_ps(decoded[r], scale);
            __m512 end = load16(grad, dtype, first + at, m);
            __m512 value = lerp_simd(start, end, w, rest, low);
            store_floats(advanced + at, m, value);
            __m512i bits = _mm512_and_si512(_mm512_castps_si512(value), magnitude);
            top = _mm512_mask_max_epu32(top, m, top, bits);
        }
    }
    uint32_t most = (uint32_t)_mm512_reduce_max_epu32(top);
    float maximum;
    memcpy(&maximum, &most, sizeof maximum);
    return maximum;
}

/* LANE_ORDER's inverse: INVERSE_ORDER[16r + 4L + q] = 16L + 4r + q. */
static const uint8_t INVERSE_ORDER[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63,
};

/* The §6.3 nearest indices of 64 advanced values (x[r] receives the normalised values). The
 * coarse buckets are packed to bytes with in-lane packs, which leave them in LANE_ORDER, and
 * the coarse counts are put back in element order with one permutation. */
static inline __m512i nearest64(const float *advanced, int64_t left, float maximum,
                                const gefen_tables *t, const byte_table coarse[2],
                                const float_table *thresholds, __m512 x[4]) {
    const __m512 most = _mm512_set1_ps(maximum), one = _mm512_set1_ps(1.0f);
    const __m512 half = _mm512_set1_ps((float)(COARSE_BUCKETS / 2));
    const __m512i last = _mm512_set1_epi32(COARSE_BUCKETS - 1);
    /* |advanced| <= maximum, so x lies in [-1, 1] and its bucket needs no lower clamp; only a
     * non-finite maximum (an infinite momentum) can make x NaN, which the reference maps to 0 */
    int clean = maximum > 0.0f && maximum <= 3.40282347e+38f;
    __m512i whole[4];
    for (int r = 0; r < 4; ++r) {
        __mmask16 m = lanes(left - 16 * r);
        __m512 value = _mm512_setzero_ps();
        if (maximum > 0.0f) {
            value = _mm512_div_ps(_mm512_maskz_loadu_ps(m, advanced + 16 * r), most);
            if (!clean)
                value = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(value, value, _CMP_ORD_Q), value);
        }
        x[r] = value;
        __m512 scaled = _mm512_mul_ps(_mm512_add_ps(value, one), half);
        __m512i b = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        whole[r] = _mm512_min_epi32(b, last); /* x = 1 lands on 512 */
    }
    __m512i pair01 = _mm512_packus_epi32(whole[0], whole[1]);
    __m512i pair23 = _mm512_packus_epi32(whole[2], whole[3]);
    const __m512i low = _mm512_set1_epi16(0xFF);
    __m512i buckets = _mm512_packus_epi16(_mm512_and_si512(pair01, low),
                                          _mm512_and_si512(pair23, low));
    __m512i high = _mm512_packus_epi16(_mm512_srli_epi16(pair01, 8), _mm512_srli_epi16(pair23, 8));
    __mmask64 upper = _mm512_test_epi8_mask(high, high); /* bucket >= 256, LANE_ORDER */
    __m512i coarse_count = _mm512_mask_blend_epi8(upper, lookup_bytes(&coarse[0], buckets),
                                                  lookup_bytes(&coarse[1], buckets));
    __m512i start = _mm512_permutexvar_epi8(_mm512_loadu_si512(INVERSE_ORDER), coarse_count);
    __m512i count = start;
    for (int step = 0; step < t->coarse_window; ++step) {
        /* saturating: index 255 holds T_255 = +inf, which no value exceeds */
        __m512i probe = _mm512_adds_epu8(coarse_count, _mm512_set1_epi8((char)step));
        __m512 bound[4];
        lookup_floats_lane(thresholds, probe, bound);
        __mmask16 below[4];
        for (int r = 0; r < 4; ++r) below[r] = _mm512_cmp_ps_mask(bound[r], x[r], _CMP_LT_OQ);
        count = _mm512_mask_add_epi8(count, join_masks(below), count, _mm512_set1_epi8(1));
    }
    return count;
}

/* encode_block (nearest) and apply_block in one pass; ``factor`` as in apply_block, or, for a
 * stretch of one row of a factored parameter, NULL with ``column_roots`` (its columns' roots)
 * and ``row_root``: the step sizes are then computed here, as factored_factors does (the
 * division runs beside the table lookups instead of in a loop of its own). ``grad`` is read
 * again only for ``factored_floor`` (with ``column_roots``) and ``nesterov``. */
static void commit_nearest_simd(const float *advanced, float maximum, int64_t period,
                                const gefen_tables *t, uint8_t *codes, void *param, int dtype,
                                int64_t first, const float *factor, float block_s,
                                const float *column_roots, float row_root, const void *grad,
                                float floor_k, const gefen_scalars *s) {
    const byte_table coarse[2] = {load_bytes(t->coarse), load_bytes(t->coarse + 256)};
    const float_table thresholds = load_planes(t->threshold_planes);
    const float_table cb = load_planes(t->codebook_planes);
    const __m512i order = lane_order();
    const __m512 most = _mm512_set1_ps(maximum), lr = _mm512_set1_ps(s->lr);
    const __m512 decay = _mm512_set1_ps(s->decay), shared = _mm512_set1_ps(block_s);
    const __m512 root = _mm512_set1_ps(row_root), eps = _mm512_set1_ps(s->eps);
    const __m512 inv_bc1 = _mm512_set1_ps(s->inv_bc1), k = _mm512_set1_ps(floor_k);
    const __m512 w = _mm512_set1_ps(s->one_minus_beta1);
    const __m512 rest = _mm512_set1_ps(1.0f - s->one_minus_beta1);
    int low = s->one_minus_beta1 < 0.5f;
    for (int64_t j = 0; j < period; j += 64) {
        __m512 x[4], chosen[4];
        __m512i index = nearest64(advanced + j, period - j, maximum, t, coarse, &thresholds, x);
        store_bytes(codes + j, byte_lanes(period - j), index);
        if (!s->write) continue;
        prefetch_ahead(param, dtype, first + j);
        lookup_floats(&cb, order, index, chosen);
        for (int r = 0; r < 4; ++r) {
            int64_t at = j + 16 * r;
            __mmask16 m = lanes(period - at);
            if (!m) break;
            __m512 size = shared;
            if (column_roots) {
                __m512 column = _mm512_maskz_loadu_ps(m, column_roots + at);
                __m512 estimate = _mm512_mul_ps(root, column);
                if (s->factored_floor) { /* floor_roots(): own > estimate ? own : estimate */
                    __m512 g = load16(grad, dtype, first + at, m);
                    __m512 own = _mm512_mul_ps(_mm512_abs_ps(g), k);
                    __mmask16 above = _mm512_cmp_ps_mask(own, estimate, _CMP_GT_OQ);
                    estimate = _mm512_mask_blend_ps(above, estimate, own);
                }
                size = _mm512_div_ps(inv_bc1, _mm512_add_ps(estimate, eps));
            } else if (factor) {
                size = _mm512_maskz_loadu_ps(m, factor + at);
            }
            __m512 momentum = _mm512_mul_ps(chosen[r], most);
            if (s->nesterov) momentum = lerp_simd(momentum, load16(grad, dtype, first + at, m),
                                                  w, rest, low);
            __m512 update = _mm512_mul_ps(_mm512_mul_ps(momentum, size), lr);
            __m512 current = load16(param, dtype, first + at, m);
            if (s->has_decay) current = _mm512_mul_ps(current, decay);
            store16(param, dtype, first + at, m, _mm512_sub_ps(current, update));
        }
    }
}

/* GefenMuon's step 1 pass after the maximum: encode (nearest) and write the decoded codeword. */
static void momentum_nearest_simd(const float *advanced, float maximum, int64_t period,
                                  const gefen_tables *t, uint8_t *codes, float *out) {
    const byte_table coarse[2] = {load_bytes(t->coarse), load_bytes(t->coarse + 256)};
    const float_table thresholds = load_planes(t->threshold_planes);
    const float_table cb = load_planes(t->codebook_planes);
    const __m512i order = lane_order();
    const __m512 most = _mm512_set1_ps(maximum);
    for (int64_t j = 0; j < period; j += 64) {
        __m512 x[4], chosen[4];
        __m512i index = nearest64(advanced + j, period - j, maximum, t, coarse, &thresholds, x);
        store_bytes(codes + j, byte_lanes(period - j), index);
        lookup_floats(&cb, order, index, chosen);
        for (int r = 0; r < 4; ++r) {
            __mmask16 m = lanes(period - j - 16 * r);
            store_floats(out + j + 16 * r, m, _mm512_mul_ps(chosen[r], most));
        }
    }
}

/* mean_square(): the same fixed-lane partial sums, sixteen lanes per instruction; when
 * ``column_sums`` is given, g² is also added to it (factored_moments' column sums). */
static float mean_square_simd(const void *grad, int dtype, int64_t first, int64_t period,
                              float *column_sums) {
    __m512 partial = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= period; j += 16) {
        __m512 g = load16(grad, dtype, first + j, 0xFFFF);
        __m512 square = _mm512_mul_ps(g, g);
        partial = _mm512_add_ps(partial, square);
        if (column_sums)
            _mm512_storeu_ps(column_sums + j,
                             _mm512_add_ps(_mm512_loadu_ps(column_sums + j), square));
    }
    float total = 0.0f;
    for (; j < period; ++j) {
        float g = load(grad, dtype, first + j);
        total += g * g;
        if (column_sums) column_sums[j] += g * g;
    }
    float lanes16[16];
    _mm512_storeu_ps(lanes16, partial);
    for (int lane = 0; lane < 16; ++lane) total += lanes16[lane];
    return total / (float)period;
}
