"""Fast CPU path for the block-wise quantizers: same signatures as ``blockwise.py``, bit-identical results.

Why a small C kernel and not torch ops or ``torch.compile``: the spec takes ~10 full-size passes over memory
(cast, abs, amax, divide, round, clamp, cast, pack, ...) and runs at a few percent of copy bandwidth; inductor
fuses it but measured ~8x slower than this kernel on the 2-core CI machine and costs ~20 s of cold compile
per shape (docs/benchmarks.md, "Quantizer kernels"). The kernel makes one pass per block while the block sits
in L1: max |x| on the integer bit patterns (which also detects inf/nan: their exponent bits are all ones),
then divide / round-half-even / clamp (Note [clamp-free codes]) / pack. Rows x blocks are split over
``torch.get_num_threads()`` threads of the OpenMP pool (torch's own libgomp, shared by soname; pthreads when
torch does not use ``libgomp.so.1``, or with ``ZEROPP_QUANT_OPENMP=0``). It is plain C99 (no torch headers), so
it builds in about a second. On AVX-512 machines the int4 code emission and qgZ's dequantize-and-add loop have
intrinsics bodies (fewer shuffles than gcc's vectorization of the portable loops); ``ZEROPP_QUANT_SIMD=0``
builds without them.

Bit-identity with the spec rests on: exact IEEE fp32 division (no ``-ffast-math``, no FMA contraction),
``rintf`` (round half to even, as ``torch.round``), and the same round-to-nearest-even fp32->bf16/fp16
conversions as c10. A self-test against the spec runs once after loading; any mismatch disables the path.

qgZ's reduction steps (``dequantize_sum``, ``dequantize_sum_quantize``) sum the pieces chunk by chunk in the
spec's order (left to right, fp32, no FMA) while the running sums sit in L1; the fused step requantizes a
block straight from those sums (one pass for blocks of up to 2048 elements) without writing them to memory.

Rule for the functions here (``dispatch.py`` calls them for everything but CUDA tensors): the kernel runs for
CPU tensors of float32 / bfloat16 / float16 when it built and passed its self-test; everything else (no C
compiler, ``ZEROPP_QUANT_FAST=0`` in the environment) goes to the spec. Data rows may sit apart (each row
contiguous, e.g. the data part of a wire buffer): the kernel takes a row stride. The shared library is cached in
``$ZEROPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/zeropp`` / ``~/.cache/zeropp``, keyed by a hash of the source,
flags and CPU, and written atomically so concurrent ranks may race to build it safely.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import torch

from zeropp import native

from . import blockwise as spec
from .blockwise import QuantizedRows
from .layout import BlockLayout, layout_index, payload_bytes

__all__ = ["dequantize", "dequantize_sum", "dequantize_sum_quantize", "fast_available", "quantize", "simd_built"]

_C_SOURCE = r"""
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
static inline int8_t qcode(float v, float div, float qmax) {
    float t = rintf(v / div); /* true division, round half to even */
    t = t < -qmax ? -qmax : t;
    t = t > qmax ? qmax : t;
    return (int8_t)(int32_t)t;
}

/* Note [clamp-free codes]: when div is normal the clamp in qcode never acts, so the hot loops leave it out
   (it cost about a fifth of quantize). div = RN(m / qmax) for the block's largest finite |x| = m, within a
   relative 2^-24 of m / qmax when normal, so every |x| <= m gives |x / div| <= qmax (1 + 2^-23) and
   rintf(RN(x / div)) lies in [-qmax, qmax]. A subnormal div (m below about 1e-37) can be far off m / qmax, and
   there the clamp stays. div = 1 (an all-zero block) is normal too. */
static inline int clamp_free(float div) { return div >= 0x1p-126f; }

/* Codes of n consecutive elements. (A reciprocal multiply with an exact fallback near rounding boundaries was
   tried, scalar and with AVX-512: bit-identical but no faster here than the vectorized division.) */
#define DEFINE_CODES(SUF, T, LOADF)                                                                  \
static void codes_##SUF(const T* x, int64_t n, float div, float qmax, int8_t* out) {                 \
    if (clamp_free(div))                                                                             \
        for (int64_t k = 0; k < n; k++) out[k] = (int8_t)(int32_t)rintf(LOADF(x[k]) / div);          \
    else                                                                                             \
        for (int64_t k = 0; k < n; k++) out[k] = qcode(LOADF(x[k]), div, qmax);                      \
}

#if ZQ_SIMD
/* int4 codes of 128 elements, two per byte, with few shuffles (costly at zmm width on Zen 4): each
   dword of 32 loaded bits holds an (even, odd) element pair, so the even and odd elements come out as two fp32
   vectors and their codes combine in place into the pair's byte, (c_even + 8) | (c_odd + 8) << 4; four such
   vectors narrow with two in-lane packs and one dword permute. Rounding: vcvtps2dq with round-to-nearest-even,
   as rintf; the division is IEEE. Clamp-free only (Note [clamp-free codes]). */
static inline __m512i vpair4(__m512 ev, __m512 od, __m512 vd) {
    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i ce = _mm512_cvt_roundps_epi32(_mm512_div_ps(ev, vd), rne);
    __m512i co = _mm512_cvt_roundps_epi32(_mm512_div_ps(od, vd), rne);
    const __m512i eight = _mm512_set1_epi32(8);
    return _mm512_or_si512(_mm512_add_epi32(ce, eight), _mm512_slli_epi32(_mm512_add_epi32(co, eight), 4));
}
static inline void vstore64(__m512i b0, __m512i b1, __m512i b2, __m512i b3, uint8_t* o) {
    __m512i b = _mm512_packus_epi16(_mm512_packs_epi32(b0, b1), _mm512_packs_epi32(b2, b3));
    /* 128-bit lane l now holds dwords [b0's lane l, b1's, b2's, b3's]: transpose 4x4 dwords */
    const __m512i t = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512((void*)o, _mm512_permutexvar_epi32(t, b));
}
static inline __m512i vbf16_pairs(const uint16_t* x, __m512 vd) {
    __m512i w = _mm512_loadu_si512((const void*)x);
    __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    __m512 od = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    return vpair4(ev, od, vd);
}
static inline __m512i vf32_pairs(const float* x, __m512 vd) {
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return vpair4(_mm512_permutex2var_ps(a, ie, b), _mm512_permutex2var_ps(a, io, b), vd);
}
/* Codes of xb[i - s ..) for row elements [i, e) (i even) into dr, 128 at a time; returns where it stopped. */
#define DEFINE_SIMD4(SUF, T, PAIRS)                                                                  \
static int64_t simd4_##SUF(const T* xb, int64_t s, int64_t i, int64_t e, float div, uint8_t* dr) {   \
    if (!clamp_free(div)) return i;                                                                  \
    __m512 vd = _mm512_set1_ps(div);                                                                 \
    for (; i + 128 <= e; i += 128) {                                                                 \
        const T* x = xb + (i - s);                                                                   \
        vstore64(PAIRS(x, vd), PAIRS(x + 32, vd), PAIRS(x + 64, vd), PAIRS(x + 96, vd), dr + (i >> 1));\
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
        dr[i >> 1] |= (uint8_t)((qcode(LOADF(xb[0]), div, qmax) + 8) << 4);                         \
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
    float div = scale == 0.0f ? 1.0f : scale;                                                        \
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
    float div = scale == 0.0f ? 1.0f : scale;                                                        \
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
/* a[k] = (or +=) code k * sc for the leading elements of the n at row element c0 of payload row dr, 64 (int4)
   or 16 (int8) at a time; returns how many it did (none from an odd int4 element). int4: 32 bytes split into
   low and high nibbles and interleaved per 128-bit lane, then one sign extension to int32 per 16 codes (gcc's
   loop takes two, int8 -> int16 -> int32, each a shuffle). The products and sums are the scalar loop's. */
static int64_t simd_sum(const uint8_t* dr, int64_t c0, int64_t n, int bits, float sc, int first, float* a) {
    const __m512 vs = _mm512_set1_ps(sc);
    int64_t k = 0;
#define ZQ_ACC(CODES, OFF)                                                                           \
    do {                                                                                             \
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(CODES)), vs);               \
        float* o = a + k + (OFF);                                                                    \
        _mm512_storeu_ps(o, first ? v : _mm512_add_ps(_mm512_loadu_ps(o), v));                       \
    } while (0)
    if (bits == 8) {
        for (; k + 16 <= n; k += 16) ZQ_ACC(_mm_loadu_si128((const __m128i*)(dr + c0 + k)), 0);
        return k;
    }
    if (c0 & 1) return 0;
    const uint8_t* d = dr + (c0 >> 1);
    const __m256i m15 = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    for (; k + 64 <= n; k += 64) {
        __m256i b = _mm256_loadu_si256((const __m256i*)(d + (k >> 1)));
        __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, m15), eight);
        __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m15), eight);
        __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi); /* 0-15|32-47, 16-31|48-63 */
        ZQ_ACC(_mm256_castsi256_si128(u0), 0);
        ZQ_ACC(_mm256_castsi256_si128(u1), 16);
        ZQ_ACC(_mm256_extracti128_si256(u0, 1), 32);
        ZQ_ACC(_mm256_extracti128_si256(u1, 1), 48);
    }
#undef ZQ_ACC
    return k;
}
#define SIMD_SUM(dr, c0, n, bits, sc, first, a) simd_sum(dr, c0, n, bits, sc, first, a)
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
    float div = scale == 0.0f ? 1.0f : scale;
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

static void* sum_quant_worker(void* p) {
    job_t* j = (job_t*)p;
    float qmax = j->bits == 8 ? 127.0f : 7.0f;
    j->bad = -1;
    for (int64_t g = j->g0; g < j->g1; g++) {
        int64_t r = g / j->nb, b = g % j->nb;
        if (sum_quant_block(j, r, b, j->starts[b], j->starts[b + 1], qmax)) { j->bad = g; break; }
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

# Exactness needs IEEE semantics: no fast-math, no FMA contraction. -fno-strict-aliasing: the kernel reads
# float buffers through integer pointers.
_BASE_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math",
               "-fno-strict-aliasing"]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many elements per thread, waking another thread costs more than it saves.
_MIN_ELEMS_PER_THREAD = 1 << 18

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    """Build (or find cached) and load the first flag variant that compiles and loads (the OpenMP build may
    compile yet fail to load); build and cache rules are ``zeropp.native``'s."""
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    base = _BASE_FLAGS + (["-DZQ_NO_SIMD"] if os.environ.get("ZEROPP_QUANT_SIMD", "1") == "0" else [])
    for extra in native.openmp_variants("ZEROPP_QUANT_OPENMP"):
        so = native.build_shared_library("quant", _C_SOURCE, base, [extra])
        if so is None:
            continue
        try:
            lib = ctypes.CDLL(so)
        except OSError:
            continue
        if lib.zq_abi() != 3:
            continue
        lib.zq_quantize.restype = i64
        lib.zq_quantize.argtypes = [ptr, i32, i64, i64, ptr, i64, i32, ptr, i64, ptr, i32, i32]
        lib.zq_dequantize.restype = None
        lib.zq_dequantize.argtypes = [ptr, ptr, i64, i64, ptr, i64, i32, i64, ptr, i32, i32]
        lib.zq_dequantize_sum.restype = None
        lib.zq_dequantize_sum.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i32, i64, ptr, i32,
                                          ctypes.c_float, i32]
        lib.zq_dequantize_sum_quantize.restype = i64
        lib.zq_dequantize_sum_quantize.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i32, i64, ptr, i64, ptr, i32,
                                                   i32]
        return lib
    return None


def _self_test() -> bool:
    """Compare against the spec on small multi-segment cases (odd starts, short blocks, a zero segment), one
    with blocks long enough for the SIMD body (128 elements a step) and odd starts before and inside it."""
    gen = torch.Generator().manual_seed(0)
    for layout in (BlockLayout((5, 0, 67, 32, 1, 4000), 16), BlockLayout((3, 700, 0, 1025, 513), 256)):
        x = torch.randn(4, layout.numel, generator=gen) * torch.logspace(-3, 3, layout.numel)
        x[1, 5:72] = 0.0
        if not _agrees_with_spec(x, layout):
            return False
    return True


def _agrees_with_spec(x: torch.Tensor, layout: BlockLayout) -> bool:
    for dtype in _DTYPE_CODE:
        xd = x.to(dtype)
        for bits in (8, 4):
            a, b = _quantize_c(xd, layout, bits, None, False), spec.quantize(xd, layout, bits)
            if not (torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)):
                return False
            for out_dtype in _DTYPE_CODE:
                if not torch.equal(_dequantize_c(b, layout, bits, out_dtype, None),
                                   spec.dequantize(b, layout, bits, out_dtype)):
                    return False
            if dtype != torch.float32:
                continue
            for divisor in (3.0, 4.0):  # a true division, and a power of two (a multiply in the kernel)
                if not torch.equal(_dequantize_sum_c(b, layout, bits, 2, None, divisor),
                                   spec.dequantize_sum(b, layout, bits, 2, divisor=divisor)):
                    return False
            c = _sum_quantize_c(b, layout, bits, 2, None, False)
            d = spec.dequantize_sum_quantize(b, layout, bits, 2)
            if not (torch.equal(c.data, d.data) and torch.equal(c.scales, d.scales)):
                return False
    return True


def fast_available() -> bool:
    """True when the C kernel is built, loaded and passed its self-test (builds it on the first call)."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            lib = None
            if os.environ.get("ZEROPP_QUANT_FAST", "1") != "0":
                try:
                    lib = _load()
                except Exception as e:  # noqa: BLE001 - any failure means: use the spec
                    warnings.warn(f"zeropp.quant: fast kernel unavailable ({e}); using the reference path")
            _lib = lib
            if lib is not None:
                try:
                    ok = _self_test()
                except Exception:  # noqa: BLE001
                    ok = False
                if not ok:
                    warnings.warn("zeropp.quant: fast kernel disagrees with the reference; using the reference")
                    _lib = None
            _tried = True
    return _lib is not None


def simd_built() -> bool:
    """True when the loaded kernel has its AVX-512 body (an AVX-512 machine, and ``ZEROPP_QUANT_SIMD`` not 0)."""
    return fast_available() and bool(_lib.zq_simd())


def _threads(elems: int) -> int:
    return max(1, min(torch.get_num_threads(), elems // _MIN_ELEMS_PER_THREAD))


def _starts(layout: BlockLayout) -> torch.Tensor:
    return layout_index(layout, torch.device("cpu")).block_starts


def _dense_rows(data: torch.Tensor) -> torch.Tensor:
    """``data`` itself when the kernel can address it by one row stride (rows in place), else a copy."""
    return data if spec.rows_dense(data) else data.contiguous()


def _empty_rows(g: int, layout: BlockLayout, bits: int) -> QuantizedRows:
    return QuantizedRows(torch.empty(g, payload_bytes(layout, bits), dtype=torch.uint8),
                         torch.empty(g, layout.num_blocks, dtype=torch.float32))


def _quantize_c(x: torch.Tensor, layout: BlockLayout, bits: int, out: QuantizedRows | None,
                poison: bool) -> QuantizedRows:
    x = x.detach().contiguous()
    g, nb = x.shape[0], layout.num_blocks
    data, scales = _empty_rows(g, layout, bits) if out is None else out
    if g * nb == 0:
        return QuantizedRows(data, scales)
    starts = _starts(layout)
    bad = _lib.zq_quantize(x.data_ptr(), _DTYPE_CODE[x.dtype], g, layout.numel, starts.data_ptr(), nb, bits,
                           data.data_ptr(), data.stride(0), scales.data_ptr(), int(poison), _threads(x.numel()))
    if bad >= 0:
        spec.raise_non_finite(bad, layout)
    return QuantizedRows(data, scales) if out is None else out


def _dequantize_c(q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype,
                  out: torch.Tensor | None) -> torch.Tensor:
    g = q.data.shape[0]
    y = torch.empty(g, layout.numel, dtype=dtype) if out is None else out
    if g * layout.num_blocks == 0:
        return y
    data, scales = _dense_rows(q.data), q.scales.contiguous()
    _lib.zq_dequantize(data.data_ptr(), scales.data_ptr(), g, layout.numel, _starts(layout).data_ptr(),
                       layout.num_blocks, bits, data.stride(0), y.data_ptr(), _DTYPE_CODE[dtype],
                       _threads(y.numel()))
    return y


def _dequantize_sum_c(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None,
                      divisor: float | None) -> torch.Tensor:
    rows = q.data.shape[0] // pieces
    y = torch.empty(rows, layout.numel, dtype=torch.float32) if out is None else out
    if rows * layout.num_blocks == 0:
        return y
    data, scales = _dense_rows(q.data), q.scales.contiguous()
    _lib.zq_dequantize_sum(data.data_ptr(), scales.data_ptr(), pieces, rows, layout.numel,
                           _starts(layout).data_ptr(), layout.num_blocks, bits, data.stride(0), y.data_ptr(),
                           int(divisor is not None), 1.0 if divisor is None else divisor,
                           _threads(q.data.shape[0] * layout.numel))
    return y


def _sum_quantize_c(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: QuantizedRows | None,
                    poison: bool) -> QuantizedRows:
    rows = q.data.shape[0] // pieces
    res = _empty_rows(rows, layout, bits) if out is None else out
    if rows * layout.num_blocks == 0:
        return res
    data, scales = _dense_rows(q.data), q.scales.contiguous()
    bad = _lib.zq_dequantize_sum_quantize(data.data_ptr(), scales.data_ptr(), pieces, rows, layout.numel,
                                          _starts(layout).data_ptr(), layout.num_blocks, bits, data.stride(0),
                                          res.data.data_ptr(), res.data.stride(0), res.scales.data_ptr(),
                                          int(poison), _threads(q.data.shape[0] * layout.numel))
    if bad >= 0:
        spec.raise_non_finite(bad, layout)
    return res


def _all_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


KERNEL_BITS = (8, 4)  # the widths the C and Triton kernels pack; int2 runs the spec (``blockwise.py``)


def _kernel_bits(bits: int) -> bool:
    return bits in KERNEL_BITS


def quantize(x: torch.Tensor, layout: BlockLayout, bits: int, out: QuantizedRows | None = None, *,
             poison: bool = False) -> QuantizedRows:
    """Same contract as ``blockwise.quantize``; uses the C kernel for CPU inputs when available."""
    spec.check_bits(bits)
    rows = spec.as_rows(x, layout)
    if out is not None:
        spec.check_quantize_out(out, rows.shape[0], layout, bits)
    on_cpu = _all_cpu(rows, *(out if out is not None else ()))
    if not on_cpu or not fast_available() or not _kernel_bits(bits):
        return spec.quantize(x, layout, bits, out, poison=poison)
    return _quantize_c(rows, layout, bits, out, poison)


def dequantize(q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``blockwise.dequantize``; uses the C kernel for CPU inputs when available."""
    g = spec.check_dequantize_args(q, layout, bits, dtype)
    if out is not None:
        spec.check_out(out, g, layout, dtype)
    if not _all_cpu(q.data, q.scales, out) or not fast_available() or not _kernel_bits(bits):
        return spec.dequantize(q, layout, bits, dtype, out)
    return _dequantize_c(q, layout, bits, dtype, out)


def dequantize_sum(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None = None,
                   divisor: float | None = None) -> torch.Tensor:
    """Same contract as ``blockwise.dequantize_sum``; uses the C kernel for CPU inputs when available."""
    rows, div = spec.check_sum_args(q, layout, bits, pieces, out, divisor)
    if not _all_cpu(q.data, q.scales, out) or not fast_available() or not _kernel_bits(bits):
        return spec.dequantize_sum(q, layout, bits, pieces, out, divisor)
    return _dequantize_sum_c(q, layout, bits, pieces, out, div)


def dequantize_sum_quantize(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int,
                            out: QuantizedRows | None = None, *, poison: bool = False) -> QuantizedRows:
    """Same contract as ``blockwise.dequantize_sum_quantize``; one fused C pass for CPU inputs when available."""
    g = spec.check_dequantize_args(q, layout, bits, torch.float32)
    rows = spec.check_pieces(g, pieces)
    if out is not None:
        spec.check_quantize_out(out, rows, layout, bits)
    on_cpu = _all_cpu(q.data, q.scales, *(out if out is not None else ()))
    if not on_cpu or not fast_available() or not _kernel_bits(bits):
        return spec.dequantize_sum_quantize(q, layout, bits, pieces, out, poison=poison)
    return _sum_quantize_c(q, layout, bits, pieces, out, poison)
