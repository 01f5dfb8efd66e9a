/*
 * kvtier.store._xxcopy: copy a payload and compute its XXH3-64 checksum in one pass.
 *
 * C only for what no maintained library does for kvtier: the fused copy (or pwrite) + XXH3-64
 * pass (and `fence`, the cpu tier's barrier). No cryptography here: the keyed MAC is OpenSSL's,
 * through `cryptography` (integrity.py).
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
    {"fence", py_fence, METH_NOARGS, "fence(): a sequentially consistent memory barrier."},
    {"simd", py_simd, METH_NOARGS, "simd() -> bool: whether the AVX2 code runs on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_xxcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__xxcopy(void) {
    return PyModule_Create(&module);
}
