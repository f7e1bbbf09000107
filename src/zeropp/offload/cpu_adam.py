"""``CpuAdam``: a host Adam/AdamW for the fp32 master shards, bit-identical to ``torch.optim.AdamW`` /
``torch.optim.Adam`` (``foreach=False``), in one pass over memory, on all of torch's intra-op threads.

Why a C kernel: torch's single-tensor AdamW makes ~8 full passes over memory per parameter (mul, lerp, mul,
addcmul, sqrt, div, add, addcdiv, plus a temporary for the denominator), and the step is memory-bound on the
host, which is what ZeRO-Offload's "CPU Adam up to 6x faster than PyTorch's" is about. The kernel reads p, g,
m, v once and writes p, m, v once (plus the 16-bit copy of p when asked: ZeRO-Offload's fused copy-back),
working through each tensor in chunks that stay in L1.

Note [bit-exact with torch]: the kernel performs torch's own per-element operations in torch's order, with the
same roundings (measured on torch 2.13.0 CPU, AVX-512 build; ``_single_tensor_adam`` in torch/optim/adam.py):

* AdamW: ``p = p * f32(1 - lr*wd)`` (skipped by torch when wd == 0; multiplying by 1.0f is exact);
  Adam (L2): ``g = fma(p, f32(wd), g)`` (``grad.add(param, alpha=wd)``: ATen's add is ``fmadd(b, alpha, a)``);
* ``m = lerp(m, g, w)`` with ``w = f32(1 - beta1)``: ``fma(w, g - m, m)`` when ``|w| < 0.5`` else
  ``fma(w - 1, g - m, g)`` (ATen's ``lerp_vec``; its scalar tail is contracted the same way);
* ``v = fma(f32(1 - beta2) * g, g, v * f32(beta2))`` (``mul_`` then ``addcmul_``, whose
  ``self + value * t1 * t2`` the compiler contracted into an FMA in both the vector and the scalar path);
* ``d = sqrt(v) / f32(sqrt(1 - beta2**step)) + f32(eps)``, where ``sqrt`` is whatever ``torch.sqrt`` uses:
  on MKL builds that is MKL VML's ``vmsSqrt`` (mode ``VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE``), which
  is *not* correctly rounded (1 ulp; ~20% of results differ from IEEE ``sqrtf``), so the kernel calls the
  same exported ``vmsSqrt_64`` from libtorch_cpu on each L1-sized chunk; elsewhere IEEE ``sqrtf``;
* ``p = p + (f32(-lr / (1 - beta1**step)) * m) / d`` (``addcdiv_``: ``self + value * t1 / t2``).

Bias corrections and step sizes are computed in Python doubles exactly as torch computes them, then rounded to
fp32 as ATen rounds a Python scalar. The library is built with ``-ffp-contract=off`` so that the only FMAs
are the explicit ones. Which ``sqrt`` matches, and whether the whole step matches, is decided by a self-test
against ``torch.optim.AdamW``/``Adam`` when the kernel loads (``kernel_info()`` reports it); a kernel that
cannot be made bit-exact is still used when it agrees within 2 ulp (``exact=False``), and otherwise
disabled.

Fallback: no C compiler, ``ZEROPP_CPU_ADAM_FAST=0``, or a parameter the kernel does not take (not CPU fp32
contiguous, grad of another dtype) -> torch's own functional ``adam(..., foreach=False)`` for that
parameter, which is the reference, so results do not depend on which path ran.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as _torch_adam

from zeropp import native

__all__ = ["CpuAdam", "KernelInfo", "kernel_info"]

_C_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

/* MKL VML: void vmsSqrt_64(MKL_INT64 n, const float* a, float* r, MKL_INT64 mode). */
typedef void (*sqrt_fn_t)(int64_t, const float*, float*, int64_t);
#define VML_MODE ((int64_t)(0x2 | 0x140000 | 0x100)) /* VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE */
#define CH 2048      /* elements per chunk: 5 fp32 streams of 8 KiB stay in L1/L2 between the passes */
#define PART_ALIGN 64
#define MAXT 64
#define PARTS_PER_THREAD 8

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* fp32 -> bfloat16, round to nearest even (c10's round_to_nearest_even). */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}
/* fp32 -> binary16, round to nearest even (c10's fp16_ieee_from_fp32_value). */
static inline uint16_t f2h(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    uint32_t bits = f2u(u2f((bias >> 1) + 0x07800000u) + base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

typedef struct {
    int64_t nt;
    float* const* p; const float* const* g; float* const* m; float* const* v; void* const* o16;
    const int64_t* offs;               /* nt + 1 prefix sums of the element counts */
    const float* neg_step; const float* bc2s;  /* per tensor: f32(-lr/bc1), f32(sqrt(bc2)) */
    float decay, l2wd, w, beta2, omb2, eps;
    int l2, out_dt;                    /* out_dt: 0 none, 1 bf16, 2 fp16 */
    sqrt_fn_t sq;
    int64_t nparts, next;
} job_t;

/* First moment and second moment of n elements; the lerp branch and the L2 term are loop-invariant. */
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

static void chunk(const job_t* j, int64_t t, int64_t off, int64_t n) {
    float* restrict p = j->p[t] + off;
    const float* restrict g = j->g[t] + off;
    float* restrict m = j->m[t] + off;
    float* restrict v = j->v[t] + off;
    float s[CH] __attribute__((aligned(64)));
    const float decay = j->decay, l2wd = j->l2wd, w = j->w, wm1 = w - 1.0f, b2 = j->beta2, omb2 = j->omb2;
    const float eps = j->eps, ns = j->neg_step[t], bc2s = j->bc2s[t];
    const int small = fabsf(w) < 0.5f;
    if (j->l2) {
        if (small) { MOMENTS(fmaf(p[i], l2wd, g[i]), fmaf(w, d, mm)) }
        else { MOMENTS(fmaf(p[i], l2wd, g[i]), fmaf(wm1, d, gg)) }
    } else {
        if (small) { MOMENTS(g[i], fmaf(w, d, mm)) }
        else { MOMENTS(g[i], fmaf(wm1, d, gg)) }
    }
    if (j->sq) j->sq(n, v, s, VML_MODE);
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

/* Global element range of part k of n, cut at multiples of PART_ALIGN. */
static int64_t part_start(const job_t* j, int64_t k) {
    int64_t total = j->offs[j->nt];
    if (k >= j->nparts) return total;
    int64_t v = (int64_t)((double)total * (double)k / (double)j->nparts);
    v -= v % PART_ALIGN;
    return v;
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
        for (int64_t off = s; off < e; off += CH) chunk(j, t, off, e - off < CH ? e - off : CH);
    }
}

static void* worker(void* arg) {
    job_t* j = (job_t*)arg;
    for (;;) {
        int64_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->nparts) break;
        run_part(j, k);
    }
    return NULL;
}

int za_abi(void) { return 1; }

void za_step(int64_t nt, float* const* p, const float* const* g, float* const* m, float* const* v,
             void* const* o16, const int64_t* offs, const float* neg_step, const float* bc2s,
             float decay, float l2wd, float w, float beta2, float omb2, float eps, int l2, int out_dt,
             void* sqrt_fn, int nthreads) {
    job_t j = {nt, p, g, m, v, o16, offs, neg_step, bc2s, decay, l2wd, w, beta2, omb2, eps, l2, out_dt,
               (sqrt_fn_t)sqrt_fn, 0, 0};
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

# No fast-math and no implicit FMA contraction: the only FMAs are the explicit fmaf() calls that mirror
# ATen's. -fno-math-errno lets sqrtf vectorize (it changes no result).
_BASE_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math",
               "-fno-math-errno", "-fno-strict-aliasing"]
_OUT_CODE = {torch.bfloat16: 1, torch.float16: 2}
_MIN_ELEMS_PER_THREAD = 1 << 15  # below this, waking a second thread costs more than it saves


class KernelInfo(NamedTuple):
    """What ``CpuAdam`` runs on: ``available`` (the C kernel is in use), ``exact`` (its self-test matched
    torch's AdamW/Adam bit for bit), ``sqrt`` ("mkl", "ieee" or "" when unavailable), ``openmp`` (threads from
    torch's OpenMP pool rather than pthreads), ``reason`` (why it is unavailable, else "")."""

    available: bool
    exact: bool
    sqrt: str
    openmp: bool
    reason: str


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, sqrt_ptr: int | None, sqrt_name: str, openmp: bool):
        self.lib, self.sqrt_ptr, self.sqrt_name, self.openmp = lib, sqrt_ptr, sqrt_name, openmp
        self.exact = False


_lock = threading.Lock()
_kernel: _Kernel | None = None
_info: KernelInfo | None = None


def _mkl_sqrt_ptr() -> int | None:
    """Address of MKL's ``vmsSqrt_64`` when libtorch_cpu exports it (MKL builds of torch)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)  # already loaded by `import torch`: this returns the same handle
        return ctypes.cast(lib.vmsSqrt_64, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _load() -> tuple[ctypes.CDLL, bool] | None:
    variants = native.openmp_variants("ZEROPP_CPU_ADAM_OPENMP")
    for extra in variants:
        so = native.build_shared_library("cpu_adam", _C_SOURCE, _BASE_FLAGS, [extra])
        if so is None:
            continue
        lib = ctypes.CDLL(so)
        if lib.za_abi() != 1:
            continue
        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        lib.za_step.restype = None
        lib.za_step.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, f32, f32, f32, f32, f32, f32,
                                i32, i32, ptr, i32]
        return lib, "-fopenmp" in extra
    return None


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two fp32 tensors (sign-magnitude ordered)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _self_test_max_ulp() -> int:
    """Largest ulp difference between the kernel and torch over a few small cases (0 = bit-exact)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (1, 31, 1000, 4099, 2 * 2048 + 77, 70_001)
    worst = 0
    cases = ((True, (0.9, 0.999), 0.01), (False, (0.3, 0.99), 0.1), (True, (0.8, 0.95), 0.0))
    for adamw, betas, wd in cases:
        base = [torch.randn(n, generator=gen) for n in sizes]
        grads = [[torch.randn(n, generator=gen) * 10.0 ** float(k - 2) for n in sizes] for k in range(3)]
        ours = [p.clone() for p in base]
        ref = [p.clone().requires_grad_(False) for p in base]
        o = CpuAdam(ours, lr=1e-2, betas=betas, eps=1e-8, weight_decay=wd, adamw=adamw)
        o._force = "kernel"
        r = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, lr=1e-2, betas=betas, eps=1e-8,
                                                              weight_decay=wd, foreach=False)
        outs = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in ours}
        for step_grads in grads:
            for p, q, gr in zip(ours, ref, step_grads):
                p.grad, q.grad = gr.clone(), gr.clone()
            o.step(out16=outs)
            r.step()
        for p, q in zip(ours, ref):
            worst = max(worst, _ulp_diff(p, q), _ulp_diff(o.state[p]["exp_avg_sq"], r.state[q]["exp_avg_sq"]),
                        _ulp_diff(o.state[p]["exp_avg"], r.state[q]["exp_avg"]))
            if not torch.equal(outs[p], p.to(torch.bfloat16)):
                return 1 << 30
    return worst


def _get_kernel() -> _Kernel | None:
    global _kernel, _info
    if _info is not None:
        return _kernel
    with _lock:
        if _info is not None:
            return _kernel
        reason = ""
        if os.environ.get("ZEROPP_CPU_ADAM_FAST", "1") == "0":
            reason = "disabled by ZEROPP_CPU_ADAM_FAST=0"
        else:
            try:
                loaded = _load()
            except Exception as e:  # noqa: BLE001 - any failure means: use torch's implementation
                loaded, reason = None, f"load failed: {e}"
            if loaded is None:
                reason = reason or "no working C compiler"
            else:
                lib, openmp = loaded
                mkl = _mkl_sqrt_ptr()
                candidates = ([(mkl, "mkl")] if mkl else []) + [(None, "ieee")]
                best: tuple[int, _Kernel] | None = None
                for ptr, name in candidates:
                    k = _Kernel(lib, ptr, name, openmp)
                    _kernel = k  # the self-test steps through the kernel
                    try:
                        ulp = _self_test_max_ulp()
                    except Exception as e:  # noqa: BLE001
                        ulp, reason = 1 << 30, f"self-test failed: {e}"
                    if best is None or ulp < best[0]:
                        best = (ulp, k)
                    if ulp == 0:
                        break
                _kernel = None
                if best is not None and best[0] <= 2:
                    _kernel = best[1]
                    _kernel.exact = best[0] == 0
                    reason = ""
                else:
                    reason = reason or f"self-test disagrees with torch by {best[0] if best else '?'} ulp"
                    warnings.warn(f"zeropp.offload.CpuAdam: C kernel disabled ({reason}); using torch's Adam")
        k = _kernel
        _info = KernelInfo(k is not None, bool(k and k.exact), k.sqrt_name if k else "", bool(k and k.openmp),
                           reason)
    return _kernel


def kernel_info() -> KernelInfo:
    """Builds (first call) and self-tests the kernel; says what ``CpuAdam.step`` will run on."""
    _get_kernel()
    assert _info is not None
    return _info


def _ptrs(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else 0 for t in tensors])


class CpuAdam(torch.optim.Optimizer):
    """Adam / AdamW for CPU fp32 parameters, bit-identical to ``torch.optim.AdamW`` (``adamw=True``) or
    ``torch.optim.Adam`` (``adamw=False``, L2 weight decay) with ``foreach=False``.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        lr, betas, eps, weight_decay: as torch's; ``weight_decay`` defaults to 0.0 (DeepSpeed's default).
        adamw: decoupled weight decay (AdamW) when True, L2 (Adam) when False.

    ``state_dict()`` has torch's Adam layout (per parameter ``step`` as a float32 0-dim tensor, ``exp_avg``,
    ``exp_avg_sq``; param groups carry torch's keys with ``decoupled_weight_decay = adamw``), so state dicts
    move between this class and ``torch.optim.AdamW``/``Adam`` in both directions.

    ``step(closure=None, out16=None)``: ``out16`` maps a parameter to a bf16/fp16 tensor of the same number of
    elements that receives the updated value, rounded to nearest even, in the same pass (ZeRO-Offload's copy
    of the updated fp32 master back into the 16-bit shard). ``step_and_copy(out16)`` is the same call.

    Not supported (raise): ``amsgrad``, ``maximize``, sparse gradients.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw: bool = True):
        lr = float(lr)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        # torch's Adam keys, so that state dicts are interchangeable with torch.optim.AdamW / Adam.
        defaults = {"lr": lr, "betas": (float(betas[0]), float(betas[1])), "eps": eps,
                    "weight_decay": weight_decay, "amsgrad": False, "maximize": False, "foreach": None,
                    "capturable": False, "differentiable": False, "fused": None,
                    "decoupled_weight_decay": bool(adamw)}
        super().__init__(params, defaults)
        self._force: str | None = None  # tests: "kernel" or "torch"

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, val in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                             ("differentiable", False), ("fused", None), ("decoupled_weight_decay", True)):
                group.setdefault(key, val)
            for p in group["params"]:
                st = self.state.get(p, {})
                if st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def step_and_copy(self, out16: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """``step(out16=out16)``: update and write each listed parameter's new value into its 16-bit copy."""
        self.step(out16=out16)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             out16: Mapping[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """One Adam/AdamW step over every parameter that has a gradient; see the class docstring."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        out16 = out16 or {}
        if self._force is not None:  # tests and the self-test (which runs while _get_kernel holds the lock)
            kernel = _kernel if self._force == "kernel" else None
        else:
            kernel = _get_kernel()
        for group in self.param_groups:
            self._step_group(group, kernel, out16)
        return loss

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if len(st) == 0:  # lazy, as torch: step is a float32 0-dim CPU tensor
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _step_group(self, group: dict[str, Any], kernel: _Kernel | None,
                    out16: Mapping[torch.Tensor, torch.Tensor]) -> None:
        if group["amsgrad"] or group["maximize"]:
            raise NotImplementedError("CpuAdam: amsgrad and maximize are not supported")
        fast: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]] = []
        slow: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("CpuAdam does not support sparse gradients")
            st = self._state_of(p)
            o = out16.get(p)
            if o is not None and (o.numel() != p.numel() or o.dtype not in _OUT_CODE):
                raise ValueError(f"out16 for a parameter of {p.numel()} elements must be bf16/fp16 of the same "
                                 f"size; got {o.dtype} with {o.numel()}")
            (fast if kernel is not None and _kernel_takes(p, st, o) else slow).append((p, st, o))
        if fast:
            assert kernel is not None
            self._kernel_step(group, kernel, fast)
        if slow:
            self._torch_step(group, slow)

    def _torch_step(self, group: dict[str, Any], items: list) -> None:
        """torch's own single-tensor Adam: the reference the kernel reproduces."""
        beta1, beta2 = group["betas"]
        params = [p for p, _, _ in items]
        _torch_adam(params, [p.grad for p in params], [st["exp_avg"] for _, st, _ in items],
                    [st["exp_avg_sq"] for _, st, _ in items], [], [st["step"] for _, st, _ in items],
                    foreach=False, capturable=False, differentiable=False, fused=None, grad_scale=None,
                    found_inf=None, has_complex=any(torch.is_complex(p) for p in params),
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)
        for p, _, o in items:
            if o is not None:
                o.view(-1).copy_(p.detach().view(-1))

    def _kernel_step(self, group: dict[str, Any], kernel: _Kernel, items: list) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        adamw = group["decoupled_weight_decay"]
        steps = [st["step"] for _, st, _ in items]
        torch._foreach_add_(steps, 1)  # torch: step_t += 1, per parameter
        # torch's scalar arithmetic (Python doubles), per parameter; usually one distinct step value.
        coeffs: dict[float, tuple[float, float]] = {}
        neg_step, bc2s = [], []
        for s in steps:
            step = s.item()
            if step not in coeffs:
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                coeffs[step] = (-(lr / bias_correction1), bias_correction2**0.5)
            ns, b2 = coeffs[step]
            neg_step.append(ns)
            bc2s.append(b2)
        # One kernel call per kind of 16-bit copy (usually one call for the whole group).
        by_kind: dict[Any, list[int]] = {}
        for i, (_, _, o) in enumerate(items):
            by_kind.setdefault(None if o is None else o.dtype, []).append(i)
        for idx in by_kind.values():
            self._kernel_call(kernel, [items[i] for i in idx], [neg_step[i] for i in idx],
                              [bc2s[i] for i in idx], lr, wd, beta1, beta2, eps, adamw)

    @staticmethod
    def _kernel_call(kernel: _Kernel, items: list, neg_step: list[float], bc2s: list[float], lr: float,
                     wd: float, beta1: float, beta2: float, eps: float, adamw: bool) -> None:
        n = len(items)
        offs = [0] * (n + 1)
        for i, (p, _, _) in enumerate(items):
            offs[i + 1] = offs[i] + p.numel()
        o16 = [o for _, _, o in items]
        out_dt = _OUT_CODE[o16[0].dtype] if o16[0] is not None else 0
        decay = 1 - lr * wd if (adamw and wd != 0) else 1.0
        l2 = (not adamw) and wd != 0
        threads = max(1, min(torch.get_num_threads(), offs[-1] // _MIN_ELEMS_PER_THREAD))
        kernel.lib.za_step(
            n, _ptrs([p for p, _, _ in items]), _ptrs([p.grad for p, _, _ in items]),
            _ptrs([st["exp_avg"] for _, st, _ in items]), _ptrs([st["exp_avg_sq"] for _, st, _ in items]),
            _ptrs(o16), (ctypes.c_int64 * (n + 1))(*offs), (ctypes.c_float * n)(*neg_step),
            (ctypes.c_float * n)(*bc2s), decay, float(wd), 1 - beta1, beta2, 1 - beta2, eps, int(l2), out_dt,
            kernel.sqrt_ptr, threads)


def _kernel_takes(p: torch.Tensor, st: dict[str, Any], o: torch.Tensor | None) -> bool:
    """The kernel takes CPU fp32 contiguous parameter, gradient and moments (and a contiguous 16-bit copy)."""
    ts = (p, p.grad, st["exp_avg"], st["exp_avg_sq"])
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts):
        return False
    if not all(t.numel() == p.numel() for t in ts):
        return False
    if not (st["step"].device.type == "cpu" and st["step"].dtype == torch.float32):
        return False
    return o is None or (o.device.type == "cpu" and o.is_contiguous())
