/* The crc32c fold of shardpoint._native over one width of VPCLMULQDQ register, and the
 * copy that rides on it. _native.c includes this file once per width; see there for what
 * must be defined first. It defines, for BITS = FOLD_BITS:
 *
 *   crc_vpclmul<BITS>(reg, p, n)           the crc register over n >= 4 registers of bytes
 *   copy_crc_stream<BITS>(reg, d, p, n)    the same, also copying p to d with
 *                                          non-temporal stores: n a multiple of four
 *                                          registers, d aligned to one, the caller fences
 *
 * Four accumulators are folded four registers ahead, then into one, then one register at
 * a time; finish<BITS> takes the rest. In the copy the destination's lines are never read
 * for ownership, so a copy with its crc moves less memory than a plain copy. */

#define FOLD_JOIN_(a, b, c, d) a##b##c##d
#define FOLD_JOIN(a, b, c, d) FOLD_JOIN_(a, b, c, d)
#define FOLD_V FOLD_JOIN(__m, FOLD_BITS, i, )                        /* __m512i */
#define FOLD_OP(op) FOLD_JOIN(_mm, FOLD_BITS, _##op##_si, FOLD_BITS) /* _mm512_xor_si512 */
#define FOLD_CLMUL FOLD_JOIN(_mm, FOLD_BITS, _clmulepi64_epi128, )
#define FOLD_NAME(f) FOLD_JOIN(f, FOLD_BITS, , )                     /* crc_vpclmul512 */
#define FOLD_LOAD(p) FOLD_OP(loadu)((const FOLD_V *)(p))
#define FOLD_LANE (FOLD_BITS / 8)
#define FOLD_BLOCK (4 * FOLD_LANE)

__attribute__((target(FOLD_TARGET))) static inline FOLD_V
FOLD_NAME(fold)(FOLD_V v, FOLD_V k)
{
    return FOLD_OP(xor)(FOLD_CLMUL(v, k, 0x00), FOLD_CLMUL(v, k, 0x11));
}

__attribute__((target(FOLD_TARGET), always_inline)) static inline void
FOLD_NAME(stream)(uint8_t *d, FOLD_V a, FOLD_V b, FOLD_V c, FOLD_V e)
{
    FOLD_OP(stream)((FOLD_V *)d, a);
    FOLD_OP(stream)((FOLD_V *)(d + FOLD_LANE), b);
    FOLD_OP(stream)((FOLD_V *)(d + 2 * FOLD_LANE), c);
    FOLD_OP(stream)((FOLD_V *)(d + 3 * FOLD_LANE), e);
}

/* Inlined into its two callers below, where d is a constant, so neither loop tests it. */
__attribute__((target(FOLD_TARGET), always_inline)) static inline uint32_t
FOLD_NAME(fold_vpclmul)(uint32_t reg, uint8_t *d, const uint8_t *p, size_t n)
{
    FOLD_V x0 = FOLD_LOAD(p), x1 = FOLD_LOAD(p + FOLD_LANE);
    FOLD_V x2 = FOLD_LOAD(p + 2 * FOLD_LANE), x3 = FOLD_LOAD(p + 3 * FOLD_LANE);
    if (d) {
        FOLD_NAME(stream)(d, x0, x1, x2, x3);
        d += FOLD_BLOCK;
    }
    x0 = FOLD_OP(xor)(x0, FOLD_OP(zextsi128)(_mm_cvtsi32_si128((int)reg)));
    p += FOLD_BLOCK;
    n -= FOLD_BLOCK;
    FOLD_V k_block = FOLD_NAME(broadcast)(FOLD_K_BLOCK), k_lane = FOLD_NAME(broadcast)(FOLD_K_LANE);
    while (n >= FOLD_BLOCK) {
        FOLD_V y0 = FOLD_LOAD(p), y1 = FOLD_LOAD(p + FOLD_LANE);
        FOLD_V y2 = FOLD_LOAD(p + 2 * FOLD_LANE), y3 = FOLD_LOAD(p + 3 * FOLD_LANE);
        if (d) {
            FOLD_NAME(stream)(d, y0, y1, y2, y3);
            d += FOLD_BLOCK;
        }
        x0 = FOLD_OP(xor)(FOLD_NAME(fold)(x0, k_block), y0);
        x1 = FOLD_OP(xor)(FOLD_NAME(fold)(x1, k_block), y1);
        x2 = FOLD_OP(xor)(FOLD_NAME(fold)(x2, k_block), y2);
        x3 = FOLD_OP(xor)(FOLD_NAME(fold)(x3, k_block), y3);
        p += FOLD_BLOCK;
        n -= FOLD_BLOCK;
    }
    x0 = FOLD_OP(xor)(FOLD_NAME(fold)(x0, k_lane), x1);
    x0 = FOLD_OP(xor)(FOLD_NAME(fold)(x0, k_lane), x2);
    x0 = FOLD_OP(xor)(FOLD_NAME(fold)(x0, k_lane), x3);
    while (n >= FOLD_LANE) {
        x0 = FOLD_OP(xor)(FOLD_NAME(fold)(x0, k_lane), FOLD_LOAD(p));
        p += FOLD_LANE;
        n -= FOLD_LANE;
    }
    return FOLD_NAME(finish)(x0, p, n);
}

__attribute__((target(FOLD_TARGET))) static uint32_t
FOLD_NAME(crc_vpclmul)(uint32_t reg, const uint8_t *p, size_t n)
{
    return FOLD_NAME(fold_vpclmul)(reg, NULL, p, n);
}

__attribute__((target(FOLD_TARGET))) static uint32_t
FOLD_NAME(copy_crc_stream)(uint32_t reg, uint8_t *d, const uint8_t *p, size_t n)
{
    return FOLD_NAME(fold_vpclmul)(reg, d, p, n);
}

#undef FOLD_JOIN_
#undef FOLD_JOIN
#undef FOLD_V
#undef FOLD_OP
#undef FOLD_CLMUL
#undef FOLD_NAME
#undef FOLD_LOAD
#undef FOLD_LANE
#undef FOLD_BLOCK
#undef FOLD_BITS
#undef FOLD_TARGET
#undef FOLD_K_BLOCK
#undef FOLD_K_LANE
