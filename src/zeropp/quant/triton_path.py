"""Host side of the Triton quantizers: the contracts of ``blockwise.py``, bit for bit, on CUDA tensors.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the same kernels run on CPU tensors in
Triton's interpreter, which is how ``tests/unit/test_quant_triton.py`` checks them on a machine without a GPU.
``zeropp.quant`` imports this module only when a CUDA tensor arrives (``dispatch.py``): importing triton costs
about half a second.

Synchronization: ``quantize`` and ``dequantize_sum_quantize`` must raise ``NonFiniteInputError`` naming the
first bad row and segment, which the host learns by reading one int32 flag the kernel sets (one device sync a
call). With ``poison=True`` they never sync: bad blocks get NaN scales (Note [non-finite poisoning] in
``plus/wire.py``) and whoever reads the scales later finds them. ``dequantize`` and ``dequantize_sum`` never
sync. Outputs must not overlap inputs.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import blockwise as spec
from . import triton_kernels as K
from .blockwise import QMAX, QuantizedRows
from .layout import BlockLayout, layout_index, payload_bytes

__all__ = ["dequantize", "dequantize_sum", "dequantize_sum_quantize", "quantize"]

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_MAX_CHUNK = 4096
# Kernel launches need one program id per (row, block) and int32 flat block indices.
_MAX_PROGRAMS = 2**31 - 1


@functools.lru_cache(maxsize=64)
def _seams(layout: BlockLayout, device: torch.device) -> torch.Tensor | None:
    """int64 indices of the blocks that start at an odd element (their first int4 byte is shared), or None."""
    starts = layout.block_starts()[:-1]
    odd = torch.nonzero(starts % 2 == 1).flatten()
    return odd.to(device) if odd.numel() else None


def _chunk(layout: BlockLayout) -> int:
    """Elements per chunk: a power of two holding a whole block even when it starts one element early (chunks
    start at even elements), capped so that huge blocks loop instead of spilling registers."""
    span = layout.block_size + (0 if layout.aligned else 1)
    return max(2, min(triton.next_power_of_2(span), _MAX_CHUNK))


def _align(layout: BlockLayout) -> int:
    """What every chunk's first element offset and every block's end are multiples of (a vectorization hint,
    up to 16; 2 means none): chunks start at block starts plus multiples of the chunk, and in an aligned layout
    every segment, so every block, starts and ends at a multiple of the block size."""
    return min(16, layout.block_size & -layout.block_size) if layout.aligned else 2


def _one_chunk(layout: BlockLayout, chunk: int) -> bool:
    """Whether every block fits the one chunk that starts at its first even element, one element before the
    block where it starts at an odd one: an aligned layout's blocks start at multiples of the block size (odd
    only for an odd block size), any other's anywhere. Such blocks are read once, not twice (max, then codes)."""
    early = layout.block_size % 2 if layout.aligned else 1
    return layout.block_size + early <= chunk


def _launch_opts(chunk: int) -> dict:
    # enable_fp_fusion=False: no a * b + c contracted into an FMA (one rounding instead of the spec's two).
    return {"num_warps": 4 if chunk <= 2048 else 8, "enable_fp_fusion": False}


def _check_devices(name: str, *tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{name}: every tensor must be on {device}, got one on {t.device}")
    return device


def _check_size(g: int, layout: BlockLayout) -> None:
    if g * layout.num_blocks > _MAX_PROGRAMS:
        raise ValueError(f"{g} rows x {layout.num_blocks} blocks: more blocks than one kernel launch can index; "
                         "split the rows")


def _empty_rows(g: int, layout: BlockLayout, bits: int, device: torch.device) -> QuantizedRows:
    return QuantizedRows(torch.empty(g, payload_bytes(layout, bits), dtype=torch.uint8, device=device),
                         torch.empty(g, layout.num_blocks, dtype=torch.float32, device=device))


def _dense_rows(data: torch.Tensor) -> torch.Tensor:
    """``data`` itself when the kernels can address it by one row stride (rows in place), else a copy."""
    return data if spec.rows_dense(data) else data.contiguous()


def _data_view(data: torch.Tensor, bits: int) -> torch.Tensor:
    return data.view(torch.int8) if bits == 8 else data  # int8 codes load signed; int4 bytes unsigned


def _launch_quantize(src: torch.Tensor, src_scales: torch.Tensor, res: QuantizedRows, layout: BlockLayout,
                     bits: int, g: int, poison: bool, *, src_kind: int, dt: int, bits_in: int, rows: int,
                     pieces: int) -> None:
    """Quantize ``g`` rows of a source (``src_kind`` 0: float bits, 1: stacked quantized pieces) into ``res``;
    raise NonFiniteInputError for the first bad block unless ``poison``."""
    device = res.data.device
    nb, ch = layout.num_blocks, _chunk(layout)
    starts = layout_index(layout, device).block_starts
    data, scales = _data_view(res.data, bits), res.scales.view(torch.int32)
    flag = None if poison else torch.full((1,), K.NO_BAD_BLOCK, dtype=torch.int32, device=device)
    pb_in = src.stride(0) if src_kind == 1 else 0  # rows of quantized data may sit apart (a wire buffer)
    common = dict(SRC=src_kind, DT=dt, BITS_IN=bits_in, QMAX=QMAX[bits], CH=ch, **_launch_opts(ch))
    K._quantize_kernel[(g * nb,)](src, src_scales, data, scales, scales if flag is None else flag, starts,
                                  layout.numel, pb_in, data.stride(0), nb, rows, pieces,
                                  BITS=bits, FLAG=flag is not None, ALIGN=_align(layout),
                                  ONE_CHUNK=_one_chunk(layout, ch), **common)
    seams = _seams(layout, device) if bits == 4 else None
    if seams is not None:
        K._int4_seam_kernel[(g * seams.numel(),)](src, src_scales, data, scales, starts, seams, seams.numel(),
                                                  layout.numel, pb_in, data.stride(0), nb, rows, pieces, **common)
    if flag is not None:
        bad = int(flag.item())  # the one sync
        if bad != K.NO_BAD_BLOCK:
            spec.raise_non_finite(bad, layout)


def _launch_dequantize(q: QuantizedRows, layout: BlockLayout, bits: int, y: torch.Tensor, rows: int, pieces: int,
                       divisor: float | None) -> None:
    nb, ch = layout.num_blocks, _chunk(layout)
    starts = layout_index(layout, y.device).block_starts
    out = y.view(torch.int16) if y.dtype == torch.bfloat16 else y
    data = _data_view(_dense_rows(q.data), bits)
    K._dequantize_kernel[(rows * nb,)](data, q.scales.contiguous(), out, starts, layout.numel, data.stride(0), nb,
                                       rows, pieces,
                                       1.0 if divisor is None else divisor, HAS_DIV=divisor is not None,
                                       DT_OUT=_DT[y.dtype], BITS=bits, CH=ch, ALIGN=_align(layout),
                                       **_launch_opts(ch))


def quantize(x: torch.Tensor, layout: BlockLayout, bits: int, out: QuantizedRows | None = None, *,
             poison: bool = False) -> QuantizedRows:
    """``blockwise.quantize`` on the device of ``x``; syncs once to raise, never with ``poison=True``."""
    spec.check_bits(bits)
    rows = spec.as_rows(x, layout).detach()
    g = rows.shape[0]
    if out is not None:
        spec.check_quantize_out(out, g, layout, bits)
    device = _check_devices("quantize", rows, *(out if out is not None else ()))
    res = out if out is not None else _empty_rows(g, layout, bits, device)
    if g * layout.num_blocks == 0:
        return res
    _check_size(g, layout)
    src = rows.contiguous().view(_BITS_VIEW[rows.dtype])
    _launch_quantize(src, res.scales, res, layout, bits, g, poison, src_kind=0, dt=_DT[rows.dtype], bits_in=bits,
                     rows=g, pieces=1)
    return res


def dequantize(q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``blockwise.dequantize`` on the device of ``q``."""
    g = spec.check_dequantize_args(q, layout, bits, dtype)
    if out is not None:
        spec.check_out(out, g, layout, dtype)
    device = _check_devices("dequantize", q.data, q.scales, *(() if out is None else (out,)))
    y = out if out is not None else torch.empty(g, layout.numel, dtype=dtype, device=device)
    if g * layout.num_blocks:
        _check_size(g, layout)
        _launch_dequantize(q, layout, bits, y, g, 1, None)
    return y


def dequantize_sum(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None = None,
                   divisor: float | None = None) -> torch.Tensor:
    """``blockwise.dequantize_sum`` on the device of ``q`` (one kernel, no sync)."""
    rows, div = spec.check_sum_args(q, layout, bits, pieces, out, divisor)
    device = _check_devices("dequantize_sum", q.data, q.scales, *(() if out is None else (out,)))
    y = out if out is not None else torch.empty(rows, layout.numel, dtype=torch.float32, device=device)
    if rows * layout.num_blocks:
        _check_size(rows * pieces, layout)
        _launch_dequantize(q, layout, bits, y, rows, pieces, div)
    return y


def dequantize_sum_quantize(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int,
                            out: QuantizedRows | None = None, *, poison: bool = False) -> QuantizedRows:
    """``blockwise.dequantize_sum_quantize`` fused into one kernel (plus the int4 seam kernel): the sums never
    reach memory. Syncs once to raise, never with ``poison=True``."""
    g = spec.check_dequantize_args(q, layout, bits, torch.float32)
    rows = spec.check_pieces(g, pieces)
    if out is not None:
        spec.check_quantize_out(out, rows, layout, bits)
    device = _check_devices("dequantize_sum_quantize", q.data, q.scales, *(out if out is not None else ()))
    res = out if out is not None else _empty_rows(rows, layout, bits, device)
    if rows * layout.num_blocks == 0:
        return res
    _check_size(g, layout)
    _launch_quantize(_data_view(_dense_rows(q.data), bits), q.scales.contiguous(), res, layout, bits, rows, poison,
                     src_kind=1, dt=0, bits_in=bits, rows=rows, pieces=pieces)
    return res
