/* GefenMuon's codebook momentum update (codebook8, or codebook4's packed codes) (docs/muon.md), included by gefen_update.c: the block
 * passes of the Gefen update without its second moment and parameter write. */

/* GefenMuon's step 1 for codebook8 momentum: ``lerp(decode, g, weight)`` re-encoded into
 * ``codes``/``scale`` in place; ``out`` (fp32, contiguous) receives the decoded stored momentum.
 * ``s`` supplies ``one_minus_beta1`` (the weight), ``stochastic``, ``stream`` and ``threads``. */
int gefen_momentum_codebook8(const void *grad, int32_t dtype, uint8_t *codes, float *scale,
                             float *out, int64_t blocks, int64_t period, const float *codebook,
                             const gefen_tables *tables, const gefen_scalars *s) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    int failed = 0;
    int64_t sub = period < SCRATCH ? period : SCRATCH;
    int packed = tables->size <= PACKED_CODEBOOK_SIZE;
#pragma omp parallel num_threads(s->threads) if (s->threads > 1 && blocks > 1)
    {
        scratch w;
        if (!scratch_init(&w, sub)) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; ++b) {
                int64_t first = b * period;
                uint8_t *block_codes = codes + b * code_bytes(period, packed);
                float old_scale = scale[b];
                float maximum = block_maximum(grad, dtype, first, period, sub, block_codes,
                                              old_scale, codebook, s->one_minus_beta1, w.advanced,
                                              tables, s->portable, w.bytes);
                scale[b] = maximum;
                for (int64_t o = 0; o < period; o += sub) {
                    int64_t len = period - o < sub ? period - o : sub;
                    uint8_t *sub_codes = block_codes + code_bytes(o, packed);
                    if (period > sub)
                        advance_any(grad, dtype, first + o, len, sub_codes, old_scale, codebook,
                                    s->one_minus_beta1, w.advanced, tables, s->portable,
                                    w.bytes);
#if GEFEN_AVX512
                    if (!s->stochastic && s->portable == 0 &&
                        tables->coarse_window <= SIMD_MAX_WINDOW) {
                        momentum_nearest_simd(w.advanced, maximum, len, tables,
                                              packed ? w.bytes : sub_codes, out + first + o);
                        if (packed) pack_codes(w.bytes, len, sub_codes);
                        continue;
                    }
#endif
                    encode_block(w.advanced, maximum, len, codebook, tables, s, first + o, &w,
                                 sub_codes);
                    float *restrict target = out + first + o;
                    for (int64_t j = 0; j < len; ++j) target[j] = w.advanced[j] * maximum;
                }
            }
        }
        scratch_free(&w);
    }
    return failed ? 2 : 0;
}
