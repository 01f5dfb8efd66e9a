/*
 * _ghash.h: AES-256-GMAC of a header and a payload, copying the payload as it hashes (included by
 * _xxcopy.c, which holds the Python functions: gmac, seal_gmac, gmac_mode).
 *
 * A keyed load is a copy plus a MAC of the same bytes. With `cryptography` the MAC is a second
 * pass (OpenSSL's GHASH over the copied bytes) and a handful of Python calls per value; here the
 * payload is read once: each 64-byte line is loaded into a register, stored to the destination
 * and folded into GHASH, so the MAC rides on the copy's memory traffic (the twin of _xxcopy's
 * copy + XXH3 for unkeyed loads).
 *
 * The value is GCM's tag (NIST SP 800-38D) under the 32-byte key with a 12-byte zero nonce, the
 * header followed by the payload as associated data and nothing encrypted: bit for bit what
 * `cryptography`'s AES-GCM encryptor gives for the same key and bytes (the tests compare them
 * over many lengths, keys and header sizes), so values stay readable by every reader.
 *
 *   H = AES_K(0^128), J0 = nonce || 0^31 || 1, tag = GHASH_H(A || pad || len(A) || len(C)=0) ^ AES_K(J0)
 *
 * GHASH is computed on byte-reflected blocks with carry-less multiplication (Gueron and Kounavis,
 * "Intel Carry-Less Multiplication Instruction and its Usage for Computing the GCM Mode", 2014:
 * the 256-bit product, shifted left by one bit and reduced modulo x^128 + x^7 + x^2 + x + 1).
 * Blocks are aggregated: X' = (X ^ B1) H^n ^ B2 H^(n-1) ^ ... ^ Bn H, with one reduction per n
 * blocks (the shift and the reduction are linear, so unreduced products add up):
 *   mode 2: n = 32 (512 bytes), four blocks per VPCLMULQDQ on 512-bit registers (AVX-512);
 *   mode 1: n = 8, PCLMULQDQ on 128-bit registers (any x86-64 with AES-NI and PCLMULQDQ).
 * `gmac_mode()` says the best this CPU runs (0: neither: the caller uses `cryptography`). Both release
 * the GIL. The key schedule (AES-NI) and the powers of H are computed per call: a value has its
 * own key (integrity.py), and they cost well under a microsecond.
 */
#ifndef KV_GHASH_H
#define KV_GHASH_H
#include <stdint.h>
#include <string.h>

#if KV_X86
#define T_BASE __attribute__((target("aes,pclmul,ssse3,sse4.1")))
#define T_WIDE __attribute__((target("aes,pclmul,ssse3,sse4.1,avx2,avx512f,avx512bw,avx512vl,vpclmulqdq")))
#define PREFETCH_DIST 1024

T_BASE static inline __m128i bswap128(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* Accumulate the carry-less product a*b (256 bits) as its low, middle and high parts. */
T_BASE static inline void mul_acc(__m128i a, __m128i b, __m128i *lo, __m128i *mid, __m128i *hi) {
    *lo = _mm_xor_si128(*lo, _mm_clmulepi64_si128(a, b, 0x00));
    *hi = _mm_xor_si128(*hi, _mm_clmulepi64_si128(a, b, 0x11));
    *mid = _mm_xor_si128(*mid, _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10)));
}

/* The product [hi:lo] of two reflected elements, shifted left by one bit and reduced modulo the
 * GCM polynomial: the reflected element of GF(2^128). */
T_BASE static inline __m128i reduce(__m128i lo, __m128i hi) {
    __m128i t7 = _mm_srli_epi32(lo, 31), t8 = _mm_srli_epi32(hi, 31);
    lo = _mm_slli_epi32(lo, 1);
    hi = _mm_slli_epi32(hi, 1);
    __m128i t9 = _mm_srli_si128(t7, 12);
    t8 = _mm_slli_si128(t8, 4);
    t7 = _mm_slli_si128(t7, 4);
    lo = _mm_or_si128(lo, t7);
    hi = _mm_or_si128(_mm_or_si128(hi, t8), t9);
    t7 = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)), _mm_slli_epi32(lo, 25));
    t8 = _mm_srli_si128(t7, 4);
    lo = _mm_xor_si128(lo, _mm_slli_si128(t7, 12));
    __m128i t2 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)), _mm_srli_epi32(lo, 7));
    lo = _mm_xor_si128(lo, _mm_xor_si128(t2, t8));
    return _mm_xor_si128(hi, lo);
}

T_BASE static inline __m128i fold_reduce(__m128i lo, __m128i mid, __m128i hi) {
    return reduce(_mm_xor_si128(lo, _mm_slli_si128(mid, 8)), _mm_xor_si128(hi, _mm_srli_si128(mid, 8)));
}

T_BASE static inline __m128i gfmul(__m128i a, __m128i b) {
    __m128i lo = _mm_setzero_si128(), mid = lo, hi = lo;
    mul_acc(a, b, &lo, &mid, &hi);
    return fold_reduce(lo, mid, hi);
}

/* ---- AES-256 (AES-NI): the key schedule and one block ---------------------------------- */
T_BASE static inline __m128i expand_a(__m128i k, __m128i assist) {
    assist = _mm_shuffle_epi32(assist, 0xff);
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    return _mm_xor_si128(k, assist);
}

T_BASE static inline __m128i expand_b(__m128i k, __m128i prev) {
    __m128i assist = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(prev, 0x00), 0xaa);
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    return _mm_xor_si128(k, assist);
}

#define EXPAND_STEP(i, rcon)                                                     \
    ks[i] = expand_a(ks[i - 2], _mm_aeskeygenassist_si128(ks[i - 1], rcon));     \
    if (i + 1 < 15) ks[i + 1] = expand_b(ks[i - 1], ks[i]);

T_BASE static void expand256(const uint8_t *key, __m128i ks[15]) {
    ks[0] = _mm_loadu_si128((const __m128i *)key);
    ks[1] = _mm_loadu_si128((const __m128i *)(key + 16));
    EXPAND_STEP(2, 0x01)
    EXPAND_STEP(4, 0x02)
    EXPAND_STEP(6, 0x04)
    EXPAND_STEP(8, 0x08)
    EXPAND_STEP(10, 0x10)
    EXPAND_STEP(12, 0x20)
    EXPAND_STEP(14, 0x40)
}

T_BASE static __m128i aes256(const __m128i ks[15], __m128i x) {
    x = _mm_xor_si128(x, ks[0]);
    for (int r = 1; r < 14; r++) x = _mm_aesenc_si128(x, ks[r]);
    return _mm_aesenclast_si128(x, ks[14]);
}

/* ---- GHASH over whole blocks, copying them to dst (when not NULL) ---------------------- */
/* hp[i] = H^i, i = 1..8 at least. */
T_BASE static __m128i ghash_x8(__m128i X, const uint8_t *src, uint8_t *dst, size_t nb, const __m128i *hp) {
    size_t i = 0;
    for (; i + 8 <= nb; i += 8) {
        __m128i lo = _mm_setzero_si128(), mid = lo, hi = lo;
        __builtin_prefetch(src + 16 * i + PREFETCH_DIST);
        __builtin_prefetch(src + 16 * i + PREFETCH_DIST + 64);
        for (int j = 0; j < 8; j++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(src + 16 * (i + j)));
            if (dst) _mm_storeu_si128((__m128i *)(dst + 16 * (i + j)), raw);
            __m128i b = bswap128(raw);
            if (j == 0) b = _mm_xor_si128(b, X);
            mul_acc(b, hp[8 - j], &lo, &mid, &hi);
        }
        X = fold_reduce(lo, mid, hi);
    }
    for (; i < nb; i++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(src + 16 * i));
        if (dst) _mm_storeu_si128((__m128i *)(dst + 16 * i), raw);
        X = gfmul(_mm_xor_si128(X, bswap128(raw)), hp[1]);
    }
    return X;
}

T_WIDE static inline __m128i xor_lanes(__m512i z) {
    __m256i a = _mm256_xor_si256(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}

/* 32 blocks a step; hp[i] = H^i, i = 1..32. Leaves the last nb % 32 blocks (*done says where). */
T_WIDE static __m128i ghash_z32(__m128i X, const uint8_t *src, uint8_t *dst, size_t nb, const __m128i *hp,
                                size_t *done) {
    __m128i pw[32]; /* block k of a step is multiplied by H^(32 - k) */
    for (int k = 0; k < 32; k++) pw[k] = hp[32 - k];
    __m512i P[8];
    for (int j = 0; j < 8; j++) P[j] = _mm512_loadu_si512((const void *)&pw[4 * j]);
    const __m512i mask = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    size_t i = 0;
    for (; i + 32 <= nb; i += 32) {
        __m512i lo = _mm512_setzero_si512(), mid = lo, hi = lo;
        const uint8_t *s = src + 16 * i;
        for (int j = 0; j < 8; j++) {
            __builtin_prefetch(s + 64 * j + PREFETCH_DIST);
            __m512i raw = _mm512_loadu_si512((const void *)(s + 64 * j));
            if (dst) _mm512_storeu_si512((void *)(dst + 16 * i + 64 * j), raw);
            __m512i b = _mm512_shuffle_epi8(raw, mask);
            lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(b, P[j], 0x00));
            hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(b, P[j], 0x11));
            mid = _mm512_xor_si512(mid, _mm512_xor_si512(_mm512_clmulepi64_epi128(b, P[j], 0x01),
                                                         _mm512_clmulepi64_epi128(b, P[j], 0x10)));
        }
        /* X H^32 apart from the blocks' products: only it waits for the previous step */
        __m128i xl = _mm_setzero_si128(), xm = xl, xh = xl;
        mul_acc(X, hp[32], &xl, &xm, &xh);
        lo = _mm512_xor_si512(lo, _mm512_bslli_epi128(mid, 8));
        hi = _mm512_xor_si512(hi, _mm512_bsrli_epi128(mid, 8));
        X = reduce(_mm_xor_si128(xor_lanes(lo), _mm_xor_si128(xl, _mm_slli_si128(xm, 8))),
                   _mm_xor_si128(xor_lanes(hi), _mm_xor_si128(xh, _mm_srli_si128(xm, 8))));
    }
    *done = i;
    return X;
}

/* GHASH state X after the block blk (16 bytes, zero-padded by the caller). */
T_BASE static inline __m128i hash_block(__m128i X, const uint8_t *blk, __m128i h) {
    return gfmul(_mm_xor_si128(X, bswap128(_mm_loadu_si128((const __m128i *)blk))), h);
}

/* A value's GMAC key: the powers of H it hashes with and the mask of its tag. */
typedef struct {
    __m128i hp[33]; /* hp[i] = H^i, i = 1..8 (mode 1) or 1..32 (mode 2) */
    __m128i ekj0;   /* AES_K(J0) */
    int mode;
} ghash_key;

T_BASE static void ghash_setup(ghash_key *g, const uint8_t *key, int mode) {
    __m128i ks[15];
    expand256(key, ks);
    static const uint8_t j0[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    g->ekj0 = aes256(ks, _mm_loadu_si128((const __m128i *)j0));
    g->hp[1] = bswap128(aes256(ks, _mm_setzero_si128()));
    g->mode = mode;
    int powers = mode == 2 ? 32 : 8;
    for (int i = 2; i <= powers; i++) g->hp[i] = gfmul(g->hp[i - 1], g->hp[1]);
}

/* GHASH state X after nb more whole blocks of src, copied to dst when not NULL. */
T_BASE static __m128i ghash_span(const ghash_key *g, __m128i X, const uint8_t *src, uint8_t *dst, size_t nb) {
    size_t done = 0;
    if (g->mode == 2) X = ghash_z32(X, src, dst, nb, g->hp, &done);
    return ghash_x8(X, src + 16 * done, dst ? dst + 16 * done : NULL, nb - done, g->hp);
}

/* GHASH state X after one last partial block of n < 16 bytes (zero-padded), copied to dst (when
 * not NULL) from the bytes hashed: each source byte is read once, so a source that changes
 * under the call (a shared mapping) never puts into dst a byte the tag did not cover. */
T_BASE static __m128i ghash_partial(const ghash_key *g, __m128i X, const uint8_t *src, uint8_t *dst, size_t n) {
    uint8_t blk[16] = {0};
    memcpy(blk, src, n);
    if (dst) memcpy(dst, blk, n);
    return hash_block(X, blk, g->hp[1]);
}

/* H^e for e >= 1 (square and multiply). */
T_BASE static __m128i ghash_pow(const ghash_key *g, size_t e) {
    int top = 63 - __builtin_clzll((unsigned long long)e);
    __m128i r = g->hp[1];
    for (int bit = top - 1; bit >= 0; bit--) {
        r = gfmul(r, r);
        if ((e >> bit) & 1) r = gfmul(r, g->hp[1]);
    }
    return r;
}

/* The tag from the state after every associated byte (aad_len of them; nothing encrypted). */
T_BASE static void ghash_tag(const ghash_key *g, __m128i X, uint64_t aad_len, uint8_t *tag) {
    uint8_t lens[16] = {0};
    uint64_t bits = aad_len * 8; /* len(A) in bits, big-endian; len(C) = 0 */
    for (int i = 0; i < 8; i++) lens[i] = (uint8_t)(bits >> (56 - 8 * i));
    X = gfmul(_mm_xor_si128(X, bswap128(_mm_loadu_si128((const __m128i *)lens))), g->hp[1]);
    _mm_storeu_si128((__m128i *)tag, _mm_xor_si128(bswap128(X), g->ekj0));
}

/* The GMAC tag of head || src under key, copying src to dst (when not NULL; dst and src must
 * not overlap). Every source byte is loaded once and both stored and hashed from that load. */
T_BASE static void gmac_run(const uint8_t *key, const uint8_t *head, size_t hlen, const uint8_t *src, uint8_t *dst,
                            size_t n, int mode, uint8_t *tag) {
    ghash_key g;
    ghash_setup(&g, key, mode);
    __m128i X = ghash_span(&g, _mm_setzero_si128(), head, NULL, hlen / 16);
    size_t rem = hlen % 16, lead = 0;
    if (rem) { /* the header's last bytes and the payload's first ones share a block */
        uint8_t blk[16] = {0};
        lead = 16 - rem < n ? 16 - rem : n;
        memcpy(blk, head + hlen - rem, rem);
        memcpy(blk + rem, src, lead);
        if (dst) memcpy(dst, blk + rem, lead); /* from the bytes hashed (ghash_partial) */
        X = hash_block(X, blk, g.hp[1]);
    }
    const uint8_t *s = src + lead;
    uint8_t *d = dst ? dst + lead : NULL;
    size_t nb = (n - lead) / 16, tail = n - lead - 16 * nb;
    X = ghash_span(&g, X, s, d, nb);
    if (tail) X = ghash_partial(&g, X, s + 16 * nb, d ? d + 16 * nb : NULL, tail);
    ghash_tag(&g, X, (uint64_t)(hlen + n), tag);
}

static int gmac_mode(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        if (!(__builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul") &&
              __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("sse4.1")))
            cached = 0;
        else if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
                 __builtin_cpu_supports("avx2"))
            cached = 2;
        else
            cached = 1;
    }
    return cached;
}
#else
static int gmac_mode(void) { return 0; }
#endif /* KV_X86 */

#endif /* KV_GHASH_H */
