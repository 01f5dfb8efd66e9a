/*
 * kvtier.store._xxcopy: copy a payload and compute its XXH3-64 checksum in one pass; and (with
 * _ghash.h) its AES-256-GMAC, alone, fused with a copy, or fused with the XXH3-64 that seals it.
 *
 * A verified load is a copy plus a checksum of the same bytes. Done as two passes (the kernel's
 * copy, then python-xxhash), the checksum reads every byte a second time; here each 64-byte
 * stripe is loaded once into registers, stored to the destination and folded into the XXH3
 * accumulators, so the checksum rides on the copy's memory traffic.
 *
 * The value is XXH3_64bits(src) with seed 0 and the default secret, bit for bit what
 * python-xxhash's xxh3_64_intdigest returns (the tests compare them over many lengths), so
 * slots stay readable by every reader. Only the long-input path (len > 240) lives here; the
 * Python side hashes shorter payloads with python-xxhash. Written from the XXH3 specification
 * (xxHash's doc/xxhash_spec.md); the secret below is the specification's default secret.
 *
 * AVX2 is used when the CPU has it (checked at run time); otherwise the portable scalar code.
 * Both release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif
#include "_ghash.h" /* AES-256-GMAC: gmac_run, the GHASH kernels (keyed payloads) */

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8) /* 16 */
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)            /* 1024 */
#ifndef PREFETCH_DIST
#define PREFETCH_DIST 1024 /* bytes ahead: +20% on payloads not in cache (measured 0..4096) */
#endif

static const uint8_t k_secret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* ---- portable scalar path ------------------------------------------------------------- */
static inline void stripe_scalar(uint64_t *acc, const uint8_t *in, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(in + 8 * i);
        uint64_t k = v ^ rd64(key + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static inline void scramble_scalar(uint64_t *acc, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(key + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* Accumulate (and copy, when dst != NULL) the full blocks [b0, b1) of the input; dst points at
 * block b0's destination. */
static void blocks_scalar(uint64_t *acc, uint8_t *dst, const uint8_t *src, size_t b0, size_t b1) {
    for (size_t b = b0; b < b1; b++) {
        const uint8_t *in = src + b * BLOCK;
        if (dst) memcpy(dst + (b - b0) * BLOCK, in, BLOCK);
        for (int s = 0; s < STRIPES_PER_BLOCK; s++) stripe_scalar(acc, in + s * STRIPE, k_secret + 8 * s);
        scramble_scalar(acc, k_secret + SECRET_SIZE - STRIPE);
    }
}

/* The stripes of the last (partial) block starting at `start`, copying [start, len) to dst. */
static void tail_scalar(uint64_t *acc, uint8_t *dst, const uint8_t *src, size_t start, size_t len) {
    size_t nb_stripes = (len - 1 - start) / STRIPE;
    for (size_t s = 0; s < nb_stripes; s++) stripe_scalar(acc, src + start + s * STRIPE, k_secret + 8 * s);
    if (dst) memcpy(dst, src + start, len - start);
}

#if KV_X86
/* ---- AVX2 path: one load per 32 bytes feeds both the store and the accumulators -------- */
__attribute__((target("avx2"))) static inline void stripe_avx2(__m256i *acc, uint8_t *dst, const uint8_t *in,
                                                              const uint8_t *key) {
    for (int i = 0; i < 2; i++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + 32 * i));
        if (dst) _mm256_storeu_si256((__m256i *)(dst + 32 * i), v);
        __m256i k = _mm256_xor_si256(v, _mm256_loadu_si256((const __m256i *)(key + 32 * i)));
        __m256i k_hi = _mm256_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i prod = _mm256_mul_epu32(k, k_hi);               /* lo32(k) * hi32(k) per lane */
        __m256i swapped = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)); /* acc[i^1] += v[i] */
        acc[i] = _mm256_add_epi64(prod, _mm256_add_epi64(acc[i], swapped));
    }
}

__attribute__((target("avx2"))) static inline void scramble_avx2(__m256i *acc, const uint8_t *key) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = acc[i];
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(key + 32 * i)));
        __m256i a_hi = _mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i lo = _mm256_mul_epu32(a, prime);
        __m256i hi = _mm256_mul_epu32(a_hi, prime);
        acc[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
}

__attribute__((target("avx2"))) static void blocks_avx2(uint64_t *acc64, uint8_t *dst, const uint8_t *src,
                                                       size_t b0, size_t b1) {
    __m256i acc[2];
    acc[0] = _mm256_loadu_si256((const __m256i *)acc64);
    acc[1] = _mm256_loadu_si256((const __m256i *)(acc64 + 4));
    for (size_t b = b0; b < b1; b++) {
        const uint8_t *in = src + b * BLOCK;
        uint8_t *out = dst ? dst + (b - b0) * BLOCK : NULL;
        for (int s = 0; s < STRIPES_PER_BLOCK; s++) {
            __builtin_prefetch(in + s * STRIPE + PREFETCH_DIST);
            stripe_avx2(acc, out ? out + s * STRIPE : NULL, in + s * STRIPE, k_secret + 8 * s);
        }
        scramble_avx2(acc, k_secret + SECRET_SIZE - STRIPE);
    }
    _mm256_storeu_si256((__m256i *)acc64, acc[0]);
    _mm256_storeu_si256((__m256i *)(acc64 + 4), acc[1]);
}

__attribute__((target("avx2"))) static void tail_avx2(uint64_t *acc64, uint8_t *dst, const uint8_t *src,
                                                     size_t start, size_t len) {
    __m256i acc[2];
    acc[0] = _mm256_loadu_si256((const __m256i *)acc64);
    acc[1] = _mm256_loadu_si256((const __m256i *)(acc64 + 4));
    size_t nb_stripes = (len - 1 - start) / STRIPE;
    for (size_t s = 0; s < nb_stripes; s++)
        stripe_avx2(acc, dst ? dst + s * STRIPE : NULL, src + start + s * STRIPE, k_secret + 8 * s);
    size_t done = nb_stripes * STRIPE;
    if (dst) memcpy(dst + done, src + start + done, len - start - done);
    _mm256_storeu_si256((__m256i *)acc64, acc[0]);
    _mm256_storeu_si256((__m256i *)(acc64 + 4), acc[1]);
}

static int have_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cached;
}
#else
static int have_avx2(void) { return 0; }
#endif

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

static const uint64_t k_init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};

/* The input's bytes [start, end) (start a multiple of BLOCK; end a multiple of BLOCK or len)
 * folded into acc, copied to dst (the destination of byte `start`) when dst is not NULL. When
 * end == len, returns 1 and the hash in *out: XXH3_64bits of the whole input (len > 240). */
static int xxh3_range(uint64_t *acc, uint8_t *dst, const uint8_t *src, size_t len, size_t start, size_t end,
                      int simd, uint64_t *out) {
    size_t nb_blocks = (len - 1) / BLOCK;
    size_t b0 = start / BLOCK, b1 = end == len ? nb_blocks : end / BLOCK;
    if (b1 > nb_blocks) b1 = nb_blocks;
#if KV_X86
    if (simd)
        blocks_avx2(acc, dst, src, b0, b1);
    else
#endif
        blocks_scalar(acc, dst, src, b0, b1);
    if (end != len) return 0;
    size_t tail = nb_blocks * BLOCK;
    uint8_t *tdst = dst ? dst + (tail - start) : NULL;
#if KV_X86
    if (simd)
        tail_avx2(acc, tdst, src, tail, len);
    else
#endif
        tail_scalar(acc, tdst, src, tail, len);
    (void)simd;
    stripe_scalar(acc, src + len - STRIPE, k_secret + SECRET_SIZE - STRIPE - 7); /* last stripe */
    uint64_t h = (uint64_t)len * P64_1;
    const uint8_t *key = k_secret + 11;
    for (int i = 0; i < 4; i++) h += fold128(acc[2 * i] ^ rd64(key + 16 * i), acc[2 * i + 1] ^ rd64(key + 16 * i + 8));
    *out = avalanche(h);
    return 1;
}

/* XXH3_64bits(src, len) for len > 240, copying src to dst (if not NULL) on the way. */
static uint64_t xxh3_long(uint8_t *dst, const uint8_t *src, size_t len, int simd) {
    uint64_t acc[8], h = 0;
    memcpy(acc, k_init, sizeof acc);
    xxh3_range(acc, dst, src, len, 0, len, simd, &h);
    return h;
}

static int simd_wanted(PyObject *arg) {
    if (arg == NULL || arg == Py_None) return have_avx2();
    int want = PyObject_IsTrue(arg);
    if (want < 0) return -1;
    return want && have_avx2();
}

static PyObject *py_copy_xxh3(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"dst", "src", "simd", NULL};
    Py_buffer dst, src;
    PyObject *simd_arg = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "w*y*|O", names, &dst, &src, &simd_arg)) return NULL;
    int simd = simd_wanted(simd_arg);
    if (simd < 0 || dst.len != src.len || src.len <= 240) {
        if (simd >= 0)
            PyErr_Format(PyExc_ValueError, "copy_xxh3 needs equal lengths above 240 bytes (dst %zd, src %zd)",
                         dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = xxh3_long((uint8_t *)dst.buf, (const uint8_t *)src.buf, (size_t)src.len, simd);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_xxh3(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"src", "simd", NULL};
    Py_buffer src;
    PyObject *simd_arg = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|O", names, &src, &simd_arg)) return NULL;
    int simd = simd_wanted(simd_arg);
    if (simd < 0 || src.len <= 240) {
        if (simd >= 0) PyErr_Format(PyExc_ValueError, "xxh3 here hashes more than 240 bytes (got %zd)", src.len);
        PyBuffer_Release(&src);
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = xxh3_long(NULL, (const uint8_t *)src.buf, (size_t)src.len, simd);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(h);
}

/* pwrite_xxh3(fd, src, offset, piece) -> int: write all of src at `offset` of fd, `piece`
 * bytes (a multiple of 1024) per pwrite, folding each piece into XXH3-64 right after the kernel
 * copied it (still in cache); returns XXH3-64 of src. Raises OSError on a failed or empty write
 * (what was written so far stays written: the caller never publishes a header over it). */
static PyObject *py_pwrite_xxh3(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer src;
    long long offset;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "iy*Ln", &fd, &src, &offset, &piece)) return NULL;
    if (src.len <= 240 || piece < BLOCK || piece % BLOCK || offset < 0) {
        PyErr_Format(PyExc_ValueError, "pwrite_xxh3 needs more than 240 bytes (got %zd) and a piece that is a "
                     "positive multiple of %d (got %zd)", src.len, BLOCK, piece);
        PyBuffer_Release(&src);
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)src.buf;
    size_t len = (size_t)src.len, done = 0;
    uint64_t acc[8], h = 0;
    memcpy(acc, k_init, sizeof acc);
    int simd = have_avx2(), err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (done < len) {
        size_t end = done + (size_t)piece < len ? done + (size_t)piece : len;
        size_t at = done;
        while (at < end) { /* short writes and EINTR: go on from where it stopped */
            ssize_t w = pwrite(fd, p + at, end - at, (off_t)(offset + (long long)at));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) { err = w < 0 ? errno : EIO; break; }
            at += (size_t)w;
        }
        if (err) break;
        xxh3_range(acc, NULL, p, len, done, end, simd, &h);
        done = end;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_gmac(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"key", "head", "src", "dst", "mode", NULL};
    Py_buffer key, head, src, dst = {0};
    PyObject *dst_arg = Py_None;
    int mode = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*y*|Oi", names, &key, &head, &src, &dst_arg, &mode)) return NULL;
    int have_dst = dst_arg != Py_None;
    if (have_dst && PyObject_GetBuffer(dst_arg, &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&key);
        PyBuffer_Release(&head);
        PyBuffer_Release(&src);
        return NULL;
    }
    int best = gmac_mode();
    if (mode < 0) mode = best;
    const char *err = NULL;
    if (key.len != 32)
        err = "gmac needs a 32-byte key";
    else if (have_dst && dst.len != src.len)
        err = "gmac's dst must have src's length";
    else if (mode < 1 || mode > best)
        err = "gmac mode not available on this CPU (see gmac_mode())";
    PyObject *out = NULL;
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
    } else {
#if KV_X86
        uint8_t tag[16];
        Py_BEGIN_ALLOW_THREADS
        gmac_run((const uint8_t *)key.buf, (const uint8_t *)head.buf, (size_t)head.len, (const uint8_t *)src.buf,
                 have_dst ? (uint8_t *)dst.buf : NULL, (size_t)src.len, mode, tag);
        Py_END_ALLOW_THREADS
        out = PyBytes_FromStringAndSize((const char *)tag, 16);
#else
        PyErr_SetString(PyExc_ValueError, "gmac runs on x86-64 only (gmac_mode() is 0 here)");
#endif
    }
    if (have_dst) PyBuffer_Release(&dst);
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    PyBuffer_Release(&src);
    return out;
}

/* seal_gmac(key, head, src, at, mode=-1) -> (xxh3, tag): XXH3-64 of src (> 240 bytes) and the GMAC
 * tag of head || src under key, where head's 8 bytes at `at` (the header's checksum field, zero in
 * the head given) hold that XXH3-64, little-endian. One pass over src: GHASH cannot wait for the
 * checksum it covers, so it hashes src's blocks first (P) and the header's last (Q), and
 * GHASH(head || src) = Q H^k ^ P, k the number of src's blocks after the one it shares with head
 * (GHASH is linear: every block is multiplied by H to the power of its distance from the end). */
#define SEAL_PIECE (16 << 10) /* XXH3 then GHASH each 16 KiB while it is in L1 */
#define SEAL_HEAD_MAX 256

#if KV_X86
/* The XXH3-64 of p[0..n) (n > 240) into *h_out and the GMAC tag of head || p (head's 8 bytes at
 * `at` replaced by that XXH3-64, little-endian) into tag; the caller checked every length. */
static void seal_core(const uint8_t *key, const uint8_t *head, size_t hlen, size_t at, const uint8_t *p,
                      size_t n, int mode, int simd, uint64_t *h_out, uint8_t *tag) {
    uint64_t h = 0;
    ghash_key g;
    ghash_setup(&g, key, mode);
    size_t lead = hlen % 16 ? 16 - hlen % 16 : 0; /* src's bytes in head's last block */
    const uint8_t *s = p + lead;
    size_t nb = (n - lead) / 16, tail = n - lead - 16 * nb, hashed = 0;
    uint64_t acc[8];
    memcpy(acc, k_init, sizeof acc);
    __m128i P = _mm_setzero_si128();
    for (size_t a = 0; a < n; a += SEAL_PIECE) {
        size_t b = a + SEAL_PIECE < n ? a + SEAL_PIECE : n;
        xxh3_range(acc, NULL, p, n, a, b, simd, &h);
        size_t upto = b == n ? nb : (b - lead) / 16; /* src's whole blocks read so far */
        P = ghash_span(&g, P, s + 16 * hashed, NULL, upto - hashed);
        hashed = upto;
    }
    size_t k = nb;
    if (tail) {
        P = ghash_partial(&g, P, s + 16 * nb, NULL, tail);
        k++;
    }
    uint8_t hb[SEAL_HEAD_MAX + 16];
    memcpy(hb, head, hlen);
    for (int i = 0; i < 8; i++) hb[at + i] = (uint8_t)(h >> (8 * i));
    memcpy(hb + hlen, p, lead);
    __m128i Q = ghash_span(&g, _mm_setzero_si128(), hb, NULL, (hlen + lead) / 16);
    __m128i X = k ? _mm_xor_si128(gfmul(Q, ghash_pow(&g, k)), P) : Q;
    ghash_tag(&g, X, (uint64_t)(hlen + n), tag);
    *h_out = h;
}
#endif

static PyObject *py_seal_gmac(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"key", "head", "src", "at", "mode", NULL};
    Py_buffer key, head, src;
    Py_ssize_t at;
    int mode = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*y*n|i", names, &key, &head, &src, &at, &mode)) return NULL;
    int best = gmac_mode();
    if (mode < 0) mode = best;
    const char *err = NULL;
    if (key.len != 32)
        err = "seal_gmac needs a 32-byte key";
    else if (src.len <= 240)
        err = "seal_gmac hashes payloads of more than 240 bytes";
    else if (head.len > SEAL_HEAD_MAX || head.len < 8 || at < 0 || at > head.len - 8)
        err = "seal_gmac needs a head of at most 256 bytes holding 8 checksum bytes at `at`";
    else if (mode < 1 || mode > best)
        err = "gmac mode not available on this CPU (see gmac_mode())";
    PyObject *out = NULL;
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
    } else {
#if KV_X86
        uint8_t tag[16];
        uint64_t h = 0;
        int simd = have_avx2();
        Py_BEGIN_ALLOW_THREADS
        seal_core((const uint8_t *)key.buf, (const uint8_t *)head.buf, (size_t)head.len, (size_t)at,
                  (const uint8_t *)src.buf, (size_t)src.len, mode, simd, &h, tag);
        Py_END_ALLOW_THREADS
        out = Py_BuildValue("Ky#", (unsigned long long)h, (const char *)tag, (Py_ssize_t)16);
#else
        PyErr_SetString(PyExc_ValueError, "seal_gmac runs on x86-64 only (gmac_mode() is 0 here)");
#endif
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    PyBuffer_Release(&src);
    return out;
}

/* A batch of keyed seals shared by two threads (the redis tier's save stream, redis_wire): a
 * helper calls seal_batch(k, helper=True) for each value in order while the sender calls
 * seal_batch(k) for each value it is about to send. Value k's state byte goes 0 (free) -> 1
 * (claimed, by a compare-and-swap: exactly one thread seals into out's slot k) -> 2 (its bytes
 * are in out; a release store, read with an acquire load). Claims and reads are made holding the
 * GIL, which already orders them in CPython; the atomics keep the rule where there is none
 * (free-threaded builds) and say what the code relies on. Every seal runs without the GIL; the
 * Python part of each value's seal (its header body, salt and key) was done for the whole batch
 * before (integrity.Keyed.seal_batch).
 *
 * heads holds n covered headers of hlen bytes (checksum, MAC and MAC kind zero); keys n 32-byte
 * GMAC keys. A sealed header is the covered one with the XXH3-64 at `at`, the tag at `mac_at`,
 * the byte `kind` after the tag, and the CRC-32 (zlib's) of those hlen bytes, little-endian,
 * after them: hlen + 4 bytes, what payload.encode_header writes. */
#define ST_FREE 0
#define ST_CLAIMED 1
#define ST_DONE 2

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++) c = c & 1 ? 0xEDB88320U ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_ieee(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFU;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFU;
}

typedef struct {
    const uint8_t *keys, *heads;
    size_t hlen, at, mac_at;
    int kind, mode, simd;
} seal_spec;

#if KV_X86
static void seal_header(const seal_spec *sp, size_t k, const uint8_t *p, size_t n, uint8_t *out) {
    const uint8_t *head = sp->heads + k * sp->hlen;
    uint64_t h = 0;
    uint8_t tag[16];
    seal_core(sp->keys + 32 * k, head, sp->hlen, sp->at, p, n, sp->mode, sp->simd, &h, tag);
    memcpy(out, head, sp->hlen);
    for (int i = 0; i < 8; i++) out[sp->at + i] = (uint8_t)(h >> (8 * i));
    memcpy(out + sp->mac_at, tag, 16);
    out[sp->mac_at + 16] = (uint8_t)sp->kind;
    uint32_t c = crc32_ieee(out, sp->hlen);
    for (int i = 0; i < 4; i++) out[sp->hlen + i] = (uint8_t)(c >> (8 * i));
}
#endif

/* Parse and check what both calls share; 0 on success, else -1 with an exception set. */
static int batch_args(Py_buffer *keys, Py_buffer *heads, Py_buffer *state, Py_buffer *out, Py_ssize_t at,
                      Py_ssize_t mac_at, int kind, int mode, seal_spec *sp, Py_ssize_t *n) {
    int best = gmac_mode();
    if (mode < 0) mode = best;
    *n = state->len;
    Py_ssize_t hlen = *n ? heads->len / *n : 0;
    const char *err = NULL;
    if (best < 1)
        err = "seal_batch runs on x86-64 with PCLMULQDQ only (gmac_mode() is 0 here)";
    else if (mode < 1 || mode > best)
        err = "gmac mode not available on this CPU (see gmac_mode())";
    else if (*n == 0 || keys->len != 32 * *n || heads->len != hlen * *n || out->len != (hlen + 4) * *n)
        err = "seal_batch needs, for n state bytes, n 32-byte keys, n heads of hlen bytes and (hlen + 4) * n "
              "bytes of out";
    else if (hlen > SEAL_HEAD_MAX || hlen < 8 || at < 0 || at > hlen - 8 || mac_at < 0 || mac_at > hlen - 17
             || (mac_at < at + 8 && at < mac_at + 17))
        err = "seal_batch needs heads of at most 256 bytes holding 8 checksum bytes at `at` and 17 MAC "
              "bytes at `mac_at`, apart";
    else if (kind < 0 || kind > 255)
        err = "seal_batch's MAC kind is one byte (0-255)";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return -1;
    }
    sp->keys = (const uint8_t *)keys->buf;
    sp->heads = (const uint8_t *)heads->buf;
    sp->hlen = (size_t)hlen;
    sp->at = (size_t)at;
    sp->mac_at = (size_t)mac_at;
    sp->kind = kind;
    sp->mode = mode;
    sp->simd = have_avx2();
    return 0;
}

/* seal_batch(keys, heads, view, state, out, k, at, mac_at, kind, mode=-1, helper=False) -> bytes | bool:
 * seal value k of the batch. The sender (helper=False) gets value k's sealed header and never waits:
 * the helper's where it is done; sealed here into out's slot where it is free; sealed here apart
 * where the helper is still on it. The helper (helper=True) seals value k into its slot only if it
 * is free, and says whether it did. */
static PyObject *py_seal_batch(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"keys", "heads", "view", "state", "out", "k", "at", "mac_at", "kind", "mode", "helper",
                            NULL};
    Py_buffer keys, heads, view, state, out;
    Py_ssize_t k, at, mac_at, n = 0;
    int kind, mode = -1, helper = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*y*w*w*nnni|ip", names, &keys, &heads, &view, &state, &out, &k,
                                     &at, &mac_at, &kind, &mode, &helper))
        return NULL;
    seal_spec sp;
    PyObject *res = NULL;
    if (batch_args(&keys, &heads, &state, &out, at, mac_at, kind, mode, &sp, &n) < 0) goto done;
    if (k < 0 || k >= n || view.len <= 240) {
        PyErr_SetString(PyExc_ValueError, "seal_batch needs 0 <= k < n and a payload of more than 240 bytes");
        goto done;
    }
#if KV_X86
    {
        uint8_t *st = (uint8_t *)state.buf + k, *slot = (uint8_t *)out.buf + k * (sp.hlen + 4);
        uint8_t mine[SEAL_HEAD_MAX + 4], *dst = slot;
        uint8_t expect = ST_FREE;
        int claimed = 0;
        if (__atomic_load_n(st, __ATOMIC_ACQUIRE) == ST_FREE)
            claimed = __atomic_compare_exchange_n(st, &expect, ST_CLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        else
            expect = __atomic_load_n(st, __ATOMIC_ACQUIRE);
        if (!claimed && expect != ST_DONE && !helper) dst = mine; /* the helper is on it: a copy of our own */
        if (claimed || dst == mine) {
            Py_BEGIN_ALLOW_THREADS
            seal_header(&sp, (size_t)k, (const uint8_t *)view.buf, (size_t)view.len, dst);
            Py_END_ALLOW_THREADS
            if (claimed) __atomic_store_n(st, ST_DONE, __ATOMIC_RELEASE);
        }
        if (helper) {
            res = PyBool_FromLong(claimed);
        } else {
            res = PyBytes_FromStringAndSize((const char *)dst, (Py_ssize_t)(sp.hlen + 4));
        }
    }
#endif
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&heads);
    PyBuffer_Release(&view);
    PyBuffer_Release(&state);
    PyBuffer_Release(&out);
    return res;
}

/* seal_batch_halt(state): claim every free value, so that a helper seals no more. */
static PyObject *py_seal_batch_halt(PyObject *self, PyObject *args) {
    Py_buffer state;
    if (!PyArg_ParseTuple(args, "w*", &state)) return NULL;
    uint8_t *st = (uint8_t *)state.buf;
    for (Py_ssize_t k = 0; k < state.len; k++) {
        uint8_t expect = ST_FREE;
        __atomic_compare_exchange_n(st + k, &expect, ST_CLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    PyBuffer_Release(&state);
    Py_RETURN_NONE;
}

static PyObject *py_gmac_mode(PyObject *self, PyObject *unused) { return PyLong_FromLong(gmac_mode()); }

static PyObject *py_simd(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_avx2()); }

/* A full memory barrier (the cpu tier's seqlock, cpu.py: on ARM a lock's acquire and release
   do not order a store before them against a store after them). */
static PyObject *py_fence(PyObject *self, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_xxh3", (PyCFunction)(void (*)(void))py_copy_xxh3, METH_VARARGS | METH_KEYWORDS,
     "copy_xxh3(dst, src, simd=None) -> int: copy src into dst (same length, > 240 bytes) and return "
     "XXH3-64 of src; simd=None uses AVX2 where the CPU has it, False forces the scalar code."},
    {"xxh3", (PyCFunction)(void (*)(void))py_xxh3, METH_VARARGS | METH_KEYWORDS,
     "xxh3(src, simd=None) -> int: XXH3-64 of src (> 240 bytes)."},
    {"pwrite_xxh3", py_pwrite_xxh3, METH_VARARGS,
     "pwrite_xxh3(fd, src, offset, piece) -> int: pwrite src at offset, piece bytes at a time, "
     "checksumming each piece right after it is written; returns XXH3-64 of src."},
    {"gmac", (PyCFunction)(void (*)(void))py_gmac, METH_VARARGS | METH_KEYWORDS,
     "gmac(key, head, src, dst=None, mode=-1) -> bytes: the 16-byte AES-256-GMAC tag (zero 12-byte nonce) "
     "of head + src as associated data, copying src into dst (same length) on the way; mode 1 or 2 forces "
     "a kernel (at most gmac_mode())."},
    {"seal_gmac", (PyCFunction)(void (*)(void))py_seal_gmac, METH_VARARGS | METH_KEYWORDS,
     "seal_gmac(key, head, src, at, mode=-1) -> (int, bytes): XXH3-64 of src and the GMAC tag of head + src "
     "with that XXH3-64 written little-endian into head's 8 bytes at `at`; one pass over src."},
    {"seal_batch", (PyCFunction)(void (*)(void))py_seal_batch, METH_VARARGS | METH_KEYWORDS,
     "seal_batch(keys, heads, view, state, out, k, at, mac_at, kind, mode=-1, helper=False) -> bytes | bool: seal "
     "value k of a batch shared by a sender and a helper thread (state byte k: 0 free, 1 claimed, 2 sealed into "
     "out); the sender gets its header and never waits, the helper seals it only where it is free (True)."},
    {"seal_batch_halt", py_seal_batch_halt, METH_VARARGS,
     "seal_batch_halt(state): claim every free value (a helper seals no more)."},
    {"gmac_mode", py_gmac_mode, METH_NOARGS,
     "gmac_mode() -> int: 2 (VPCLMULQDQ, AVX-512), 1 (PCLMULQDQ) or 0 (neither: use cryptography)."},
    {"fence", py_fence, METH_NOARGS, "fence(): a sequentially consistent memory barrier."},
    {"simd", py_simd, METH_NOARGS, "simd() -> bool: whether the AVX2 code runs on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_xxcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__xxcopy(void) {
    crc_init();
    return PyModule_Create(&module);
}
