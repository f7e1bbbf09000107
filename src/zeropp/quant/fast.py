"""Fast CPU path for the block-wise quantizers: same signatures as ``blockwise.py``, bit-identical results.

Why a small C kernel and not torch ops or ``torch.compile``: the spec takes ~10 full-size passes over memory
(cast, abs, amax, divide, round, clamp, cast, pack, ...) and runs at a few percent of copy bandwidth; inductor
fuses it but measured ~8x slower than this kernel on the 2-core CI machine and costs ~20 s of cold compile
per shape (docs/benchmarks.md, "Quantizer kernels"). The kernel makes one pass per block while the block sits
in L1: max |x| on the integer bit patterns (which also detects inf/nan: their exponent bits are all ones),
then multiply by the block's reciprocal scale / round-half-even (Note [clamp-free codes]) / pack. Rows x
blocks are split over ``torch.get_num_threads()`` threads of the OpenMP pool (torch's own libgomp, shared by
soname; pthreads when torch does not use ``libgomp.so.1``, or with ``ZEROPP_QUANT_OPENMP=0``). It is plain C99
(no torch headers), so it builds in about a second. On AVX-512 machines the int4 code emission and qgZ's
dequantize-and-add loop have intrinsics bodies (fewer shuffles than gcc's vectorization of the portable loops);
``ZEROPP_QUANT_SIMD=0`` builds without them.

Bit-identity with the spec rests on: exact IEEE fp32 products and divisions (no ``-ffast-math``, no FMA
contraction), ``rintf`` (round half to even, as ``torch.round``), and the same round-to-nearest-even fp32->bf16/fp16
conversions as c10. A self-test against the spec runs once after loading; any mismatch disables the path.

qgZ's reduction steps (``dequantize_sum``, ``dequantize_sum_quantize``) sum the pieces chunk by chunk in the
spec's order (left to right, fp32, no FMA) while the running sums sit in L1; the fused step requantizes a
block straight from those sums (one pass for blocks of up to 2048 elements) without writing them to memory.
With AVX-512 an int4 block of whole 128-element groups at an even start keeps its sums in the (even, odd) order
the code emission pairs them in and takes its products from a 16-entry table (Note [split sums]); the last
step takes them from the table too and divides in the last piece's pass.

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
from .fast_source import C_SOURCE
from .layout import BlockLayout, layout_index, payload_bytes

__all__ = ["dequantize", "dequantize_sum", "dequantize_sum_quantize", "fast_available", "quantize", "simd_built"]

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
        so = native.build_shared_library("quant", C_SOURCE, base, [extra])
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
