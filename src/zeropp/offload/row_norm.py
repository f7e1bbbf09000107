"""The squared L2 norm of a gradient row, as the optimizer step takes it: each element converted to fp32 and
multiplied by the step's unscale in fp32, squared and summed in fp64 (Note [row norm]).

Note [row norm]: under optimizer offload the gradient rows live on the host and the step's first pass is their
norm. In torch ops that is four passes per piece (bf16 -> fp32, the unscale, fp32 -> fp64, ``vector_norm``),
and on a 16-core H200 host ``vector_norm`` in fp64 ran near one core's speed: a 1.24B model's norm took 1.4 s
of a 3.9 s offloaded step (``bench_device.py --offload --profile``). Host rows of bf16, fp16 or fp32 now go
through a small C kernel that reads each element once on torch's threads. Its sum has a fixed order whatever
the thread count: blocks of ``BLOCK`` elements, each summed in eight interleaved fp64 lanes, then the block
sums in index order; so every rank, run and thread count gets the same bits for the same row. Hosts without a C
compiler take the torch path (:func:`squared_norm_in_pieces`), which holds no full-size temporary. Both paths
agree to fp64 rounding; within one process every host row of a kind takes the same one, so runs that must match
bit for bit (offload or not, NVMe or not) still do.

Rows on an accelerator take ``torch._foreach_norm`` in fp32 (:func:`device_squared_norm`), which reads the 16-bit
row once with no copy, as torch's own ``clip_grad_norm_`` does. The way before converted each row to fp32 and then
to fp64 inside ``vector_norm``: about 26 bytes of memory traffic per parameter a step (by those bytes some 10 ms of
a 1.24B model's step on an H200, where FSDP2 computes no norm at all; not timed on its own). The unscale multiplies
the norm there, not each element: device runs match other runs to fp32 rounding, not bit for bit.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch

from zeropp import native

__all__ = ["NORM_PIECE", "device_squared_norm", "squared_norm", "squared_norm_in_pieces"]

NORM_PIECE = 1 << 20  # the torch path's piece: small buffers, no page faults

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
""" + native.C_FLOAT_BITS + r"""
#define BLOCK 65536
#define LANES 8

/* Sum of (f32(x[i]) * unscale)^2 over one block, in LANES fp64 lanes combined in a fixed order. */
#define BLOCK_SUM(T, LOAD)                                                              \
    static double block_##T(const void* p, int64_t n, float unscale) {                 \
        const T* x = (const T*)p;                                                       \
        double acc[LANES] = {0};                                                        \
        int64_t i = 0;                                                                  \
        for (; i + LANES <= n; i += LANES)                                              \
            for (int k = 0; k < LANES; k++) {                                           \
                double d = (double)(LOAD(x[i + k]) * unscale);                          \
                acc[k] += d * d;                                                        \
            }                                                                           \
        for (; i < n; i++) {                                                            \
            double d = (double)(LOAD(x[i]) * unscale);                                  \
            acc[i % LANES] += d * d;                                                    \
        }                                                                               \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }
#define F32(v) (v)
#define BF16(v) u2f((uint32_t)(v) << 16)
#define F16(v) h2f(v)
BLOCK_SUM(float, F32)
BLOCK_SUM(uint16_t, BF16)
typedef uint16_t half_t;
BLOCK_SUM(half_t, F16)

int zn_abi(void) { return 1; }

/* dtype: 0 fp32, 1 bf16, 2 fp16. Returns the sum; *ok is 0 when the block sums could not be allocated. */
double zn_squared_norm(const void* x, int dtype, int64_t n, float unscale, int nthreads, int* ok) {
    int64_t nb = (n + BLOCK - 1) / BLOCK, esz = dtype == 0 ? 4 : 2;
    double* sums = (double*)malloc((size_t)(nb > 0 ? nb : 1) * sizeof(double));
    *ok = sums != NULL;
    if (!sums) return 0.0;
    const char* base = (const char*)x;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nb > 1)
#endif
    for (int64_t b = 0; b < nb; b++) {
        int64_t at = b * BLOCK, c = n - at < BLOCK ? n - at : BLOCK;
        const void* p = base + at * esz;
        sums[b] = dtype == 0 ? block_float(p, c, unscale)
                : dtype == 1 ? block_uint16_t(p, c, unscale) : block_half_t(p, c, unscale);
    }
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) total += sums[b];
    free(sums);
    return total;
}
"""

_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_loaded = False


def _kernel() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no C compiler, ``ZEROPP_ROW_NORM_FAST=0``, or a failed build)."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            if os.environ.get("ZEROPP_ROW_NORM_FAST", "1") != "0":
                for extra in native.openmp_variants("ZEROPP_ROW_NORM_OPENMP"):
                    so = native.build_shared_library("row_norm", _SOURCE, _FLAGS, [extra])
                    if so is None:
                        continue
                    lib = ctypes.CDLL(so)
                    if lib.zn_abi() == 1:
                        lib.zn_squared_norm.restype = ctypes.c_double
                        lib.zn_squared_norm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                                        ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
                        _lib = lib
                        break
            _loaded = True
    return _lib


def squared_norm(row: torch.Tensor, unscale: float = 1.0) -> torch.Tensor:
    """The squared L2 norm (a 0-dim fp64 tensor on the row's device) of ``row`` converted to fp32 and
    multiplied by ``unscale`` in fp32 (Note [row norm])."""
    if row.device.type != "cpu":
        return device_squared_norm(row, unscale)
    lib = _kernel() if row.dtype in _DTYPES and row.is_contiguous() else None
    if lib is None:
        return squared_norm_in_pieces(row, unscale)
    ok = ctypes.c_int(0)
    total = lib.zn_squared_norm(row.data_ptr(), _DTYPES[row.dtype], row.numel(), unscale,
                                torch.get_num_threads(), ctypes.byref(ok))
    if not ok.value:
        return squared_norm_in_pieces(row, unscale)
    return torch.tensor(total, dtype=torch.float64)


_FOREACH_DTYPE = True  # torch._foreach_norm takes dtype= (else: the torch path in pieces)


def device_squared_norm(row: torch.Tensor, unscale: float = 1.0) -> torch.Tensor:
    """The squared norm of an accelerator's row (a 0-dim fp64 tensor there): ``torch._foreach_norm`` accumulating
    in fp32 with no copy of the row, then squared in fp64 and times ``unscale ** 2`` (Note [row norm])."""
    global _FOREACH_DTYPE
    if _FOREACH_DTYPE and row.is_floating_point():
        try:
            (norm,) = torch._foreach_norm([row.reshape(-1)], 2, dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without dtype= here
            _FOREACH_DTYPE = False
        else:
            return norm.double().square() * (float(unscale) ** 2)
    return squared_norm_in_pieces(row, unscale)


def squared_norm_in_pieces(row: torch.Tensor, unscale: float = 1.0) -> torch.Tensor:
    """The same sum with torch's ops, read in pieces through two small buffers: no full-size temporary (Note
    [host step passes] in ``zero/optimizer_step.py``)."""
    row = row.reshape(-1)
    n = row.numel()
    total = torch.zeros((), dtype=torch.float64, device=row.device)
    piece = max(1, min(n, NORM_PIECE))
    b32 = torch.empty(piece, dtype=torch.float32, device=row.device)
    b64 = torch.empty(piece, dtype=torch.float64, device=row.device)
    for at in range(0, n, piece):
        c = min(piece, n - at)
        x = b32[:c].copy_(row[at : at + c])
        if unscale != 1.0:
            x.mul_(unscale)
        total += torch.linalg.vector_norm(b64[:c].copy_(x)).square()
    return total
