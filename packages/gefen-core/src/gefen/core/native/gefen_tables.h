/* The encode tables of gefen_update.c (``gefen_tables``), built once per codebook: included by
 * gefen_update.c, which defines the struct and the bucket functions they share. */

/* Float order as an unsigned integer order (for bisection over the floats between two
 * codewords), and back. */
static uint32_t float_order(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

static float order_float(uint32_t order) {
    uint32_t bits = (order & 0x80000000u) ? (order & 0x7FFFFFFFu) : ~order;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* ``table[b]`` = #{values whose bucket is below b} for ``n`` sorted values, over ``buckets``
 * buckets (``coarse``: coarse_bucket, else bucket); returns the most values in one bucket
 * (at least 1). */
static int32_t bucket_counts(const float *values, int n, int32_t *table, int buckets, int coarse) {
    int j = 0;
    for (int b = 0; b < buckets; ++b) {
        while (j < n && (coarse ? coarse_bucket(values[j]) : bucket(values[j])) < b) ++j;
        table[b] = j;
    }
    int32_t most = 1;
    for (int b = 0; b < buckets; ++b) {
        int32_t next = b + 1 < buckets ? table[b + 1] : n;
        if (next - table[b] > most) most = next - table[b];
    }
    return most;
}

/* Byte k of every value, plane after plane. */
static void byte_planes(const float *values, int n, uint8_t planes[4][CODEBOOK_SIZE]) {
    memset(planes, 0, 4 * CODEBOOK_SIZE);
    for (int j = 0; j < n; ++j) {
        uint32_t bits;
        memcpy(&bits, &values[j], sizeof bits);
        for (int k = 0; k < 4; ++k) planes[k][j] = (uint8_t)(bits >> (8 * k));
    }
}

/* The encode tables of a strictly increasing codebook in [-1, 1] (see gefen_tables). T_j is
 * found by bisection on the fp32 values in [cb[j], cb[j+1]): §6.3 picks j over j+1 iff
 * |x - cb[j]| <= |x - cb[j+1]| in fp32, which holds at cb[j] and, as x grows, only turns from
 * true to false (the two rounded distances are monotone), so the rule is one threshold. */
int gefen_build_tables(const float *cb, int32_t size, gefen_tables *t) {
    if (size < 2 || size > CODEBOOK_SIZE) return 2;
    memset(t, 0, sizeof *t);
    for (int j = 0; j + 1 < size; ++j) {
        if (!(cb[j] < cb[j + 1])) return 1;
        uint32_t low = float_order(cb[j]), high = float_order(cb[j + 1]);
        while (high - low > 1) {
            uint32_t middle = low + (high - low) / 2;
            float x = order_float(middle);
            if (fabsf(x - cb[j]) <= fabsf(x - cb[j + 1])) low = middle;
            else high = middle;
        }
        t->threshold[j] = order_float(low);
    }
    /* T_j = +inf from j = size - 1 on: no count (the SIMD scan's included) passes size - 1 */
    for (int j = size - 1; j < CODEBOOK_SIZE; ++j) t->threshold[j] = INFINITY;
    t->window = bucket_counts(cb, size, t->count, TABLE_BUCKETS, 0);
    t->threshold_window = bucket_counts(t->threshold, size - 1, t->threshold_count,
                                        TABLE_BUCKETS, 0);
    int32_t coarse[COARSE_BUCKETS];
    t->coarse_window = bucket_counts(t->threshold, size - 1, coarse, COARSE_BUCKETS, 1);
    for (int b = 0; b < COARSE_BUCKETS; ++b) t->coarse[b] = (uint8_t)coarse[b]; /* <= 255 */
    t->size = size;
    byte_planes(cb, size, t->codebook_planes);
    byte_planes(t->threshold, CODEBOOK_SIZE, t->threshold_planes);
    return 0;
}

/* sizeof(gefen_tables), for the caller's buffer. */
int64_t gefen_tables_size(void) { return (int64_t)sizeof(gefen_tables); }
