/* The native finiteness check of gefen.core.validation (docs/core.md §7.2), included by
 * gefen_update.c: plain C, no state of its own. */

/* §7.2's finiteness check over ``count`` contiguous tensors (dtype: 0 fp32, 1 bf16, 2 fp16,
 * 3 fp64): the position of the first one holding a NaN or ±Inf, or -1. An all-ones exponent
 * is exactly NaN/±Inf; the OR-reduction vectorises and reads each tensor once. */
int64_t gefen_first_nonfinite(const void *const *data, const int64_t *numel,
                              const int32_t *dtype, int64_t count) {
    for (int64_t t = 0; t < count; ++t) {
        int64_t n = numel[t];
        unsigned bad = 0;
        if (dtype[t] == 0 || dtype[t] == 3) {
            const uint32_t *restrict v = (const uint32_t *)data[t];
            uint32_t mask = dtype[t] == 0 ? 0x7F800000u : 0x7FF00000u;
            int64_t step = dtype[t] == 0 ? 1 : 2, first = dtype[t] == 0 ? 0 : 1; /* fp64: high word */
            if (step == 1)
                for (int64_t i = 0; i < n; ++i) bad |= (v[i] & mask) == mask;
            else
                for (int64_t i = 0; i < n; ++i) bad |= (v[2 * i + first] & mask) == mask;
        } else {
            const uint16_t *restrict v = (const uint16_t *)data[t];
            uint16_t mask = dtype[t] == 1 ? 0x7F80u : 0x7C00u;
            for (int64_t i = 0; i < n; ++i) bad |= (uint16_t)(v[i] & mask) == mask;
        }
        if (bad) return t;
    }
    return -1;
}
