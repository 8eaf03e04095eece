/* shardpoint._native: the hot loops of a save and a load, without the GIL.
 *
 * A load moves each tensor's bytes from the page cache into the destination a segment at a
 * time and checksums every segment right after it lands, while it is still in the CPU
 * cache. Done from Python, every segment costs a syscall wrapper, a crc call and two GIL
 * handoffs between the reader threads; here the whole run is one call that releases the
 * GIL, so the threads never wait on each other.
 *
 * crc32c (Castagnoli) is computed by folding with carry-less multiplies: four 512-bit
 * accumulators (VPCLMULQDQ, AVX-512), four 256-bit ones (VPCLMULQDQ, AVX2) or four 128-bit
 * ones (PCLMULQDQ), chosen at run time from what the CPU has, and finished with the SSE4.2
 * crc32 instruction. With VPCLMULQDQ the same fold also copies (copy_cached): the bytes
 * are loaded once, stored non-temporally and checksummed from the registers. The fold
 * constants are derived at import from the polynomial, not tabulated.
 *
 * Without x86-64 or a compiler this module is simply absent: shardpoint then uses the
 * Python loops and a crc32c package (see _checksum.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SP_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ crc32c, portable */

static uint32_t table[8][256];

static void
init_table(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xFF];
}

/* reg is the bit-inverted running crc, as in the hardware paths */
static uint32_t
crc_table(uint32_t reg, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= reg;
        reg = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
              table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^
              table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xFF];
    return reg;
}

/* ------------------------------------------------------------------ crc32c, x86-64 */

#ifdef SP_X86

/* x^n mod P, P the crc32c polynomial in normal (not reflected) order */
static uint32_t
xpow_mod(unsigned n)
{
    uint64_t r = 1;
    while (n--) {
        r <<= 1;
        if (r & (1ull << 32))
            r ^= 0x11EDC6F41ull;
    }
    return (uint32_t)r;
}

static uint64_t
reflect32_high(uint32_t c)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        if (c & (1u << i))
            r |= 1u << (31 - i);
    return (uint64_t)r << 32;
}

/* A 128-bit lane of the message, as loaded little-endian, holds in its low qword the 64
 * highest-degree coefficients A and in its high qword the next 64, B: L = A x^64 + B.
 * Moving it forward over `bits` bits of message is L x^bits = A x^(bits+64) + B x^bits
 * (mod P); a carry-less product of reflected operands comes out one degree low, hence the
 * -1 in both exponents. */
typedef struct {
    uint64_t lo, hi;
} fold_k;

static fold_k
fold_constant(unsigned bits)
{
    fold_k k = {reflect32_high(xpow_mod(bits + 63)), reflect32_high(xpow_mod(bits - 1))};
    return k;
}

static fold_k k_16, k_32, k_48, k_64, k_128, k_256;
static int have_sse42, have_pclmul, have_vpclmul, have_vpclmul256;

static void
cpu_features(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return;
    have_sse42 = (c >> 20) & 1;
    have_pclmul = have_sse42 && ((c >> 1) & 1);
    int osxsave = (c >> 27) & 1;
    if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return;
    int avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    int vpclmul = (c >> 10) & 1;
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    int zmm_state = (lo & 0xE6) == 0xE6; /* the OS saves the opmask and all 512-bit registers */
    have_vpclmul = have_pclmul && avx512f && avx512bw && avx512vl && vpclmul && zmm_state;
    /* AVX2 machines with 256-bit carry-less multiply (AMD Zen 3 and later, Intel Ice Lake
     * and later without AVX-512 enabled): the same folding, two 128-bit lanes a register. */
    int avx2 = (b >> 5) & 1;
    int ymm_state = (lo & 0x6) == 0x6; /* the OS saves the 256-bit registers */
    have_vpclmul256 = have_pclmul && avx2 && vpclmul && ymm_state;
}

__attribute__((target("sse4.2"))) static uint32_t
crc_hw(uint32_t reg, const uint8_t *p, size_t n)
{
    uint64_t r = reg;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        r = _mm_crc32_u64(r, w);
        p += 8;
        n -= 8;
    }
    reg = (uint32_t)r;
    while (n--)
        reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

__attribute__((target("sse4.2,pclmul"))) static inline __m128i
fold128(__m128i v, fold_k k)
{
    __m128i kk = _mm_set_epi64x((long long)k.hi, (long long)k.lo);
    return _mm_xor_si128(_mm_clmulepi64_si128(v, kk, 0x00), _mm_clmulepi64_si128(v, kk, 0x11));
}

/* The four 128-bit lanes a0..a3 (a0 first in the message) to one, then finish with crc32. */
__attribute__((target("sse4.2,pclmul"))) static uint32_t
finish(__m128i a0, __m128i a1, __m128i a2, __m128i a3, const uint8_t *tail, size_t n)
{
    __m128i f = _mm_xor_si128(a3, fold128(a0, k_48));
    f = _mm_xor_si128(f, fold128(a1, k_32));
    f = _mm_xor_si128(f, fold128(a2, k_16));
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(f));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(f, 1));
    return crc_hw((uint32_t)r, tail, n);
}

/* n >= 64 */
__attribute__((target("sse4.2,pclmul"))) static uint32_t
crc_pclmul(uint32_t reg, const uint8_t *p, size_t n)
{
    __m128i a0 = _mm_loadu_si128((const __m128i *)p);
    __m128i a1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i a3 = _mm_loadu_si128((const __m128i *)(p + 48));
    a0 = _mm_xor_si128(a0, _mm_cvtsi32_si128((int)reg));
    p += 64;
    n -= 64;
    while (n >= 64) {
        a0 = _mm_xor_si128(fold128(a0, k_64), _mm_loadu_si128((const __m128i *)p));
        a1 = _mm_xor_si128(fold128(a1, k_64), _mm_loadu_si128((const __m128i *)(p + 16)));
        a2 = _mm_xor_si128(fold128(a2, k_64), _mm_loadu_si128((const __m128i *)(p + 32)));
        a3 = _mm_xor_si128(fold128(a3, k_64), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    return finish(a0, a1, a2, a3, p, n);
}

/* The two VPCLMULQDQ widths share one fold, written once in _native_fold.h and included
 * here per width with FOLD_BITS (the register width), FOLD_TARGET (the target attribute)
 * and FOLD_K_BLOCK / FOLD_K_LANE (the constants that move a register four registers and one
 * register ahead); before each inclusion stand broadcast<BITS> (a fold constant in every
 * 128-bit lane) and finish<BITS> (one register's lanes to the crc). */

#define SP_AVX512 "sse4.2,pclmul,avx2,avx512f,avx512bw,avx512vl,vpclmulqdq"

__attribute__((target(SP_AVX512))) static inline __m512i
broadcast512(fold_k k)
{
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k.hi, (long long)k.lo));
}

__attribute__((target(SP_AVX512))) static inline uint32_t
finish512(__m512i x, const uint8_t *tail, size_t n)
{
    return finish(_mm512_extracti32x4_epi32(x, 0), _mm512_extracti32x4_epi32(x, 1),
                  _mm512_extracti32x4_epi32(x, 2), _mm512_extracti32x4_epi32(x, 3), tail, n);
}

#define FOLD_BITS 512
#define FOLD_TARGET SP_AVX512
#define FOLD_K_BLOCK k_256
#define FOLD_K_LANE k_64
#include "_native_fold.h"

static void
store_fence(void)
{
    _mm_sfence();
}

/* For AVX2 machines without AVX-512 (AMD Zen 3 and later): four 256-bit registers, about
 * twice the 128-bit path. The last register's two lanes go to finish as its last two. */
#define SP_AVX2 "sse4.2,pclmul,avx2,vpclmulqdq"

__attribute__((target(SP_AVX2))) static inline uint32_t
finish256(__m256i x, const uint8_t *tail, size_t n)
{
    __m128i zero = _mm_setzero_si128();
    return finish(zero, zero, _mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1), tail, n);
}

__attribute__((target(SP_AVX2))) static inline __m256i
broadcast256(fold_k k)
{
    return _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)k.hi, (long long)k.lo));
}

#define FOLD_BITS 256
#define FOLD_TARGET SP_AVX2
#define FOLD_K_BLOCK k_128
#define FOLD_K_LANE k_32
#include "_native_fold.h"

#endif /* SP_X86 */

static const char *implementation = "table";

/* Whether copies fold crc32c on the way and store non-temporally (copy_crc): with
 * VPCLMULQDQ, on 512- or 256-bit registers. */
static int
stream_copy(void)
{
#ifdef SP_X86
    return have_vpclmul || have_vpclmul256;
#else
    return 0;
#endif
}

/* crc32c of n bytes continuing `crc` (a finished crc, as the Python API passes it) */
static uint32_t
crc32c_update(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t reg = ~crc;
#ifdef SP_X86
    if (have_vpclmul && n >= 256)
        return ~crc_vpclmul512(reg, p, n);
    if (have_vpclmul256 && n >= 128)
        return ~crc_vpclmul256(reg, p, n);
    if (have_pclmul && n >= 64)
        return ~crc_pclmul(reg, p, n);
    if (have_sse42)
        return ~crc_hw(reg, p, n);
#endif
    return ~crc_table(reg, p, n);
}

static void
init_crc(void)
{
    init_table();
#ifdef SP_X86
    cpu_features();
    k_16 = fold_constant(128);
    k_32 = fold_constant(256);
    k_48 = fold_constant(384);
    k_64 = fold_constant(512);
    k_128 = fold_constant(1024);
    k_256 = fold_constant(2048);
    implementation = have_vpclmul ? "vpclmulqdq" : have_vpclmul256 ? "vpclmulqdq-256" : have_pclmul ? "pclmulqdq" : have_sse42 ? "sse4.2" : "table";
#endif
}

/* ------------------------------------------------------------------ Python functions */

/* Below this many bytes a crc runs with the GIL held: releasing it costs more. */
#define RELEASE_GIL_BYTES 65536

static PyObject *
py_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc32c", &view, &value))
        return NULL;
    if (!PyBuffer_IsContiguous(&view, 'C')) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "crc32c needs a contiguous buffer");
        return NULL;
    }
    uint32_t crc;
    if (view.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = crc32c_update((uint32_t)value, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32c_update((uint32_t)value, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* Validate the shared arguments of the loops; on error release `view` and set an exception. */
static int
loop_args(Py_buffer *view, long long offset, Py_ssize_t segment)
{
    const char *bad = segment <= 0 ? "segment must be positive" : offset < 0 ? "offset must be >= 0" : NULL;
    if (bad == NULL)
        return 0;
    PyErr_SetString(PyExc_ValueError, bad);
    PyBuffer_Release(view);
    return -1;
}

static uint32_t copy_crc(uint32_t crc, uint8_t *d, const uint8_t *p, size_t n);
#ifdef SP_X86
static uint8_t *thread_bounce(void);
#define BOUNCE_BYTES ((size_t)256 << 10)
#endif

/* After a loop: release its buffer; -1 with an OSError set when it stopped on errno err. */
static int
loop_done(Py_buffer *view, int err)
{
    PyBuffer_Release(view);
    if (!err)
        return 0;
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* Fill buf[0, len) from fd at offset, one pread of at most segment bytes at a time, with
 * check folding the bytes' crc32c into *crc. Returns the bytes read: fewer than len at the end
 * of the file or on an error (its errno in *err). Called without the GIL. */
static size_t
read_range(int fd, uint8_t *buf, size_t len, long long offset, size_t segment, int check, uint32_t *crc, int *err)
{
    size_t pos = 0;
    uint8_t *bounce = NULL;
#ifdef SP_X86
    if (check && stream_copy()) {
        /* Through the thread's bounce buffer, which stays in the CPU cache, then to buf by
         * the folding copy: the destination is written once, non-temporally, never read,
         * and the crc comes from the copy's own registers (see copy_cached_prefix). */
        bounce = thread_bounce();
        if (bounce != NULL && segment > BOUNCE_BYTES)
            segment = BOUNCE_BYTES;
    }
#endif
    while (pos < len) {
        size_t want = len - pos < segment ? len - pos : segment;
        ssize_t got = pread(fd, bounce ? bounce : buf + pos, want, (off_t)(offset + (long long)pos));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) { /* an error, or the end of the file */
            *err = got < 0 ? errno : 0;
            break;
        }
        if (bounce)
            *crc = copy_crc(*crc, buf + pos, bounce, (size_t)got);
        else if (check)
            *crc = crc32c_update(*crc, buf + pos, (size_t)got);
        pos += (size_t)got;
    }
    return pos;
}

PyDoc_STRVAR(pread_doc,
"pread_into(fd, buffer, offset, segment, check) -> (nread, crc32c)\n\n"
"Fill the writable buffer from fd at offset, one pread of at most segment bytes at a\n"
"time, each segment checksummed right after it lands when check is true (crc32c is 0\n"
"otherwise). Stops early only at end of file: nread < len(buffer) then. Raises OSError.\n"
"The GIL is released throughout.");

static PyObject *
py_pread_into(PyObject *self, PyObject *args)
{
    int fd, check;
    Py_buffer view;
    long long offset;
    Py_ssize_t segment;
    if (!PyArg_ParseTuple(args, "iw*Lnp:pread_into", &fd, &view, &offset, &segment, &check))
        return NULL;
    if (loop_args(&view, offset, segment) < 0)
        return NULL;
    uint32_t crc = 0;
    int err = 0;
    size_t pos;
    Py_BEGIN_ALLOW_THREADS
    pos = read_range(fd, view.buf, (size_t)view.len, offset, (size_t)segment, check, &crc, &err);
    Py_END_ALLOW_THREADS
    if (loop_done(&view, err) < 0)
        return NULL;
    return Py_BuildValue("nk", (Py_ssize_t)pos, (unsigned long)crc);
}

/* Largest write segment checksummed after its write (see py_pwrite_from). */
#define CRC_AFTER_WRITE_MAX ((size_t)1 << 20)

PyDoc_STRVAR(pwrite_doc,
"pwrite_from(fd, buffer, offset, segment) -> crc32c\n\n"
"Write the whole buffer to fd at offset, one pwrite of at most segment bytes at a time,\n"
"each segment checksummed right after its write (segments up to 1 MiB) or right before it\n"
"(larger ones). Raises OSError (a pwrite that writes nothing raises ENOSPC). The GIL is\n"
"released throughout.");

static PyObject *
py_pwrite_from(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer view;
    long long offset;
    Py_ssize_t segment;
    if (!PyArg_ParseTuple(args, "iy*Ln:pwrite_from", &fd, &view, &offset, &segment))
        return NULL;
    if (loop_args(&view, offset, segment) < 0)
        return NULL;
    const uint8_t *buf = view.buf;
    size_t len = (size_t)view.len, pos = 0;
    uint32_t crc = 0;
    int err = 0;
    /* Small segments are checksummed after their write, large ones before. The kernel's
     * copy streams a segment from memory into the CPU cache; when the segment and its page
     * cache copy fit in L2 together, crc32c then reads it from there at ~65 GB/s, not from
     * memory at ~13 GB/s. Larger ones would be evicted by their own copy, so they are
     * checksummed first, and the write reads them from cache instead. Measured on 2 cores
     * (2 MiB L2 each), 1.94 GB from 4 processes in 256 KiB segments: 0.258 s after against
     * 0.278 s before (median of 10); one process in 2 MiB segments: 0.545 s before against
     * 0.561 s after. */
    int after = (size_t)segment <= CRC_AFTER_WRITE_MAX;
    Py_BEGIN_ALLOW_THREADS
    size_t checked = 0;
    while (pos < len) {
        /* Segments end on multiples of `segment` in the file, so that each write covers
         * whole aligned blocks of it: the page cache then builds large folios for them,
         * which later reads (a mapped copy above all) move much faster than small ones. */
        size_t into = (size_t)((offset + (long long)pos) % segment);
        size_t want = (size_t)segment - into;
        if (want > len - pos)
            want = len - pos;
        if (!after && checked < pos + want) {
            crc = crc32c_update(crc, buf + checked, pos + want - checked);
            checked = pos + want;
        }
        ssize_t put = pwrite(fd, buf + pos, want, (off_t)(offset + (long long)pos));
        if (put < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (put == 0) {
            err = ENOSPC;
            break;
        }
        if (after)
            crc = crc32c_update(crc, buf + pos, (size_t)put);
        pos += (size_t)put;
    }
    Py_END_ALLOW_THREADS
    if (loop_done(&view, err) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(crc);
}

/* ------------------------------------------------------------- what is in the page cache */

/* Largest window of a file mapped at once (see CACHED_WINDOW_BYTES). */
#define MAX_WINDOW_BYTES ((size_t)64 << 20)

/* A window of a file range, mapped, with how much of it is in the page cache. */
struct window {
    uint8_t *map;
    size_t lead;     /* bytes mapped before the window: from the start of its first page */
    size_t span;     /* bytes mapped */
    size_t resident; /* bytes of the window, from its start, in the page cache */
};

/* Whether fd is a regular file holding all of [offset, offset + n); sets *page. */
static int
file_holds(int fd, long long offset, size_t n, long *page)
{
    struct stat st;
    *page = sysconf(_SC_PAGESIZE);
    return n > 0 && *page > 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
           (unsigned long long)st.st_size >= (unsigned long long)offset + n;
}

/* Map [at, at + len) of fd (len at most MAX_WINDOW_BYTES) and count its resident prefix
 * (mincore). Returns 0, with nothing left mapped, when that cannot be done. */
static int
map_window(int fd, long long at, size_t len, long page, struct window *w)
{
    unsigned char resident[MAX_WINDOW_BYTES / 4096 + 2];
    long long base = at - at % page;
    w->lead = (size_t)(at - base);
    w->span = w->lead + len;
    size_t pages = (w->span + (size_t)page - 1) / (size_t)page;
    if (pages > sizeof resident)
        return 0; /* pages smaller than 4 KiB: not worth a special case */
    w->map = mmap(NULL, w->span, PROT_READ, MAP_SHARED, fd, (off_t)base);
    if (w->map == MAP_FAILED)
        return 0;
    if (mincore(w->map, w->span, resident) != 0) {
        munmap(w->map, w->span);
        return 0;
    }
    size_t i = 0;
    while (i < pages && (resident[i] & 1))
        i++;
    size_t upto = i * (size_t)page; /* the first byte not resident, from the mapping's start */
    w->resident = upto >= w->span ? len : upto > w->lead ? upto - w->lead : 0;
    return 1;
}

/* ------------------------------------------------------------- copies from the page cache */

/* How copy_cached copies a window: as the page cache maps it, or always one way (tests). */
enum copy_way { WAY_AUTO = -1, WAY_BOUNCED = 0, WAY_MAPPED = 1 };

#ifdef SP_X86

/* crc32c (finished, continuing `crc`) of n bytes copied from p to d; see copy_crc_stream512.
 * Needs stream_copy (the 512- or the 256-bit folding). */
static uint32_t
copy_crc(uint32_t crc, uint8_t *d, const uint8_t *p, size_t n)
{
    size_t head = (64 - (uintptr_t)d % 64) % 64;
    if (head > n)
        head = n;
    memcpy(d, p, head);
    crc = crc32c_update(crc, p, head);
    size_t body = (n - head) / 256 * 256;
    if (body)
        crc = have_vpclmul ? ~copy_crc_stream512(~crc, d + head, p + head, body)
                           : ~copy_crc_stream256(~crc, d + head, p + head, body);
    size_t done = head + body;
    memcpy(d + done, p + done, n - done);
    crc = crc32c_update(crc, p + done, n - done);
    store_fence();
    return crc;
}

/* Mapped a window at a time (16 MiB by default, at most this), so that a reader never holds
 * more than that much of a file mapped: mapped file pages count in the process's RSS. Each
 * window costs an mmap, a mincore and an munmap; 4 MiB windows gave up half of the gain
 * over pread, 16 MiB most of it. */
#define CACHED_WINDOW_BYTES MAX_WINDOW_BYTES

/* How a cached window is copied depends on the folios the page cache holds it in, which
 * follow how the file was written or read in: a 2 MiB folio maps with one page-table entry,
 * a smaller one with a PTE per 4 KiB page. Mapping a 16 MiB window of 256 KiB folios
 * (MADV_POPULATE_READ) took 1.1 ms, against 30 us for 2 MiB ones: about what copying the
 * window then takes. So a window is copied mapped only where the page cache maps it huge;
 * elsewhere it is pread a bounce buffer at a time into the CPU cache and copied from there
 * with copy_crc (no mapping at all; the kernel's copy reads the page cache through its own
 * huge direct map). Measured, 2 threads, 64 MiB pieces, crc32c (GB/s): written in 2 MiB
 * pieces, mapped 12.4, bounced 10.3; in 256 KiB pieces, mapped 8.8, bounced 10.3 (plain
 * pread without crc32c: 10.7 and 10.3). Which one a window gets is seen with PAGEMAP_SCAN
 * (Linux 6.7+) on one 2 MiB block of it; without it, every window is copied mapped. */

struct pm_region {
    uint64_t start, end, categories;
};
struct pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define SP_PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define SP_PAGE_IS_HUGE (1 << 6)
#define HUGE_BLOCK ((size_t)2 << 20)

static int pagemap_fd = -1; /* /proc/self/pagemap: -1 not opened yet, -2 cannot be scanned here */

/* In a forked child the inherited descriptor would read the parent's page tables. */
static void
forget_pagemap(void)
{
    if (pagemap_fd >= 0)
        close(pagemap_fd);
    pagemap_fd = -1;
}

static int
pagemap(void)
{
    int fd = __atomic_load_n(&pagemap_fd, __ATOMIC_ACQUIRE);
    if (fd != -1)
        return fd;
    int mine = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (mine < 0)
        mine = -2;
    int expected = -1;
    if (__atomic_compare_exchange_n(&pagemap_fd, &expected, mine, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return mine;
    if (mine >= 0)
        close(mine); /* another thread opened it first */
    return expected;
}

/* 1 when the first 2 MiB block wholly inside [map, map + span) maps huge, 0 when it does not
 * (or the window holds no such block), -1 when that cannot be told. Faults in one page. */
static int
maps_huge(const uint8_t *map, size_t span)
{
    int fd = pagemap();
    if (fd < 0)
        return -1;
    uintptr_t block = ((uintptr_t)map + HUGE_BLOCK - 1) & ~(uintptr_t)(HUGE_BLOCK - 1);
    if (block + HUGE_BLOCK > (uintptr_t)map + span)
        return 0;
    volatile uint8_t touch = *(const volatile uint8_t *)block; /* maps the folio there */
    (void)touch;
    struct pm_region found[1];
    struct pm_scan_arg scan = {
        .size = sizeof scan, .start = block, .end = block + HUGE_BLOCK, .vec = (uintptr_t)found,
        .vec_len = 1, .category_mask = SP_PAGE_IS_HUGE, .return_mask = SP_PAGE_IS_HUGE,
    };
    long n = ioctl(fd, SP_PAGEMAP_SCAN, &scan);
    if (n < 0 && errno != EINTR)
        __atomic_store_n(&pagemap_fd, -2, __ATOMIC_RELEASE); /* ENOTTY/EINVAL: before Linux 6.7 */
    if (n < 0)
        return errno == EINTR ? 0 : -1;
    return n == 1 && found[0].start == block && found[0].end == block + HUGE_BLOCK;
}

/* The bounce buffer: half of a 512 KiB L2, so that what pread puts there is still in the
 * CPU cache when copy_crc reads it (128 / 256 / 512 KiB: 9.9 / 10.3 / 10.3 GB/s). One per
 * thread that has used it, freed when the thread ends. */
static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void
make_bounce_key(void)
{
    if (pthread_key_create(&bounce_key, free) != 0)
        bounce_key = (pthread_key_t)-1;
}

static uint8_t *
thread_bounce(void)
{
    pthread_once(&bounce_once, make_bounce_key);
    if (bounce_key == (pthread_key_t)-1)
        return NULL;
    void *b = pthread_getspecific(bounce_key);
    if (b == NULL) {
        if (posix_memalign(&b, 4096, BOUNCE_BYTES) != 0)
            return NULL;
        if (pthread_setspecific(bounce_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    return b;
}

/* Copy from fd at offset to d, a window at a time, for as long as each window is wholly in
 * the page cache. Returns the bytes copied (a prefix of the n asked; 0 when the file cannot
 * be mapped or is shorter than the range: the caller reads those and reports a short file
 * itself) and their crc in *crc. */
static size_t
copy_cached_prefix(int fd, uint8_t *d, size_t n, long long offset, size_t window, int way, uint32_t *crc)
{
    long page;
    *crc = 0;
    if (!file_holds(fd, offset, n, &page))
        return 0;
    if (window == 0 || window > CACHED_WINDOW_BYTES)
        window = CACHED_WINDOW_BYTES;
    size_t done = 0;
    while (done < n) {
        size_t len = n - done < window ? n - done : window;
        struct window w;
        if (!map_window(fd, offset + (long long)done, len, page, &w))
            break;
        size_t got = 0;
        if (w.resident == len) {
            int mapped = way == WAY_AUTO ? maps_huge(w.map, w.span) != 0 : way == WAY_MAPPED;
            if (mapped) {
#ifdef MADV_POPULATE_READ
                madvise(w.map, w.span, MADV_POPULATE_READ); /* one call instead of a fault per 64 KiB */
#endif
                *crc = copy_crc(*crc, d + done, w.map + w.lead, len);
                got = len;
            } else {
                int err = 0; /* the caller reads again what is left, and reports it */
                got = read_range(fd, d + done, len, offset + (long long)done, BOUNCE_BYTES, 1, crc, &err);
            }
        }
        munmap(w.map, w.span);
        done += got;
        if (got < len)
            break;
    }
    return done;
}

#endif /* SP_X86 */

#ifndef SP_X86
/* Without the folding copy a checked pread_into reads in place and never calls this; it
 * completes the build. */
static uint32_t
copy_crc(uint32_t crc, uint8_t *d, const uint8_t *p, size_t n)
{
    memcpy(d, p, n);
    return crc32c_update(crc, p, n);
}
#endif

PyDoc_STRVAR(copy_cached_doc,
"copy_cached(fd, buffer, offset, window=16 MiB, mapped=None) -> (ncopied, crc32c)\n\n"
"Copy bytes of the regular file fd from offset into the writable buffer from the page\n"
"cache, a window at a time (at most 64 MiB), stored non-temporally with crc32c folded on\n"
"the way, for as long as each window is wholly cached. A window the page cache maps huge\n"
"is copied mapped, any other through a bounce buffer in the CPU cache (mapped=True or\n"
"False: always that way, for tests). Returns the\n"
"bytes copied, a prefix of the buffer (0 when nothing is cached, the file cannot be\n"
"mapped, or it is shorter than the range), and their crc32c; the caller reads the rest.\n"
"Copies nothing unless STREAM_COPY. The GIL is released throughout.");

static PyObject *
py_copy_cached(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer view;
    long long offset;
    Py_ssize_t window = 16 << 20;
    PyObject *mapped = Py_None;
    if (!PyArg_ParseTuple(args, "iw*L|nO:copy_cached", &fd, &view, &offset, &window, &mapped))
        return NULL;
    int way = mapped == Py_None ? WAY_AUTO : PyObject_IsTrue(mapped);
    if (way == -1 && mapped != Py_None) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (loop_args(&view, offset, 1) < 0)
        return NULL;
    size_t copied = 0;
    uint32_t crc = 0;
#ifdef SP_X86
    if (stream_copy()) {
        Py_BEGIN_ALLOW_THREADS
        copied = copy_cached_prefix(fd, view.buf, (size_t)view.len, offset, (size_t)window, way, &crc);
        Py_END_ALLOW_THREADS
    }
#endif
    PyBuffer_Release(&view);
    return Py_BuildValue("nk", (Py_ssize_t)copied, (unsigned long)crc);
}

/* ------------------------------------------------------------- reads past the page cache */

/* O_DIRECT wants the file offset, the length and the memory all aligned to the device's
 * block (512 B or 4 KiB); 4 KiB satisfies both. */
#define DIRECT_ALIGN ((size_t)4096)

/* crc32c (finished, continuing `crc`) of n bytes copied from p to d */
static uint32_t
copy_and_check(uint32_t crc, uint8_t *d, const uint8_t *p, size_t n, int check)
{
#ifdef SP_X86
    if (check && stream_copy())
        return copy_crc(crc, d, p, n);
#endif
    memcpy(d, p, n);
    return check ? crc32c_update(crc, p, n) : crc;
}

/* Bytes from offset that are in the page cache, up to the first page that is not (at most
 * n); 0 when the file cannot be mapped or is shorter than the range. */
static size_t
cached_prefix(int fd, long long offset, size_t n)
{
    long page;
    if (!file_holds(fd, offset, n, &page))
        return 0;
    size_t done, len;
    struct window w;
    for (done = 0; done < n; done += len) {
        len = n - done < MAX_WINDOW_BYTES ? n - done : MAX_WINDOW_BYTES;
        if (!map_window(fd, offset + (long long)done, len, page, &w))
            return done;
        munmap(w.map, w.span);
        if (w.resident < len)
            return done + w.resident;
    }
    return done;
}

PyDoc_STRVAR(cached_prefix_doc,
"cached_prefix(fd, offset, n) -> int\n\n"
"How many of the n bytes of the regular file fd from offset are in the page cache, counted\n"
"up to the first page that is not (mmap + mincore, a window at a time; nothing is read).\n"
"0 when the file cannot be mapped or is shorter than the range. The GIL is released.");

static PyObject *
py_cached_prefix(PyObject *self, PyObject *args)
{
    int fd;
    long long offset, n;
    if (!PyArg_ParseTuple(args, "iLL:cached_prefix", &fd, &offset, &n))
        return NULL;
    if (offset < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and n must be >= 0");
        return NULL;
    }
    size_t cached;
    Py_BEGIN_ALLOW_THREADS
    cached = cached_prefix(fd, offset, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t((Py_ssize_t)cached);
}

PyDoc_STRVAR(pread_direct_doc,
"pread_direct(fd, buffer, offset, bounce, check) -> (nread, crc32c)\n\n"
"Fill the writable buffer from fd (opened with O_DIRECT) at offset, through bounce, a\n"
"writable buffer whose address and length are multiples of 4096: each read covers the\n"
"4 KiB-aligned blocks around the next bytes wanted, at most len(bounce) of them, and the\n"
"wanted bytes are copied out, checksummed on the way when check is true (crc32c is 0\n"
"otherwise). Stops early only at end of file: nread < len(buffer) then. Raises OSError\n"
"(EINVAL where the file system refuses the alignment). The GIL is released throughout.");

/* Returns the bytes delivered, or -errno. */
static long long
direct_read(int fd, uint8_t *buf, size_t len, long long offset, uint8_t *mid, size_t room, int check,
            uint32_t *crc)
{
    size_t pos = 0;
    while (pos < len) {
        long long at = offset + (long long)pos;
        size_t skip = (size_t)(at % (long long)DIRECT_ALIGN);
        size_t want = (skip + (len - pos) + DIRECT_ALIGN - 1) / DIRECT_ALIGN * DIRECT_ALIGN;
        if (want > room)
            want = room;
        ssize_t got = pread(fd, mid, want, (off_t)(at - (long long)skip));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -(long long)errno;
        }
        if ((size_t)got <= skip)
            break; /* end of file */
        size_t use = (size_t)got - skip;
        if (use > len - pos)
            use = len - pos;
        *crc = copy_and_check(*crc, buf + pos, mid + skip, use, check);
        pos += use;
        if ((size_t)got < want)
            break; /* end of file */
    }
    return (long long)pos;
}


static PyObject *
py_pread_direct(PyObject *self, PyObject *args)
{
    int fd, check;
    Py_buffer view, bounce;
    long long offset;
    if (!PyArg_ParseTuple(args, "iw*Lw*p:pread_direct", &fd, &view, &offset, &bounce, &check))
        return NULL;
    const char *bad = offset < 0 ? "offset must be >= 0"
                      : ((uintptr_t)bounce.buf % DIRECT_ALIGN || (size_t)bounce.len % DIRECT_ALIGN ||
                         bounce.len == 0)
                          ? "bounce must be a non-empty buffer whose address and length are multiples of 4096"
                          : NULL;
    if (bad != NULL) {
        PyErr_SetString(PyExc_ValueError, bad);
        PyBuffer_Release(&view);
        PyBuffer_Release(&bounce);
        return NULL;
    }
    uint32_t crc = 0;
    long long done;
    Py_BEGIN_ALLOW_THREADS
    done = direct_read(fd, view.buf, (size_t)view.len, offset, bounce.buf, (size_t)bounce.len, check, &crc);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyBuffer_Release(&bounce);
    if (done < 0) {
        errno = (int)-done;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nk", (Py_ssize_t)done, (unsigned long)crc);
}

/* For tests: the crc through one named path, so each is checked on CPUs that have it. */
static PyObject *
py_crc32c_using(PyObject *self, PyObject *args)
{
    const char *name;
    Py_buffer view;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "sy*|k:crc32c_using", &name, &view, &value))
        return NULL;
    const uint8_t *p = view.buf;
    size_t n = (size_t)view.len;
    uint32_t reg = ~(uint32_t)value;
    int ok = 1;
    if (strcmp(name, "table") == 0)
        reg = crc_table(reg, p, n);
#ifdef SP_X86
    else if (strcmp(name, "sse4.2") == 0 && have_sse42)
        reg = crc_hw(reg, p, n);
    else if (strcmp(name, "pclmulqdq") == 0 && have_pclmul)
        reg = n >= 64 ? crc_pclmul(reg, p, n) : crc_hw(reg, p, n);
    else if (strcmp(name, "vpclmulqdq") == 0 && have_vpclmul)
        reg = n >= 256 ? crc_vpclmul512(reg, p, n) : crc_hw(reg, p, n);
    else if (strcmp(name, "vpclmulqdq-256") == 0 && have_vpclmul256)
        reg = n >= 128 ? crc_vpclmul256(reg, p, n) : crc_hw(reg, p, n);
#endif
    else
        ok = 0;
    PyBuffer_Release(&view);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "crc32c path %s is not available on this CPU", name);
        return NULL;
    }
    return PyLong_FromUnsignedLong(~reg);
}

static PyMethodDef methods[] = {
    {"crc32c_using", py_crc32c_using, METH_VARARGS,
     "crc32c_using(path, data, value=0) -> int: crc32c through one path (tests)."},
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, value=0) -> int: crc32c of a bytes-like object, continuing value."},
    {"pread_into", py_pread_into, METH_VARARGS, pread_doc},
    {"pwrite_from", py_pwrite_from, METH_VARARGS, pwrite_doc},
    {"copy_cached", py_copy_cached, METH_VARARGS, copy_cached_doc},
    {"pread_direct", py_pread_direct, METH_VARARGS, pread_direct_doc},
    {"cached_prefix", py_cached_prefix, METH_VARARGS, cached_prefix_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shardpoint._native",
    "The GIL-free hot loops of shardpoint's reads and writes, and crc32c.", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    init_crc();
#ifdef SP_X86
    pthread_atfork(NULL, NULL, forget_pagemap);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "IMPLEMENTATION", implementation) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_COPY", stream_copy()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
