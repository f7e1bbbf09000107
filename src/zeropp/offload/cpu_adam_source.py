"""The C source of ``CpuAdam``'s kernel (``cpu_adam.py`` builds it at first use through ``native.py``)."""
from zeropp import native

C_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ZA_VEC 1
#else
#define ZA_VEC 0
#endif
#if ZA_VEC && defined(__AVX512F__)
#define ZA_VEC512 1 /* 16 lanes: fewer instructions per element than 8 (same per-lane operations) */
#else
#define ZA_VEC512 0
#endif

/* sqrt modes: IEEE sqrt; MKL_SSE: MKL VML's SSE HA vsSqrt algorithm, re-implemented (see emu8); MKL_CALL:
   call MKL's exported vmsSqrt_64 on L1-sized chunks (exact for any MKL code path, but a second pass). */
enum { SQ_IEEE = 0, SQ_MKL_SSE = 1, SQ_MKL_CALL = 2, SQ_FAST = 3 /* not torch's sequence: see stepw */ };
/* MKL VML: void vmsSqrt_64(MKL_INT64 n, const float* a, float* r, MKL_INT64 mode). */
typedef void (*sqrt_fn_t)(int64_t, const float*, float*, int64_t);
#define VML_MODE ((int64_t)(0x2 | 0x140000 | 0x100)) /* VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: torch's */
#define CH 2048
#define PART_ALIGN 64
#define MAXT 64
#define PARTS_PER_THREAD 8

""" + native.C_FLOAT_BITS + r"""
typedef struct {
    int64_t nt;
    float* const* p; const float* const* g; float* const* m; float* const* v; void* const* o16;
    const int64_t* offs;                       /* nt + 1 prefix sums of the element counts */
    const float* neg_step; const float* bc2s;  /* per tensor: f32(-lr/bc1), f32(sqrt(bc2)) */
    float decay, l2wd, w, beta2, omb2, eps;
    int l2, out_dt, sqrt_mode;                 /* out_dt: 0 none, 1 bf16, 2 fp16 */
    sqrt_fn_t sq;
    int64_t nparts, next;
} job_t;

#if ZA_VEC
/* MKL VML's SSE "HA" single-precision sqrt (mkl_vml_kernel_sSqrt_EXHAynn, the path MKL takes for torch.sqrt on
   AVX-512 AMD CPUs), step for step: y = rsqrtps(x); s = x*y; h = 0.5*y; e = 0.5 - s*h; s1 = s*e + s;
   h1 = e*h + h; d = x - s1*s1; r = d*h1 + s1 (no FMAs). Zero, subnormal, huge (> 0x7f7ff000), inf, nan and
   negative inputs take MKL's scalar "rare" path, which returns the IEEE result. Verified against vmsSqrt on
   all 2^32 inputs on the machine it was written on; the library's self-test re-checks it against torch.sqrt
   on every load and picks another mode when it disagrees. */
static inline __m256 sqrt_mkl_sse(__m256 x) {
    const __m256 half = _mm256_set1_ps(0.5f);
    __m256i t = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000));
    __m256i rare = _mm256_cmpgt_epi32(t, _mm256_set1_epi32((int)0xfefff000));
    __m256 y = _mm256_rsqrt_ps(x);
    __m256 s = _mm256_mul_ps(x, y);
    __m256 h = _mm256_mul_ps(y, half);
    __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
    __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
    __m256 h1 = _mm256_add_ps(_mm256_mul_ps(e, h), h);
    __m256 d = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
    __m256 r = _mm256_add_ps(_mm256_mul_ps(d, h1), s1);
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(rare))) return r; /* the common case: no rare lane */
    return _mm256_blendv_ps(r, _mm256_sqrt_ps(x), _mm256_castsi256_ps(rare));
}

static inline __m128i bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                       _mm256_set1_epi32(0x7F800000));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), isnan);
    r = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));
}

#if ZA_VEC512
#define W 16
typedef __m512 vf;
#define V(op) _mm512_##op
/* sqrt_mkl_sse on 16 lanes: rsqrtps has no 512-bit form with the same table, so only it runs on two halves. */
static inline vf sqrt_mkl_sse_v(vf x) {
    const vf half = _mm512_set1_ps(0.5f);
    __mmask16 rare = _mm512_cmpgt_epi32_mask(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000)),
                                             _mm512_set1_epi32((int)0xfefff000));
    __m256 ylo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x)), yhi = _mm256_rsqrt_ps(_mm512_extractf32x8_ps(x, 1));
    vf y = _mm512_insertf32x8(_mm512_castps256_ps512(ylo), yhi, 1);
    vf s = _mm512_mul_ps(x, y);
    vf h = _mm512_mul_ps(y, half);
    vf e = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
    vf s1 = _mm512_add_ps(_mm512_mul_ps(s, e), s);
    vf h1 = _mm512_add_ps(_mm512_mul_ps(e, h), h);
    vf d = _mm512_sub_ps(x, _mm512_mul_ps(s1, s1));
    vf r = _mm512_add_ps(_mm512_mul_ps(d, h1), s1);
    return rare ? _mm512_mask_sqrt_ps(r, rare, x) : r;
}
static inline void store16(uint16_t* o, vf x, int out) {
#if defined(__AVX512BF16__)
    /* vcvtneps2bf16 rounds to nearest even like torch but reads denormal inputs as zero: vectors holding
       one (rare) take the integer path below. A NaN stays a NaN either way (its bit pattern may differ
       from torch's cast, which itself writes 0xFFFF in vector lanes and 0x7FC0 in scalar tails). */
    if (out == 1 && !_mm512_fpclass_ps_mask(x, 0x20)) { /* no denormal lane */
        _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(x));
        return;
    }
#endif
    if (out == 1) {
        __m512i u = _mm512_castps_si512(x);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((__m256i*)o, _mm512_cvtepi32_epi16(r));
    } else if (out == 2) {
        _mm256_storeu_si256((__m256i*)o, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
}
#else
#define W 8
typedef __m256 vf;
#define V(op) _mm256_##op
static inline vf sqrt_mkl_sse_v(vf x) { return sqrt_mkl_sse(x); }
static inline void store16(uint16_t* o, vf x, int out) {
    if (out == 1) _mm_storeu_si128((__m128i*)o, bf16x8(x));
    else if (out == 2) _mm_storeu_si128((__m128i*)o, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
#endif

typedef struct { vf decay, l2wd, w, wm1, b2, omb2, eps, ns, bc2s; } vconst_t;

/* W elements: torch's per-element operations in torch's order (Note [bit-exact with torch]). The int
   arguments are literal constants at every call site, so each specialization is branch-free. */
static inline __attribute__((always_inline)) void stepw(const vconst_t* c, float* p, const float* g, float* m,
                                                        float* v, uint16_t* o, int sq, int out, int l2, int small) {
    vf pp = V(loadu_ps)(p), gg = V(loadu_ps)(g), mm = V(loadu_ps)(m), vv = V(loadu_ps)(v);
    pp = V(mul_ps)(pp, c->decay);
    if (l2) gg = V(fmadd_ps)(pp, c->l2wd, gg);
    vf d = V(sub_ps)(gg, mm);
    mm = small ? V(fmadd_ps)(c->w, d, mm) : V(fmadd_ps)(c->wm1, d, gg);
    vv = V(fmadd_ps)(V(mul_ps)(c->omb2, gg), gg, V(mul_ps)(vv, c->b2));
    if (sq == SQ_FAST) { /* exact=False: DeepSpeed's shorter sequence, bc2s holds 1/sqrt(bc2) (~1.4x less work) */
        vf den = V(fmadd_ps)(V(sqrt_ps)(vv), c->bc2s, c->eps);
        pp = V(fmadd_ps)(c->ns, V(div_ps)(mm, den), pp);
    } else {
        vf s = sq == SQ_MKL_SSE ? sqrt_mkl_sse_v(vv) : V(sqrt_ps)(vv);
        vf den = V(add_ps)(V(div_ps)(s, c->bc2s), c->eps);
        pp = V(add_ps)(pp, V(div_ps)(V(mul_ps)(c->ns, mm), den));
    }
    V(storeu_ps)(p, pp);
    V(storeu_ps)(m, mm);
    V(storeu_ps)(v, vv);
    store16(o, pp, out);
}

#define LOOP(SQ, OUT, L2, SMALL)                                                                      \
    for (; i + 2 * W <= n; i += 2 * W) { /* unrolled: two independent dependency chains (+5%) */     \
        stepw(&c, p + i, g + i, m + i, v + i, o + i, SQ, OUT, L2, SMALL);                             \
        stepw(&c, p + i + W, g + i + W, m + i + W, v + i + W, o + i + W, SQ, OUT, L2, SMALL);         \
    }                                                                                                 \
    for (; i + W <= n; i += W) stepw(&c, p + i, g + i, m + i, v + i, o + i, SQ, OUT, L2, SMALL);      \
    if (i < n) { /* the tail goes through the same W-lane code, padded */                             \
        int64_t r = n - i;                                                                            \
        float tp[W] = {0}, tg[W] = {0}, tm[W] = {0}, tv[W] = {0};                                     \
        uint16_t to[W];                                                                               \
        memcpy(tp, p + i, r * 4); memcpy(tg, g + i, r * 4); memcpy(tm, m + i, r * 4);                 \
        memcpy(tv, v + i, r * 4);                                                                     \
        stepw(&c, tp, tg, tm, tv, to, SQ, OUT, L2, SMALL);                                            \
        memcpy(p + i, tp, r * 4); memcpy(m + i, tm, r * 4); memcpy(v + i, tv, r * 4);                 \
        if (OUT) memcpy(o + i, to, r * 2);                                                            \
    }                                                                                                 \
    return;
#define CASES_SMALL(SQ, OUT, L2) if (small) { LOOP(SQ, OUT, L2, 1) } else { LOOP(SQ, OUT, L2, 0) }
#define CASES_L2(SQ, OUT) if (j->l2) { CASES_SMALL(SQ, OUT, 1) } else { CASES_SMALL(SQ, OUT, 0) }
#define CASES_OUT(SQ)                                                                                 \
    if (j->out_dt == 1) { CASES_L2(SQ, 1) } else if (j->out_dt == 2) { CASES_L2(SQ, 2) } else { CASES_L2(SQ, 0) }

/* One pass over [off, off + n) of tensor t. */
static void range_vec(const job_t* j, int64_t t, int64_t off, int64_t n) {
    float* p = j->p[t] + off; const float* g = j->g[t] + off; float* m = j->m[t] + off; float* v = j->v[t] + off;
    uint16_t* o = j->out_dt ? (uint16_t*)j->o16[t] + off : NULL;
    const vconst_t c = {V(set1_ps)(j->decay), V(set1_ps)(j->l2wd), V(set1_ps)(j->w), V(set1_ps)(j->w - 1.0f),
                        V(set1_ps)(j->beta2), V(set1_ps)(j->omb2), V(set1_ps)(j->eps),
                        V(set1_ps)(j->neg_step[t]), V(set1_ps)(j->bc2s[t])};
    const int small = fabsf(j->w) < 0.5f;
    int64_t i = 0;
    if (j->sqrt_mode == SQ_FAST) { CASES_OUT(SQ_FAST) }
    if (j->sqrt_mode == SQ_MKL_SSE) { CASES_OUT(SQ_MKL_SSE) } else { CASES_OUT(SQ_IEEE) }
}
#endif

/* Portable path: the same operations on scalars, chunked so that MKL's sqrt can be called on a chunk
   between the moment pass and the update pass (SQ_MKL_CALL), or IEEE sqrtf. */
#define MOMENTS(GEXPR, MEXPR)                                                                        \
    for (int64_t i = 0; i < n; i++) {                                                                \
        float gg = GEXPR, mm = m[i], d = gg - mm;                                                    \
        m[i] = MEXPR;                                                                                \
        float vv = v[i] * b2;                                                                        \
        v[i] = fmaf(omb2 * gg, gg, vv);                                                              \
    }
#define UPDATE(STORE16)                                                                              \
    for (int64_t i = 0; i < n; i++) {                                                                \
        float den = s[i] / bc2s + eps;                                                               \
        float pp = p[i] * decay;                                                                     \
        pp = pp + (ns * m[i]) / den;                                                                 \
        p[i] = pp;                                                                                   \
        STORE16;                                                                                     \
    }

static void chunk_scalar(const job_t* j, int64_t t, int64_t off, int64_t n) {
    float* restrict p = j->p[t] + off;
    const float* restrict g = j->g[t] + off;
    float* restrict m = j->m[t] + off;
    float* restrict v = j->v[t] + off;
    float s[CH] __attribute__((aligned(64)));
    const float decay = j->decay, l2wd = j->l2wd, w = j->w, wm1 = w - 1.0f, b2 = j->beta2, omb2 = j->omb2;
    const float eps = j->eps, ns = j->neg_step[t], bc2s = j->bc2s[t];
    const int small = fabsf(w) < 0.5f;
    /* In L2 mode decay is 1, so reading p here (before its update) is torch's order. */
    if (j->l2) {
        if (small) { MOMENTS(fmaf(p[i], l2wd, g[i]), fmaf(w, d, mm)) }
        else { MOMENTS(fmaf(p[i], l2wd, g[i]), fmaf(wm1, d, gg)) }
    } else {
        if (small) { MOMENTS(g[i], fmaf(w, d, mm)) }
        else { MOMENTS(g[i], fmaf(wm1, d, gg)) }
    }
    if (j->sqrt_mode == SQ_MKL_CALL && j->sq) j->sq(n, v, s, VML_MODE);
    else for (int64_t i = 0; i < n; i++) s[i] = sqrtf(v[i]);
    if (j->out_dt == 1) {
        uint16_t* restrict o = (uint16_t*)j->o16[t] + off;
        UPDATE(o[i] = f2bf(pp))
    } else if (j->out_dt == 2) {
        uint16_t* restrict o = (uint16_t*)j->o16[t] + off;
        UPDATE(o[i] = f2h(pp))
    } else {
        UPDATE((void)0)
    }
}

static void range_any(const job_t* j, int64_t t, int64_t s, int64_t e) {
#if ZA_VEC
    if (j->sqrt_mode != SQ_MKL_CALL) { range_vec(j, t, s, e - s); return; }
#endif
    for (int64_t off = s; off < e; off += CH) chunk_scalar(j, t, off, e - off < CH ? e - off : CH);
}

/* Global element range of part k: cut at multiples of PART_ALIGN. */
static int64_t part_start(const job_t* j, int64_t k) {
    int64_t total = j->offs[j->nt];
    if (k >= j->nparts) return total;
    int64_t v = (int64_t)((double)total * (double)k / (double)j->nparts);
    return v - v % PART_ALIGN;
}

static void run_part(const job_t* j, int64_t k) {
    int64_t a = part_start(j, k), b = part_start(j, k + 1);
    if (a >= b) return;
    int64_t lo = 0, hi = j->nt - 1; /* last tensor t with offs[t] <= a */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (j->offs[mid] <= a) lo = mid; else hi = mid - 1;
    }
    for (int64_t t = lo; t < j->nt && j->offs[t] < b; t++) {
        int64_t s = a > j->offs[t] ? a - j->offs[t] : 0;
        int64_t e = (b < j->offs[t + 1] ? b : j->offs[t + 1]) - j->offs[t];
        if (e > s) range_any(j, t, s, e);
    }
}

/* Parts are taken from a shared counter (load balance when a core is busy elsewhere). */
static void* worker(void* arg) {
    job_t* j = (job_t*)arg;
    for (;;) {
        int64_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->nparts) break;
        run_part(j, k);
    }
    return NULL;
}

int za_abi(void) { return 2; }
int za_has_vec(void) { return ZA_VEC; }

/* sqrt of n floats as mode `mode` computes it (for the self-test against torch.sqrt). */
void za_sqrt(int mode, void* fn, const float* x, float* out, int64_t n) {
#if ZA_VEC
    if (mode != SQ_MKL_CALL) { /* the same W-lane code the step runs */
        for (int64_t i = 0; i < n; i += W) {
            float t[W] = {0};
            int64_t r = n - i < W ? n - i : W;
            memcpy(t, x + i, r * 4);
            vf a = V(loadu_ps)(t);
            V(storeu_ps)(t, mode == SQ_MKL_SSE ? sqrt_mkl_sse_v(a) : V(sqrt_ps)(a));
            memcpy(out + i, t, r * 4);
        }
        return;
    }
#endif
    if (mode == SQ_MKL_CALL && fn) {
        for (int64_t i = 0; i < n; i += CH) ((sqrt_fn_t)fn)(n - i < CH ? n - i : CH, x + i, out + i, VML_MODE);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = sqrtf(x[i]);
    }
}

void za_step(int64_t nt, float* const* p, const float* const* g, float* const* m, float* const* v,
             void* const* o16, const int64_t* offs, const float* neg_step, const float* bc2s,
             float decay, float l2wd, float w, float beta2, float omb2, float eps, int l2, int out_dt,
             int sqrt_mode, void* sqrt_fn, int nthreads) {
    job_t j = {nt, p, g, m, v, o16, offs, neg_step, bc2s, decay, l2wd, w, beta2, omb2, eps, l2, out_dt,
               sqrt_mode, (sqrt_fn_t)sqrt_fn, 0, 0};
    if (nt <= 0 || offs[nt] == 0) return;
    if (nthreads > MAXT) nthreads = MAXT;
    if (nthreads < 1) nthreads = 1;
    j.nparts = nthreads == 1 ? 1 : (int64_t)nthreads * PARTS_PER_THREAD;
    if (nthreads == 1) { run_part(&j, 0); return; }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
    worker(&j);
#else
    pthread_t th[MAXT];
    int started[MAXT];
    for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&th[t], NULL, worker, &j) == 0;
    worker(&j);
    for (int t = 1; t < nthreads; t++)
        if (started[t]) pthread_join(th[t], NULL);
#endif
}
"""
