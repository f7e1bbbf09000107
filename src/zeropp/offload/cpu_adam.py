"""``CpuAdam``: a host Adam/AdamW for the fp32 master shards, bit-identical to ``torch.optim.AdamW`` /
``torch.optim.Adam`` (``foreach=False``), in one pass over memory, on all of torch's intra-op threads.

Why a C kernel: torch's single-tensor AdamW makes ~8 full passes over memory per parameter (mul, lerp, mul,
addcmul, sqrt, div, add, addcdiv, plus a temporary for the denominator), and the step is memory-bound on the
host, which is what ZeRO-Offload's "CPU Adam up to 6x faster than PyTorch's" is about. The kernel reads p, g,
m, v once and writes p, m, v once (plus the 16-bit copy of p when asked: ZeRO-Offload's fused copy-back):
28 bytes of memory traffic per parameter, with no temporaries. Work is split into contiguous parts taken from
a shared counter by ``torch.get_num_threads()`` threads (torch's own OpenMP pool when torch uses libgomp).

Note [bit-exact with torch]: the kernel performs torch's own per-element operations in torch's order, with the
same roundings (measured on torch 2.13.0 CPU, AVX-512 build; ``_single_tensor_adam`` in torch/optim/adam.py):

* AdamW: ``p = p * f32(1 - lr*wd)`` (skipped by torch when wd == 0; multiplying by 1.0f is exact);
  Adam (L2): ``g = fma(p, f32(wd), g)`` (``grad.add(param, alpha=wd)``: ATen's add is ``fmadd(b, alpha, a)``);
* ``m = lerp(m, g, w)`` with ``w = f32(1 - beta1)``: ``fma(w, g - m, m)`` when ``|w| < 0.5`` else
  ``fma(w - 1, g - m, g)`` (ATen's ``lerp_vec``; its scalar tail is contracted the same way);
* ``v = fma(f32(1 - beta2) * g, g, v * f32(beta2))`` (``mul_`` then ``addcmul_``, whose
  ``self + value * t1 * t2`` the compiler contracted into an FMA in both the vector and the scalar path);
* ``d = sqrt(v) / f32(sqrt(1 - beta2**step)) + f32(eps)``, where ``sqrt`` is whatever ``torch.sqrt`` does:
  on MKL builds that is MKL VML's ``vmsSqrt`` (mode ``VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE``), which
  is *not* correctly rounded (up to 0.75 ulp; ~20% of results differ from IEEE ``sqrtf``). On this machine
  (AMD EPYC with AVX-512) MKL runs its SSE kernel ``mkl_vml_kernel_sSqrt_EXHAynn``; the kernel re-implements
  that algorithm inline (``sqrt_mkl_sse``: rsqrtps + one Goldschmidt step, no FMAs), verified equal to
  ``vmsSqrt`` on all 2^32 inputs here ("mkl-sse"). Where MKL takes another code path, the kernel calls the
  exported ``vmsSqrt_64`` from libtorch_cpu on L1-sized chunks instead ("mkl-call", exact, slower);
  without MKL, IEEE ``sqrt`` ("ieee");
* ``p = p + (f32(-lr / (1 - beta1**step)) * m) / d`` (``addcdiv_``: ``self + value * t1 / t2``).

Bias corrections and step sizes are computed in Python doubles exactly as torch computes them, then rounded to
fp32 as ATen rounds a Python scalar. The library is built with ``-ffp-contract=off`` so that the only FMAs
are the explicit ones. Which ``sqrt`` mode reproduces ``torch.sqrt`` is decided when the kernel loads, on 1M
random bit patterns over every exponent plus the special values; then a whole-step self-test against
``torch.optim.AdamW``/``Adam`` decides ``exact`` (``kernel_info()`` reports both). A kernel that cannot be
made bit-exact is still used when it agrees within 2 ulp (``exact=False``), and otherwise disabled.

Fallback: no C compiler, ``ZEROPP_CPU_ADAM_FAST=0``, or a parameter the kernel does not take (not CPU fp32
contiguous, grad of another dtype) -> torch's own functional ``adam(..., foreach=False)`` for that
parameter, which is the reference, so results do not depend on which path ran.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as _torch_adam

from zeropp import native
from zeropp.offload.cpu_adam_source import C_SOURCE as _C_SOURCE

__all__ = ["CpuAdam", "KernelInfo", "kernel_info"]

# No fast-math and no implicit FMA contraction: the only FMAs are the explicit fmaf() / _mm256_fmadd_ps calls
# that mirror ATen's. -fno-math-errno lets sqrtf vectorize (it changes no result).
_BASE_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math",
               "-fno-math-errno", "-fno-strict-aliasing"]
_OUT_CODE = {torch.bfloat16: 1, torch.float16: 2}
_MIN_ELEMS_PER_THREAD = 1 << 15  # below this, waking a second thread costs more than it saves


class KernelInfo(NamedTuple):
    """What ``CpuAdam`` runs on.

    ``available``: the C kernel is in use; ``exact``: its self-test matched torch's AdamW/Adam bit for bit;
    ``sqrt``: how it computes torch's sqrt ("mkl-sse": MKL's SSE algorithm re-implemented inline, one pass;
    "mkl-call": MKL's vmsSqrt called per chunk, two passes; "ieee"; "" when unavailable); ``vector``: the
    AVX2/FMA one-pass loop (else the portable chunked loop); ``openmp``: threads from torch's OpenMP pool
    (else pthreads); ``reason``: why the kernel is unavailable, else "".
    """

    available: bool
    exact: bool
    sqrt: str
    vector: bool
    openmp: bool
    reason: str


_SQRT_MODES = {"ieee": 0, "mkl-sse": 1, "mkl-call": 2, "fast": 3}


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, openmp: bool, sqrt_name: str, sqrt_ptr: int | None):
        self.lib, self.openmp, self.sqrt_name, self.sqrt_ptr = lib, openmp, sqrt_name, sqrt_ptr
        self.sqrt_mode = _SQRT_MODES[sqrt_name]
        self.vector = bool(lib.za_has_vec())
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
    for extra in native.openmp_variants("ZEROPP_CPU_ADAM_OPENMP"):
        so = native.build_shared_library("cpu_adam", _C_SOURCE, _BASE_FLAGS, [extra])
        if so is None:
            continue
        lib = ctypes.CDLL(so)
        if lib.za_abi() != 2:
            continue
        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        lib.za_step.restype = None
        lib.za_step.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, f32, f32, f32, f32, f32, f32,
                                i32, i32, i32, ptr, i32]
        lib.za_sqrt.restype = None
        lib.za_sqrt.argtypes = [i32, ptr, ptr, ptr, i64]
        lib.za_has_vec.restype = i32
        return lib, "-fopenmp" in extra
    return None


def _sqrt_sample() -> torch.Tensor:
    """Inputs for the sqrt check: random bit patterns over every exponent, plus the special values."""
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 0x7F800000, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 3.4e38, 3.4028235e38,
                             float("inf"), 1.0, 2.0, 4.0, 0.25], dtype=torch.float32)
    return torch.cat([bits.view(torch.float32), specials, torch.rand(4099, generator=gen) * 1e-6])


def _sqrt_matches(lib: ctypes.CDLL, name: str, ptr: int | None, x: torch.Tensor, ref: torch.Tensor) -> bool:
    out = torch.empty_like(x)
    lib.za_sqrt(_SQRT_MODES[name], ptr, x.data_ptr(), out.data_ptr(), x.numel())
    same = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
    return bool(same.all())


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two fp32 tensors (sign-magnitude ordered)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _self_test_max_ulp() -> int:
    """Largest ulp difference between the kernel (``_kernel``) and torch over a few small cases (0 = exact):
    AdamW and Adam-with-L2, both lerp branches, sizes around the vector width and the chunk size, 3 steps,
    gradients over 5 decades, and the fused bf16 / fp16 copies."""
    gen = torch.Generator().manual_seed(0)
    sizes = (1, 7, 31, 1000, 4099, 2 * 2048 + 77, 70_001)
    worst = 0
    cases = ((True, (0.9, 0.999), 0.01, torch.bfloat16), (False, (0.3, 0.99), 0.1, torch.float16),
             (True, (0.8, 0.95), 0.0, None))
    for adamw, betas, wd, out_dtype in cases:
        base = [torch.randn(n, generator=gen) for n in sizes]
        grads = [[torch.randn(n, generator=gen) * 10.0 ** float(2 * k - 2) for n in sizes] for k in range(3)]
        ours = [p.clone() for p in base]
        ref = [p.clone() for p in base]
        o = CpuAdam(ours, lr=1e-2, betas=betas, eps=1e-8, weight_decay=wd, adamw=adamw)
        o._force = "kernel"
        r = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, lr=1e-2, betas=betas, eps=1e-8,
                                                              weight_decay=wd, foreach=False)
        outs = {p: torch.empty(p.shape, dtype=out_dtype) for p in ours} if out_dtype else {}
        for step_grads in grads:
            for p, q, gr in zip(ours, ref, step_grads):
                p.grad, q.grad = gr.clone(), gr.clone()
            o.step(out16=outs)
            r.step()
        for p, q in zip(ours, ref):
            worst = max(worst, _ulp_diff(p, q), _ulp_diff(o.state[p]["exp_avg_sq"], r.state[q]["exp_avg_sq"]),
                        _ulp_diff(o.state[p]["exp_avg"], r.state[q]["exp_avg"]))
            if outs and not torch.equal(outs[p], p.to(out_dtype)):
                return 1 << 30
    return worst


def _choose(lib: ctypes.CDLL, openmp: bool) -> tuple[_Kernel | None, str]:
    """The sqrt mode that reproduces torch.sqrt (fastest first), then the whole-step self-test."""
    global _kernel
    mkl = _mkl_sqrt_ptr()
    vec = bool(lib.za_has_vec())
    names = (["ieee", "mkl-sse"] if vec else ["ieee"]) + (["mkl-call"] if mkl else [])
    x = _sqrt_sample()
    ref = torch.sqrt(x)
    chosen = next((n for n in names if _sqrt_matches(lib, n, mkl, x, ref)), "ieee")
    _kernel = _Kernel(lib, openmp, chosen, mkl if chosen == "mkl-call" else None)
    try:
        ulp = _self_test_max_ulp()
    except Exception as e:  # noqa: BLE001 - any failure means: use torch's implementation
        _kernel = None
        return None, f"self-test failed: {e}"
    k, _kernel = _kernel, None
    if ulp > 2:
        return None, f"self-test disagrees with torch by {ulp} ulp"
    k.exact = ulp == 0
    return k, ""


def _get_kernel() -> _Kernel | None:
    global _kernel, _info
    if _info is not None:
        return _kernel
    with _lock:
        if _info is not None:
            return _kernel
        k, reason = None, ""
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
                k, reason = _choose(*loaded)
                if k is None:
                    warnings.warn(f"zeropp.offload.CpuAdam: C kernel disabled ({reason}); using torch's Adam")
        _kernel = k
        _info = KernelInfo(k is not None, bool(k and k.exact), k.sqrt_name if k else "", bool(k and k.vector),
                           bool(k and k.openmp), reason)
    return _kernel


def kernel_info() -> KernelInfo:
    """Builds (first call) and self-tests the kernel; says what ``CpuAdam.step`` will run on."""
    _get_kernel()
    assert _info is not None
    return _info


_PAGE = 4096
_STAGGER_MIN_ELEMS = 1 << 16


def _circular_gap(a: int, b: int) -> int:
    d = (a - b) % _PAGE
    return min(d, _PAGE - d)


def _moment_buffers(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed exp_avg / exp_avg_sq like ``p``. For large CPU fp32 parameters, placed so that their addresses
    modulo 4 KiB sit far from the parameter's, the gradient's and each other's.

    Why: the step stores p[i], m[i], v[i] and then loads p, g, m, v a few cache lines further on. When a load
    address equals an earlier store address modulo 4096 the core assumes a dependency and stalls ("4K
    aliasing"); measured here, streams that sit 64-192 bytes apart modulo 4 KiB make the step ~20% slower
    than page-aligned or 1 KiB-staggered ones. The engine's parameters and gradients are views at arbitrary
    offsets, so the moments pick the free spots. Each moment is a view into a buffer 4 KiB longer than it
    (``torch.save`` writes those 4 KiB too)."""
    if not (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and p.numel() >= _STAGGER_MIN_ELEMS):
        return (torch.zeros_like(p, memory_format=torch.preserve_format),
                torch.zeros_like(p, memory_format=torch.preserve_format))
    taken = [p.data_ptr() % _PAGE]
    if p.grad is not None:
        taken.append(p.grad.data_ptr() % _PAGE)
    out = []
    for _ in range(2):
        buf = torch.zeros(p.numel() + _PAGE // 4)
        base = buf.data_ptr() % _PAGE
        target = max(range(0, _PAGE, 256), key=lambda t: min(_circular_gap(t, x) for x in taken))
        off = ((target - base) % _PAGE) // 4
        out.append(buf[off:off + p.numel()].view(p.shape))
        taken.append(target)
    return out[0], out[1]


def moment_storage_bytes(numel: int) -> int:
    """Bytes of storage one fp32 moment of a ``numel``-element CPU parameter occupies (see _moment_buffers)."""
    return 4 * numel + (_PAGE if numel >= _STAGGER_MIN_ELEMS else 0)


def _ptrs(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else 0 for t in tensors])


class CpuAdam(torch.optim.Optimizer):
    """Adam / AdamW for CPU fp32 parameters, bit-identical to ``torch.optim.AdamW`` (``adamw=True``) or
    ``torch.optim.Adam`` (``adamw=False``, L2 weight decay) with ``foreach=False``.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        lr, betas, eps, weight_decay: as torch's; ``weight_decay`` defaults to 0.0 (DeepSpeed's default).
        adamw: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
        exact: True (default): torch's operation sequence, bit for bit (Note [bit-exact with torch]).
            False: DeepSpeed's shorter sequence (``fma(sqrt(v), 1/sqrt(bc2), eps)``, ``fma(-step, m / d, p)``,
            IEEE sqrt): about 1.4x less arithmetic per element, which shows when memory bandwidth is
            plentiful; results differ from torch's in the last bits (tests bound it). Vector builds only.
        threads: kernel threads (default: ``torch.get_num_threads()`` at each step). A step run in the
            background while the next forward/backward computes (ZeRO-Offload's delayed update) should leave
            cores to the compute, e.g. ``threads=1``. Small steps use fewer (>= 32K elements per thread).

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
                 adamw: bool = True, *, threads: int | None = None, exact: bool = True):
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
        self.threads = threads
        self.exact = exact
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
            st["exp_avg"], st["exp_avg_sq"] = _moment_buffers(p)
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
                              [bc2s[i] for i in idx], lr, wd, beta1, beta2, eps, adamw,
                              self.threads or torch.get_num_threads(), self.exact)

    @staticmethod
    def _kernel_call(kernel: _Kernel, items: list, neg_step: list[float], bc2s: list[float], lr: float,
                     wd: float, beta1: float, beta2: float, eps: float, adamw: bool, threads: int,
                     exact: bool) -> None:
        n = len(items)
        offs = [0] * (n + 1)
        for i, (p, _, _) in enumerate(items):
            offs[i + 1] = offs[i] + p.numel()
        o16 = [o for _, _, o in items]
        out_dt = _OUT_CODE[o16[0].dtype] if o16[0] is not None else 0
        decay = 1 - lr * wd if (adamw and wd != 0) else 1.0
        l2 = (not adamw) and wd != 0
        threads = max(1, min(threads, offs[-1] // _MIN_ELEMS_PER_THREAD))
        sqrt_mode = kernel.sqrt_mode
        if not exact and kernel.vector:
            sqrt_mode, bc2s = _SQRT_MODES["fast"], [1.0 / b for b in bc2s]
        kernel.lib.za_step(
            n, _ptrs([p for p, _, _ in items]), _ptrs([p.grad for p, _, _ in items]),
            _ptrs([st["exp_avg"] for _, st, _ in items]), _ptrs([st["exp_avg_sq"] for _, st, _ in items]),
            _ptrs(o16), (ctypes.c_int64 * (n + 1))(*offs), (ctypes.c_float * n)(*neg_step),
            (ctypes.c_float * n)(*bc2s), decay, float(wd), 1 - beta1, beta2, 1 - beta2, eps, int(l2), out_dt,
            sqrt_mode, kernel.sqrt_ptr, threads)


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
