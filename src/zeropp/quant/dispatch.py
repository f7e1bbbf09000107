"""Which implementation runs a quantizer call; every one gives the spec's bits (``blockwise.py``).

* CUDA tensors: the Triton kernels (``triton_path.py``) when triton imports, a CUDA device is present and
  ``ZEROPP_QUANT_TRITON`` is not ``0``; else the spec.
* CPU tensors: the C kernel (``fast.py``) when it built and passed its self-test (``ZEROPP_QUANT_FAST=0``
  turns it off); else the spec.
* int2 (qgZ with LoCo) runs the spec everywhere: the kernels pack int8 and int4 only.

triton is imported on the first CUDA call only: ``import zeropp`` stays free of its ~0.5 s import.
"""

from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType

import torch

from . import fast
from .blockwise import QuantizedRows
from .layout import BlockLayout

__all__ = ["dequantize", "dequantize_sum", "dequantize_sum_quantize", "quantize", "triton_available"]

_lock = threading.Lock()
_triton: ModuleType | None = None
_tried = False


def _triton_path() -> ModuleType | None:
    """The Triton host module, imported once; None when switched off or unavailable."""
    global _triton, _tried
    if os.environ.get("ZEROPP_QUANT_TRITON", "1") == "0":
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    if torch.cuda.is_available():
                        from . import triton_path
                        _triton = triton_path
                except Exception as e:  # noqa: BLE001 - no triton (or a broken one): the spec serves CUDA
                    warnings.warn(f"zeropp.quant: Triton kernels unavailable ({e}); CUDA tensors use the spec")
                _tried = True
    return _triton


def triton_available() -> bool:
    """True when CUDA tensors go to the Triton kernels (imports triton on the first call)."""
    return _triton_path() is not None


def _on_cuda(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.is_cuda for t in tensors)


def _triton_for(bits: int, *tensors: torch.Tensor | None) -> ModuleType | None:
    """The Triton module for CUDA tensors of a width its kernels pack (int8, int4), else None."""
    return _triton_path() if bits in fast.KERNEL_BITS and _on_cuda(*tensors) else None


def quantize(x: torch.Tensor, layout: BlockLayout, bits: int, out: QuantizedRows | None = None, *,
             poison: bool = False) -> QuantizedRows:
    """``blockwise.quantize`` on the fastest path for the device of ``x``."""
    tp = _triton_for(bits, x)
    if tp is not None:
        return tp.quantize(x, layout, bits, out, poison=poison)
    return fast.quantize(x, layout, bits, out, poison=poison)


def dequantize(q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``blockwise.dequantize`` on the fastest path for the device of ``q``."""
    tp = _triton_for(bits, q.data)
    if tp is not None:
        return tp.dequantize(q, layout, bits, dtype, out)
    return fast.dequantize(q, layout, bits, dtype, out)


def dequantize_sum(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None = None,
                   divisor: float | None = None) -> torch.Tensor:
    """``blockwise.dequantize_sum`` on the fastest path for the device of ``q``."""
    tp = _triton_for(bits, q.data)
    if tp is not None:
        return tp.dequantize_sum(q, layout, bits, pieces, out, divisor)
    return fast.dequantize_sum(q, layout, bits, pieces, out, divisor)


def dequantize_sum_quantize(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int,
                            out: QuantizedRows | None = None, *, poison: bool = False) -> QuantizedRows:
    """``blockwise.dequantize_sum_quantize`` on the fastest path for the device of ``q``."""
    tp = _triton_for(bits, q.data)
    if tp is not None:
        return tp.dequantize_sum_quantize(q, layout, bits, pieces, out, poison=poison)
    return fast.dequantize_sum_quantize(q, layout, bits, pieces, out, poison=poison)
