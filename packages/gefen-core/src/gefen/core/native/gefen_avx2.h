/* The AVX2 block passes of gefen_update.c, for CPUs without AVX-512 (most client CPUs, Zen 2/3,
 * and virtual machines that hide AVX-512): advance() and the nearest branch of encode_block()
 * on eight lanes, the same arithmetic in the same order as the portable loops there (tested
 * against them bit for bit). Included by gefen_update.c when the compiler targets AVX2.
 *
 * Without byte permutations wide enough to hold a 256-entry table in registers, the table
 * lookups are gathers (decode, bucket count, thresholds, chosen codeword); what this gains over
 * the portable loops is that every pass runs eight lanes at a time with no per-element branch,
 * while the compiler leaves the portable advance() scalar and emulates the gathers of the
 * encode one lane at a time. The apply pass and the second-moment reductions stay the portable
 * loops, which the compiler already vectorises. No FMA: the build keeps ISO C's contraction
 * rule (``-std=c11``), so every multiply and add rounds on its own, as in the portable loops. */
#include <immintrin.h>

static inline __m256 load8(const void *base, int dtype, int64_t i) {
    if (dtype == DTYPE_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* lerp_float() on eight lanes (``rest`` = 1 - weight, ``low`` = weight < 0.5). */
static inline __m256 lerp8(__m256 start, __m256 end, __m256 weight, __m256 rest, int low) {
    __m256 diff = _mm256_sub_ps(end, start);
    return low ? _mm256_add_ps(start, _mm256_mul_ps(weight, diff))
               : _mm256_sub_ps(end, _mm256_mul_ps(diff, rest));
}

/* advance() for one code per byte: decode, lerp, store, and |max| on the bit patterns. */
static float advance_avx2(const void *grad, int dtype, int64_t first, int64_t period,
                          const uint8_t *codes, float old_scale, const float *cb, float weight,
                          float *advanced) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256 scale = _mm256_set1_ps(old_scale), w = _mm256_set1_ps(weight);
    const __m256 rest = _mm256_set1_ps(1.0f - weight);
    int low = weight < 0.5f;
    __m256i top = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= period; j += 8) {
        __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
        __m256 start = _mm256_mul_ps(_mm256_i32gather_ps(cb, index, 4), scale);
        __m256 value = lerp8(start, load8(grad, dtype, first + j), w, rest, low);
        _mm256_storeu_ps(advanced + j, value);
        top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(value), magnitude));
    }
    uint32_t lanes8[8], most = 0;
    _mm256_storeu_si256((__m256i *)lanes8, top);
    for (int lane = 0; lane < 8; ++lane) most = lanes8[lane] > most ? lanes8[lane] : most;
    float maximum;
    memcpy(&maximum, &most, sizeof maximum);
    if (j < period) /* the tail by the portable loop, from the same codes */
        maximum = nan_max(maximum, advance(grad, dtype, first + j, period - j, codes + j,
                                           old_scale, cb, weight, advanced + j, 0));
    return maximum;
}

/* The nearest branch of encode_block() for the elements [0, full) (a multiple of eight): the
 * §6.3 index of each into ``bytes`` (one per byte) and its codeword into ``advanced``. */
static void encode_nearest_avx2(float *advanced, float maximum, int64_t full, const float *cb,
                                const gefen_tables *t, uint8_t *bytes) {
    const __m256 most = _mm256_set1_ps(maximum), one = _mm256_set1_ps(1.0f);
    const __m256 half = _mm256_set1_ps((float)(TABLE_BUCKETS / 2)), zero = _mm256_setzero_ps();
    const __m256 last = _mm256_set1_ps((float)(TABLE_BUCKETS - 1));
    const __m256i size = _mm256_set1_epi32(t->size), top = _mm256_set1_epi32(t->size - 1);
    int positive = maximum > 0.0f;
    for (int64_t j = 0; j < full; j += 8) {
        __m256 x = zero;
        if (positive) {
            x = _mm256_div_ps(_mm256_loadu_ps(advanced + j), most);
            x = _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_ORD_Q)); /* NaN -> 0 */
        }
        __m256 b = _mm256_floor_ps(_mm256_mul_ps(_mm256_add_ps(x, one), half));
        b = _mm256_min_ps(_mm256_max_ps(b, zero), last); /* bucket(): x is never NaN here */
        __m256i count = _mm256_i32gather_epi32(t->threshold_count, _mm256_cvttps_epi32(b), 4);
        for (int step = 0; step < t->threshold_window; ++step) {
            __m256i open = _mm256_cmpgt_epi32(size, count);
            __m256 bound = _mm256_i32gather_ps(t->threshold, _mm256_min_epi32(count, top), 4);
            __m256i below = _mm256_castps_si256(_mm256_cmp_ps(bound, x, _CMP_LT_OQ));
            count = _mm256_sub_epi32(count, _mm256_and_si256(open, below)); /* +1 where both */
        }
        __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(count),
                                         _mm256_extracti128_si256(count, 1));
        _mm_storel_epi64((__m128i *)(bytes + j), _mm_packus_epi16(words, words));
        _mm256_storeu_ps(advanced + j, _mm256_i32gather_ps(cb, count, 4));
    }
}
