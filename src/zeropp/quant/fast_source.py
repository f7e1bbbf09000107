"""The C source of the CPU quantizer kernel (``fast.py`` builds, loads and self-tests it; its docstring says
why a C kernel and what bit-identity rests on). Plain C99 plus optional AVX-512 intrinsics bodies; the notes
here (Note [clamp-free codes], Note [split sums]) explain the exactness of the fast paths."""

from zeropp import native

C_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>
/* AVX-512 bodies for two hot loops (built with -march=native; -DZQ_NO_SIMD keeps the portable C only). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(ZQ_NO_SIMD)
#include <immintrin.h>
#define ZQ_SIMD 1
#else
#define ZQ_SIMD 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
#define CH 2048 /* int4 staging chunk, even */

""" + native.C_FLOAT_BITS + r"""
/* The code of a block with a subnormal scale: a true division, round half to even, clamped. */
static inline int8_t qcode(float v, float div, float qmax) {
    float t = rintf(v / div);
    t = t < -qmax ? -qmax : t;
    t = t > qmax ? qmax : t;
    return (int8_t)(int32_t)t;
}

/* Note [clamp-free codes]: for a normal div (the block's scale, or 1 for an all-zero block) the spec's code is
   rintf(x * inv) with inv = RN(1 / div) (Note [reciprocal codes] in blockwise.py), which never leaves
   [-qmax, qmax], so the hot loops have neither the division nor the clamp (the clamp cost about a fifth of
   quantize, the division a quarter). A subnormal div (m below about 1e-37) keeps qcode. */
/* The divisor a block's codes are computed with: its scale, or 1 for an all-zero block (0 / 1 = 0 * 1 = 0). */
static inline float divisor_of(float scale) { return scale == 0.0f ? 1.0f : scale; }
static inline int clamp_free(float div) { return div >= 0x1p-126f; }
static inline float recip(float div) { return 1.0f / div; }
static inline int8_t code1(float v, float div, float qmax) {
    return clamp_free(div) ? (int8_t)(int32_t)rintf(v * recip(div)) : qcode(v, div, qmax);
}

/* Codes of n consecutive elements. */
#define DEFINE_CODES(SUF, T, LOADF)                                                                  \
static void codes_##SUF(const T* x, int64_t n, float div, float qmax, int8_t* out) {                 \
    if (clamp_free(div)) {                                                                           \
        const float inv = recip(div);                                                                \
        for (int64_t k = 0; k < n; k++) out[k] = (int8_t)(int32_t)rintf(LOADF(x[k]) * inv);          \
    } else                                                                                           \
        for (int64_t k = 0; k < n; k++) out[k] = qcode(LOADF(x[k]), div, qmax);                      \
}

#if ZQ_SIMD
/* int4 codes of 128 elements, two per byte, with few shuffles (costly at zmm width on Zen 4): each
   dword of 32 loaded bits holds an (even, odd) element pair, so the even and odd elements come out as two fp32
   vectors and their codes combine in place into the pair's byte, (c_even + 8) | (c_odd + 8) << 4; four such
   vectors narrow with two in-lane packs and one dword permute. Rounding: vcvtps2dq with round-to-nearest-even,
   as rintf, of the IEEE products with vi = the block's reciprocal. Clamp-free only (Note [clamp-free codes]). */
static inline __m512i vpair4(__m512 ev, __m512 od, __m512 vi) {
    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i ce = _mm512_cvt_roundps_epi32(_mm512_mul_ps(ev, vi), rne);
    __m512i co = _mm512_cvt_roundps_epi32(_mm512_mul_ps(od, vi), rne);
    const __m512i eight = _mm512_set1_epi32(8);
    return _mm512_or_si512(_mm512_add_epi32(ce, eight), _mm512_slli_epi32(_mm512_add_epi32(co, eight), 4));
}
static inline void vstore64(__m512i b0, __m512i b1, __m512i b2, __m512i b3, uint8_t* o) {
    __m512i b = _mm512_packus_epi16(_mm512_packs_epi32(b0, b1), _mm512_packs_epi32(b2, b3));
    /* 128-bit lane l now holds dwords [b0's lane l, b1's, b2's, b3's]: transpose 4x4 dwords */
    const __m512i t = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512((void*)o, _mm512_permutexvar_epi32(t, b));
}
static inline __m512i vbf16_pairs(const uint16_t* x, __m512 vi) {
    __m512i w = _mm512_loadu_si512((const void*)x);
    __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    __m512 od = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    return vpair4(ev, od, vi);
}
static inline __m512i vf32_pairs(const float* x, __m512 vi) {
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return vpair4(_mm512_permutex2var_ps(a, ie, b), _mm512_permutex2var_ps(a, io, b), vi);
}
/* Codes of xb[i - s ..) for row elements [i, e) (i even) into dr, 128 at a time; returns where it stopped. */
#define DEFINE_SIMD4(SUF, T, PAIRS)                                                                  \
static int64_t simd4_##SUF(const T* xb, int64_t s, int64_t i, int64_t e, float div, uint8_t* dr) {   \
    if (!clamp_free(div)) return i;                                                                  \
    __m512 vi = _mm512_set1_ps(recip(div));                                                          \
    for (; i + 128 <= e; i += 128) {                                                                 \
        const T* x = xb + (i - s);                                                                   \
        vstore64(PAIRS(x, vi), PAIRS(x + 32, vi), PAIRS(x + 64, vi), PAIRS(x + 96, vi), dr + (i >> 1));\
    }                                                                                                \
    return i;                                                                                        \
}
DEFINE_SIMD4(bf16, uint16_t, vbf16_pairs)
DEFINE_SIMD4(f32, float, vf32_pairs)
#define SIMD4_bf16 i = simd4_bf16(xb, s, i, e, div, dr);
#define SIMD4_f32 i = simd4_f32(xb, s, i, e, div, dr);
#else
#define SIMD4_bf16
#define SIMD4_f32
#endif
#define SIMD4_f16 /* fp16 gradients are rare: the portable loop */

/* Per input dtype: code emission, the poisoned-block path and the block quantizer (max |x| on bit patterns:
   inf/nan have all exponent bits set). xb points at row element s throughout. */
#define DEFINE_QUANT(SUF, T, UT, ABSMASK, INFBITS, LOADF, ABS2F)                                      \
DEFINE_CODES(SUF, T, LOADF)                                                                          \
static void emit_##SUF(const T* xb, int64_t s, int64_t e, int bits, float div, float qmax, uint8_t* dr) {\
    if (bits == 8) {                                                                                 \
        codes_##SUF(xb, e - s, div, qmax, (int8_t*)(dr + s));                                        \
        return;                                                                                      \
    }                                                                                                \
    int64_t i = s;                                                                                   \
    if (i & 1) { /* high nibble of a byte whose low nibble the previous block (or chunk) wrote */    \
        dr[i >> 1] |= (uint8_t)((code1(LOADF(xb[0]), div, qmax) + 8) << 4);                         \
        i++;                                                                                         \
    }                                                                                                \
    SIMD4_##SUF /* i is even from here */                                                            \
    int8_t tmp[CH];                                                                                  \
    while (i < e) {                                                                                  \
        int64_t n = e - i < CH ? e - i : CH, np = n >> 1;                                            \
        codes_##SUF(xb + (i - s), n, div, qmax, tmp);                                                \
        uint8_t* o = dr + (i >> 1);                                                                  \
        for (int64_t k = 0; k < np; k++)                                                             \
            o[k] = (uint8_t)((uint8_t)(tmp[2 * k] + 8) | (uint8_t)((tmp[2 * k + 1] + 8) << 4));      \
        if (n & 1) o[np] = (uint8_t)(tmp[n - 1] + 8); /* high nibble: next block or row padding */   \
        i += n;                                                                                      \
    }                                                                                                \
}                                                                                                    \
/* Poisoned block: codes of the block with its non-finite elements as 0, scale NaN. */              \
static void poison_block_##SUF(const T* xb, int64_t s, int64_t e, int bits, float qmax, uint8_t* dr,  \
                               float* scale_out) {                                                   \
    const UT* ub = (const UT*)xb;                                                                    \
    UT m = 0;                                                                                        \
    for (int64_t k = 0; k < e - s; k++) { UT a = ub[k] & ABSMASK; if (a < INFBITS && a > m) m = a; } \
    float scale = ABS2F(m) / qmax;                                                                   \
    float div = divisor_of(scale);                                                                   \
    float tmp[CH];                                                                                   \
    for (int64_t i = s; i < e; i += CH) {                                                            \
        int64_t n = e - i < CH ? e - i : CH;                                                         \
        for (int64_t k = 0; k < n; k++)                                                              \
            tmp[k] = (ub[i - s + k] & ABSMASK) < INFBITS ? LOADF(xb[i - s + k]) : 0.0f;              \
        emit_f32(tmp, i, i + n, bits, div, qmax, dr);                                                \
    }                                                                                                \
    *scale_out = u2f(QNAN_BITS);                                                                     \
}                                                                                                    \
/* Returns 1 (nothing written) for a block holding inf/nan unless poison is set. */                  \
static int quant_block_##SUF(const T* xb, int64_t s, int64_t e, int bits, float qmax, int poison,     \
                             uint8_t* dr, float* scale_out) {                                        \
    const UT* ub = (const UT*)xb;                                                                    \
    UT m = 0;                                                                                        \
    for (int64_t k = 0; k < e - s; k++) { UT a = ub[k] & ABSMASK; m = a > m ? a : m; }                \
    if (m >= INFBITS) {                                                                              \
        if (!poison) return 1;                                                                       \
        poison_block_##SUF(xb, s, e, bits, qmax, dr, scale_out);                                     \
        return 0;                                                                                    \
    }                                                                                                \
    float scale = ABS2F(m) / qmax;                                                                   \
    float div = divisor_of(scale);                                                                   \
    *scale_out = scale;                                                                              \
    emit_##SUF(xb, s, e, bits, div, qmax, dr);                                                       \
    return 0;                                                                                        \
}

#define ID(v) (v)
#define BF2F(v) u2f((uint32_t)(v) << 16)
#define QNAN_BITS 0x7FC00000u /* the NaN torch writes for float("nan") */
DEFINE_QUANT(f32, float, uint32_t, 0x7FFFFFFFu, 0x7F800000u, ID, u2f)
DEFINE_QUANT(bf16, uint16_t, uint16_t, 0x7FFFu, 0x7F80u, BF2F, BF2F)
DEFINE_QUANT(f16, uint16_t, uint16_t, 0x7FFFu, 0x7C00u, h2f, h2f)

#define DEFINE_DEQUANT(SUF, T, STOREF)                                                               \
static void dequant_block_##SUF(const uint8_t* dr, int64_t s, int64_t e, int bits, float sc, T* yr) {\
    if (bits == 8) {                                                                                 \
        for (int64_t i = s; i < e; i++) yr[i] = STOREF((float)(int8_t)dr[i] * sc);                   \
        return;                                                                                      \
    }                                                                                                \
    int64_t i = s;                                                                                   \
    if (i & 1) { yr[i] = STOREF((float)((int)(dr[i >> 1] >> 4) - 8) * sc); i++; }                   \
    int8_t tmp[CH];                                                                                  \
    while (i < e) {                                                                                  \
        int64_t n = e - i < CH ? e - i : CH, np = n >> 1;                                            \
        const uint8_t* d = dr + (i >> 1);                                                            \
        for (int64_t k = 0; k < np; k++) {                                                           \
            tmp[2 * k] = (int8_t)((d[k] & 15) - 8);                                                  \
            tmp[2 * k + 1] = (int8_t)((d[k] >> 4) - 8);                                              \
        }                                                                                            \
        if (n & 1) tmp[n - 1] = (int8_t)((d[np] & 15) - 8);                                          \
        T* yc = yr + i;                                                                              \
        for (int64_t k = 0; k < n; k++) yc[k] = STOREF((float)tmp[k] * sc);                          \
        i += n;                                                                                      \
    }                                                                                                \
}
DEFINE_DEQUANT(f32, float, ID)
DEFINE_DEQUANT(bf16, uint16_t, f2bf)
DEFINE_DEQUANT(f16, uint16_t, f2h)

/* payload: the row stride (bytes) of data; rows are contiguous but may sit apart (a wire buffer's data part). */
typedef struct {
    const void* x; void* y; uint8_t* data; float* scales;
    int dt, bits; int64_t numel, nb, payload; const int64_t* starts;
    int64_t g0, g1, bad;
    int poison;
    /* qgZ sums: data/scales hold pieces * rows input rows; out_* the requantized rows */
    int64_t pieces, rows; float divisor; int has_div; uint8_t* out_data; float* out_scales; int64_t out_payload;
} job_t;

static void* quant_worker(void* p) {
    job_t* j = (job_t*)p;
    float qmax = j->bits == 8 ? 127.0f : 7.0f;
    j->bad = -1;
    for (int64_t g = j->g0; g < j->g1; g++) {
        int64_t r = g / j->nb, b = g % j->nb, s = j->starts[b], e = j->starts[b + 1];
        uint8_t* dr = j->data + r * j->payload;
        int bad;
        if (j->dt == DT_F32)
            bad = quant_block_f32((const float*)j->x + r * j->numel + s, s, e, j->bits, qmax, j->poison, dr,
                                  j->scales + g);
        else if (j->dt == DT_BF16)
            bad = quant_block_bf16((const uint16_t*)j->x + r * j->numel + s, s, e, j->bits, qmax, j->poison, dr,
                                   j->scales + g);
        else
            bad = quant_block_f16((const uint16_t*)j->x + r * j->numel + s, s, e, j->bits, qmax, j->poison, dr,
                                  j->scales + g);
        if (bad) { j->bad = g; break; }
    }
    return NULL;
}

static void* dequant_worker(void* p) {
    job_t* j = (job_t*)p;
    for (int64_t g = j->g0; g < j->g1; g++) {
        int64_t r = g / j->nb, b = g % j->nb, s = j->starts[b], e = j->starts[b + 1];
        const uint8_t* dr = j->data + r * j->payload;
        float sc = j->scales[g];
        if (j->dt == DT_F32) dequant_block_f32(dr, s, e, j->bits, sc, (float*)j->y + r * j->numel);
        else if (j->dt == DT_BF16) dequant_block_bf16(dr, s, e, j->bits, sc, (uint16_t*)j->y + r * j->numel);
        else dequant_block_f16(dr, s, e, j->bits, sc, (uint16_t*)j->y + r * j->numel);
    }
    return NULL;
}

/* int4 codes of row elements [s, e) (at most CH) of payload row dr into c[0 .. e - s). */
static void codes4(const uint8_t* dr, int64_t s, int64_t e, int8_t* c) {
    int64_t i = s, k = 0;
    if (i & 1) { c[k++] = (int8_t)((dr[i >> 1] >> 4) - 8); i++; }
    const uint8_t* d = dr + (i >> 1);
    int64_t np = (e - i) >> 1;
    for (int64_t m = 0; m < np; m++) {
        c[k + 2 * m] = (int8_t)((d[m] & 15) - 8);
        c[k + 2 * m + 1] = (int8_t)((d[m] >> 4) - 8);
    }
    if (i + 2 * np < e) c[k + 2 * np] = (int8_t)((d[np] & 15) - 8);
}

#if ZQ_SIMD
/* The 16 products (n - 8) * sc of a block's int4 codes, one vmulps with the code as the first operand, as the
   scalar loop computes each product. (A scalar loop over t here let gcc fold (t - 8) * sc for negative
   constants into -(k * sc), which flips the sign of a NaN product: a poisoned block's NaNs came out negative.) */
static inline __m512 product_table(float sc) {
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_mul_ps(codes, _mm512_set1_ps(sc));
}

enum { POST_NONE = 0, POST_MUL = 1, POST_DIV = 2 };

/* a[k] = (or +=) code k * sc for the leading elements of the n at row element c0 of payload row dr, 64 (int4)
   or 16 (int8) at a time, then (post) times or divided by q; returns how many it did (none from an odd int4
   element). int4: 32 bytes split into low and high nibbles, interleaved per 128-bit lane into element order,
   each 16 of them zero-extended to dwords that index the block's product table (vpermps reads only the low 4
   bits: no sign extension, conversion or multiply). The products, sums and post operation are the scalar
   loops'. */
static int64_t simd_sum(const uint8_t* dr, int64_t c0, int64_t n, int bits, float sc, int first, float* a,
                        int post, float q) {
    const __m512 vq = _mm512_set1_ps(q);
    int64_t k = 0;
#define ZQ_PUT(V, OFF)                                                                               \
    do {                                                                                             \
        __m512 v = (V);                                                                              \
        float* o = a + k + (OFF);                                                                    \
        if (!first) v = _mm512_add_ps(_mm512_loadu_ps(o), v);                                        \
        if (post) v = post == POST_MUL ? _mm512_mul_ps(v, vq) : _mm512_div_ps(v, vq);                \
        _mm512_storeu_ps(o, v);                                                                      \
    } while (0)
    if (bits == 8) {
        const __m512 vs = _mm512_set1_ps(sc);
        for (; k + 16 <= n; k += 16) {
            __m128i codes = _mm_loadu_si128((const __m128i*)(dr + c0 + k));
            ZQ_PUT(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), vs), 0);
        }
        return k;
    }
    if (c0 & 1) return 0;
    const uint8_t* d = dr + (c0 >> 1);
    const __m512 table = product_table(sc);
    const __m256i m15 = _mm256_set1_epi8(15);
#define ZQ_LOOK(BYTES) _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(BYTES), table)
    for (; k + 64 <= n; k += 64) {
        __m256i w = _mm256_loadu_si256((const __m256i*)(d + (k >> 1)));
        __m256i lo = _mm256_and_si256(w, m15), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m15);
        __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi); /* 0-15|32-47, 16-31|48-63 */
        ZQ_PUT(ZQ_LOOK(_mm256_castsi256_si128(u0)), 0);
        ZQ_PUT(ZQ_LOOK(_mm256_castsi256_si128(u1)), 16);
        ZQ_PUT(ZQ_LOOK(_mm256_extracti128_si256(u0, 1)), 32);
        ZQ_PUT(ZQ_LOOK(_mm256_extracti128_si256(u1, 1)), 48);
    }
#undef ZQ_LOOK
#undef ZQ_PUT
    return k;
}
#define SIMD_SUM(dr, c0, n, bits, sc, first, a) simd_sum(dr, c0, n, bits, sc, first, a, POST_NONE, 1.0f)
#else
#define SIMD_SUM(dr, c0, n, bits, sc, first, a) 0
#endif

/* acc[k] = sum over pieces p of deq(input row p * rows + r)[s + k], in block b: the first piece assigned, the
   others added left to right, one rounding per product and per addition (no FMA: -ffp-contract=off).
   Chunk by chunk, all pieces per chunk, so the running sums stay in L1. */
static void sum_range(const job_t* j, int64_t r, int64_t b, int64_t s, int64_t e, float* acc) {
    int8_t tmp[CH];
    for (int64_t c0 = s; c0 < e; c0 += CH) {
        int64_t n = e - c0 < CH ? e - c0 : CH;
        float* a = acc + (c0 - s);
        for (int64_t p = 0; p < j->pieces; p++) {
            int64_t row = p * j->rows + r;
            const uint8_t* dr = j->data + row * j->payload;
            float sc = j->scales[row * j->nb + b];
            int64_t k0 = SIMD_SUM(dr, c0, n, j->bits, sc, p == 0, a);
            const int8_t* c = (const int8_t*)dr + c0;
            if (j->bits == 4) { codes4(dr, c0 + k0, c0 + n, tmp + k0); c = tmp; }
            if (p == 0) for (int64_t k = k0; k < n; k++) a[k] = (float)c[k] * sc;
            else for (int64_t k = k0; k < n; k++) a[k] = a[k] + (float)c[k] * sc;
        }
    }
}

#if ZQ_SIMD
/* qgZ's last step for an int4 block of whole 64-element groups at an even start: simd_sum over the whole block,
   piece by piece, straight into the output row, the divisor applied in the last piece's pass (POST_MUL by
   2^-k for a power of two, as sum_worker does) instead of a pass of its own. Per element the same products,
   additions and final division in the same order as sum_range + sum_worker. Returns 1 (nothing written) for
   other blocks. */
static int table_sum(const job_t* j, int64_t r, int64_t b, int64_t s, int64_t e, float* acc, int pow2,
                     float inv) {
    if (j->bits != 4 || (s & 1) || (e - s) % 64) return 1;
    for (int64_t p = 0; p < j->pieces; p++) {
        int64_t row = p * j->rows + r;
        int post = j->has_div && p == j->pieces - 1 ? (pow2 ? POST_MUL : POST_DIV) : POST_NONE;
        simd_sum(j->data + row * j->payload, s, e - s, 4, j->scales[row * j->nb + b], p == 0, acc, post,
                 pow2 ? inv : j->divisor);
    }
    return 0;
}
#else
#define table_sum(j, r, b, s, e, acc, pow2, inv) 1
#endif

static void* sum_worker(void* p) {
    job_t* j = (job_t*)p;
    /* A divisor 2^k (the world size often is) becomes a multiply by 2^-k: both are one correct rounding of the
       same real number, so the bits are the division's, and a multiply costs a fraction of vdivps. */
    int ex;
    int pow2 = j->has_div && frexpf(j->divisor, &ex) == 0.5f && ex > -125 && ex < 126;
    float inv = pow2 ? 1.0f / j->divisor : 0.0f;
    for (int64_t g = j->g0; g < j->g1; g++) {
        int64_t r = g / j->nb, b = g % j->nb, s = j->starts[b], e = j->starts[b + 1];
        float* acc = (float*)j->y + r * j->numel + s;
        if (!table_sum(j, r, b, s, e, acc, pow2, inv)) continue;
        sum_range(j, r, b, s, e, acc);
        if (pow2)
            for (int64_t k = 0; k < e - s; k++) acc[k] = acc[k] * inv;
        else if (j->has_div)
            for (int64_t k = 0; k < e - s; k++) acc[k] = acc[k] / j->divisor;
    }
    return NULL;
}

/* Sum then requantize one block. A block of at most CH elements (the usual case) is summed once into a stack
   buffer; a longer one in two passes over CH-element chunks (the second recomputes the sums), which keeps
   everything on the stack for any block size. Pass 1 finds max |sum| and whether any sum is inf/nan. */
static int sum_quant_block(const job_t* j, int64_t r, int64_t b, int64_t s, int64_t e, float qmax) {
    float tmp[CH];
    uint32_t m = 0, mf = 0;
    for (int64_t i = s; i < e; i += CH) {
        int64_t n = e - i < CH ? e - i : CH;
        sum_range(j, r, b, i, i + n, tmp);
        for (int64_t k = 0; k < n; k++) { /* two max reductions in a form gcc 12 vectorizes (a ?: select */
            uint32_t a = f2u(tmp[k]) & 0x7FFFFFFFu; /* beside the second reduction kept this loop scalar) */
            uint32_t af = (uint32_t)(a < 0x7F800000u) * a; /* the finite ones; inf/nan count as 0 */
            m = a > m ? a : m;
            mf = af > mf ? af : mf;
        }
    }
    int bad = m >= 0x7F800000u;
    if (bad && !j->poison) return 1;
    float scale = u2f(mf) / qmax;
    float div = divisor_of(scale);
    uint8_t* dr = j->out_data + r * j->out_payload;
    j->out_scales[r * j->nb + b] = bad ? u2f(QNAN_BITS) : scale;
    for (int64_t i = s; i < e; i += CH) {
        int64_t n = e - i < CH ? e - i : CH;
        if (e - s > CH) sum_range(j, r, b, i, i + n, tmp);
        if (bad)
            for (int64_t k = 0; k < n; k++) tmp[k] = (f2u(tmp[k]) & 0x7FFFFFFFu) < 0x7F800000u ? tmp[k] : 0.0f;
        emit_f32(tmp, i, i + n, j->bits, div, qmax, dr);
    }
    return 0;
}

#if ZQ_SIMD
/* Note [split sums]: qgZ's fused middle step for an int4 block of whole 128-element groups at an even start
   (the usual block), in one pass per piece and one over the sums. A byte holds an (even, odd) element pair, so
   each 16 bytes give the even elements' products (low nibbles) and the odd ones' (high nibbles) as two vectors,
   looked up in a table of the block's 16 possible products (n - 8) * sc, each rounded as the scalar loop rounds
   it (vpermps reads only the low 4 bits of each dword index: no masking, sign extension, conversion or
   multiply), and the sums stay in that order in the stack buffer: 32 elements as [16 even | 16 odd]. That is
   the order the code emission pairs them in, so neither the unpacking (sum) nor the deinterleaving (emit)
   shuffles run, and the last piece's pass also takes the max |sum|. Each element gets the same products and
   additions, in the same order, as sum_range, so the bits are the same. Returns 0 when it did the block; 1 to
   leave it to the general path (a non-finite sum, or a subnormal divisor), which recomputes it. */
static int split_sum_quant(const job_t* j, int64_t r, int64_t b, int64_t s, int64_t e, float qmax) {
    float tmp[CH];
    const int64_t n = e - s;
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m = _mm512_setzero_si512();
    for (int64_t p = 0; p < j->pieces; p++) {
        int64_t row = p * j->rows + r;
        const uint8_t* d = j->data + row * j->payload + (s >> 1);
        const __m512 table = product_table(j->scales[row * j->nb + b]);
        const int last = p == j->pieces - 1;
        for (int64_t k = 0; k < n; k += 32) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(d + (k >> 1))));
            __m512 ev = _mm512_permutexvar_ps(bytes, table);
            __m512 od = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
            if (p) {
                ev = _mm512_add_ps(_mm512_loadu_ps(tmp + k), ev);
                od = _mm512_add_ps(_mm512_loadu_ps(tmp + k + 16), od);
            }
            _mm512_storeu_ps(tmp + k, ev);
            _mm512_storeu_ps(tmp + k + 16, od);
            if (last) {
                m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(ev), absmask));
                m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(od), absmask));
            }
        }
    }
    uint32_t mx = (uint32_t)_mm512_reduce_max_epu32(m);
    if (mx >= 0x7F800000u) return 1; /* inf or nan among the sums: the general path poisons or refuses it */
    float scale = u2f(mx) / qmax;
    float div = divisor_of(scale);
    if (!clamp_free(div)) return 1;
    j->out_scales[r * j->nb + b] = scale;
    uint8_t* dr = j->out_data + r * j->out_payload + (s >> 1);
    __m512 vi = _mm512_set1_ps(recip(div));
    for (int64_t k = 0; k < n; k += 128) {
        const float* t = tmp + k;
        vstore64(vpair4(_mm512_loadu_ps(t), _mm512_loadu_ps(t + 16), vi),
                 vpair4(_mm512_loadu_ps(t + 32), _mm512_loadu_ps(t + 48), vi),
                 vpair4(_mm512_loadu_ps(t + 64), _mm512_loadu_ps(t + 80), vi),
                 vpair4(_mm512_loadu_ps(t + 96), _mm512_loadu_ps(t + 112), vi), dr + (k >> 1));
    }
    return 0;
}
#define SPLIT_OK(j, s, e) ((j)->bits == 4 && !((s) & 1) && (e) - (s) <= CH && ((e) - (s)) % 128 == 0)
#else
#define SPLIT_OK(j, s, e) 0
#define split_sum_quant(j, r, b, s, e, qmax) 1
#endif

static void* sum_quant_worker(void* p) {
    job_t* j = (job_t*)p;
    float qmax = j->bits == 8 ? 127.0f : 7.0f;
    j->bad = -1;
    for (int64_t g = j->g0; g < j->g1; g++) {
        int64_t r = g / j->nb, b = g % j->nb, s = j->starts[b], e = j->starts[b + 1];
        if (SPLIT_OK(j, s, e) && !split_sum_quant(j, r, b, s, e, qmax)) continue;
        if (sum_quant_block(j, r, b, s, e, qmax)) { j->bad = g; break; }
    }
    return NULL;
}

#define MAXT 64
#define PARTS_PER_THREAD 8
/* Block index where part k of n begins. For int4 quantize a part begins only at a block with an even start: a
   block with an odd start ORs into the byte its predecessor wrote, so both must be in one part. */
static int64_t split_at(const job_t* j, int64_t k, int64_t n, int even_splits) {
    int64_t total = j->g1;
    if (k >= n) return total;
    int64_t v = total * k / n;
    while (even_splits && v < total && (j->starts[v % j->nb] & 1)) v++;
    return v;
}

/* Runs part k of n; returns the part's first bad block or -1. */
static int64_t run_part(const job_t* base, int64_t k, int64_t n, int even_splits, void* (*fn)(void*)) {
    job_t j = *base;
    j.g0 = split_at(base, k, n, even_splits);
    j.g1 = split_at(base, k + 1, n, even_splits);
    j.bad = -1;
    fn(&j);
    return j.bad;
}

static inline int64_t min_bad(int64_t a, int64_t b) { return a < 0 ? b : (b < 0 || a < b ? a : b); }

typedef struct {
    const job_t* base; int64_t nparts, next, bad; int even_splits; void* (*fn)(void*);
} pool_t;

/* Take parts from a shared counter until none is left (load balance when a core is busy elsewhere). */
static void* pool_worker(void* p) {
    pool_t* w = (pool_t*)p;
    int64_t bad = -1;
    for (;;) {
        int64_t k = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (k >= w->nparts) break;
        bad = min_bad(bad, run_part(w->base, k, w->nparts, w->even_splits, w->fn));
    }
    if (bad >= 0) {
        int64_t cur = __atomic_load_n(&w->bad, __ATOMIC_RELAXED);
        while (min_bad(cur, bad) != cur &&
               !__atomic_compare_exchange_n(&w->bad, &cur, bad, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    return NULL;
}

/* Runs fn over blocks [0, base->g1) on up to nt threads; returns the smallest bad block index or -1.
   With OpenMP the threads are the process's OpenMP pool, which is torch's own when torch uses libgomp.so.1
   (shared by soname): a private pthread pool would fight torch's still-spinning OpenMP workers for the cores
   right after every torch op (measured: 1.6x slower on 2 cores). pthreads are the fallback. */
static int64_t run(job_t* base, int nt, int even_splits, void* (*fn)(void*)) {
    if (nt > MAXT) nt = MAXT;
    int64_t nparts = (int64_t)nt * PARTS_PER_THREAD;
    if (nparts > base->g1) nparts = base->g1;
    if (nt <= 1 || nparts <= 1) return run_part(base, 0, 1, even_splits, fn);
    pool_t w = {base, nparts, 0, -1, even_splits, fn};
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    pool_worker(&w);
#else
    pthread_t th[MAXT];
    int started[MAXT];
    for (int t = 1; t < nt; t++) started[t] = pthread_create(&th[t], NULL, pool_worker, &w) == 0;
    pool_worker(&w);
    for (int t = 1; t < nt; t++)
        if (started[t]) pthread_join(th[t], NULL);
#endif
    return w.bad;
}

int zq_abi(void) { return 3; }
int zq_simd(void) { return ZQ_SIMD; } /* 1 when the AVX-512 body is built in */

/* Returns -1, or the row-major index (row * nb + block) of the first block holding inf/nan (never with poison). */
int64_t zq_quantize(const void* x, int dt, int64_t G, int64_t numel, const int64_t* starts, int64_t nb, int bits,
                    uint8_t* data, int64_t payload, float* scales, int poison, int nthreads) {
    job_t j = {x, NULL, data, scales, dt, bits, numel, nb, payload, starts, 0, G * nb, -1, poison};
    return run(&j, nthreads, bits == 4, quant_worker);
}

void zq_dequantize(const uint8_t* data, const float* scales, int64_t G, int64_t numel, const int64_t* starts,
                   int64_t nb, int bits, int64_t payload, void* y, int dt, int nthreads) {
    job_t j = {NULL, y, (uint8_t*)data, (float*)scales, dt, bits, numel, nb, payload, starts, 0, G * nb, -1, 0};
    run(&j, nthreads, 0, dequant_worker);
}

/* y [R, numel] fp32 = sum over pieces of the dequantized rows [pieces, R] (divided by divisor when has_div). */
void zq_dequantize_sum(const uint8_t* data, const float* scales, int64_t pieces, int64_t R, int64_t numel,
                       const int64_t* starts, int64_t nb, int bits, int64_t payload, float* y, int has_div,
                       float divisor, int nthreads) {
    job_t j = {NULL, y, (uint8_t*)data, (float*)scales, DT_F32, bits, numel, nb, payload, starts, 0, R * nb, -1, 0,
               pieces, R, divisor, has_div, NULL, NULL, 0};
    run(&j, nthreads, 0, sum_worker);
}

/* The sums above (no divisor) requantized into out_data / out_scales; returns as zq_quantize. */
int64_t zq_dequantize_sum_quantize(const uint8_t* data, const float* scales, int64_t pieces, int64_t R,
                                   int64_t numel, const int64_t* starts, int64_t nb, int bits, int64_t payload,
                                   uint8_t* out_data, int64_t out_payload, float* out_scales, int poison,
                                   int nthreads) {
    job_t j = {NULL, NULL, (uint8_t*)data, (float*)scales, DT_F32, bits, numel, nb, payload, starts, 0, R * nb, -1,
               poison, pieces, R, 1.0f, 0, out_data, out_scales, out_payload};
    return run(&j, nthreads, bits == 4, sum_quant_worker);
}
"""
