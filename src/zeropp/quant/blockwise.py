"""Block-wise symmetric quantizers as plain tensor code: the executable specification.

Every other implementation (``fast.py``, future GPU kernels) must give bit-identical results to this file.

Format (one row; G rows share a ``BlockLayout`` and are independent, so callers can split the data and scales
evenly across ranks for all-to-all / all-gather):

* per block: ``absmax = max |x|``; fp32 ``scale = absmax / qmax`` (qmax 127 for int8, 7 for int4, 1 for int2);
  ``q = round_half_to_even(x * r)`` with the block's reciprocal ``r = 1 / scale`` (an fp32 division once per
  block, then one fp32 product per element), computed in fp32. An all-zero block has scale 0 and q 0. A
  block whose scale is subnormal (absmax below about 1e-37) uses ``q = clamp(round_half_to_even(x / scale),
  -qmax, qmax)`` (a true division per element) instead: there ``1 / scale`` may overflow and the scale has
  lost precision. Note [reciprocal codes] says why a product, and why it needs no clamp.
* int8: q as its two's-complement byte, stored in a uint8 tensor (so it can travel on gloo as uint8).
* int4: ``q + 8`` in a nibble, two per byte, element 2k in the low nibble and 2k+1 in the high nibble; when
  numel is odd the row ends with one zero nibble of padding.
* int2: ``q + 2`` (1, 2 or 3) in two bits, four per byte, element 4k + i in bits 2i and 2i + 1; a row whose
  numel is not a multiple of 4 ends with zero bits of padding. (1 bit has no symmetric code: qmax would be 0.)
  The C and Triton kernels cover int8 and int4; int2 runs this specification on every device.
* dequantize: ``q * scale`` in fp32, then cast (round to nearest even) to the requested dtype.

Non-finite input (inf or nan) raises ``NonFiniteInputError`` naming the first offending row and segment; the
check costs nothing extra because max |x| propagates both. With ``poison=True`` a block holding inf/nan instead
gets a NaN scale, and its codes are those of the block with every non-finite element replaced by 0 (Note
[non-finite poisoning] in ``plus/wire.py``): the hot path then never waits on the device to learn whether to raise.

qgZ's reduction steps (``dequantize_sum``, ``dequantize_sum_quantize``) are defined here too, with one fixed fp32
summation order, so that every implementation (C on CPU, Triton on GPU) can match them bit for bit:
``acc = deq(piece 0); acc = acc + deq(piece 1); ...; acc = acc + deq(piece P-1)`` (left to right, one rounding
per addition, no fused multiply-add), then optionally ``acc / divisor`` (a true fp32 division by the divisor
rounded to fp32). Starting from -0.0 (the exact additive identity) gives the same sums as starting from
``deq(piece 0)``; starting from +0.0 would turn a -0 into +0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import BlockLayout, layout_index, payload_bytes

__all__ = [
    "QMAX",
    "NonFiniteInputError",
    "QuantizedRows",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_quantize",
    "quantize",
]

QMAX = {8: 127, 4: 7, 2: 1}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedRows(NamedTuple):
    """Quantized rows: ``data`` uint8 [G, payload_bytes(layout, bits)], ``scales`` float32 [G, num_blocks]."""

    data: torch.Tensor
    scales: torch.Tensor


class NonFiniteInputError(ValueError):
    """Raised by ``quantize`` when the input holds inf or nan; ``row`` and ``segment`` locate the first one."""

    def __init__(self, row: int, segment: int) -> None:
        super().__init__(f"quantize: input row {row}, segment {segment} contains inf or nan")
        self.row = row
        self.segment = segment


def check_bits(bits: int) -> int:
    """Return qmax for ``bits`` (8, 4 or 2) or raise ValueError."""
    if bits not in QMAX:
        why = " (symmetric quantization has no 1-bit code: qmax = 2**0 - 1 = 0)" if bits == 1 else ""
        raise ValueError(f"bits must be 8, 4 or 2, got {bits!r}{why}")
    return QMAX[bits]


def as_rows(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Validate ``x`` against ``layout`` and view it as [G, numel] (a 1-D input is one row)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"quantize: dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2 or x.shape[1] != layout.numel:
        raise ValueError(f"quantize: expected shape [G, {layout.numel}] or [{layout.numel}], got {list(x.shape)}")
    return x


def raise_non_finite(bad_flat_block: int, layout: BlockLayout) -> None:
    """Raise NonFiniteInputError for the block at row-major index ``bad_flat_block`` of [G, num_blocks]."""
    row, block = divmod(bad_flat_block, layout.num_blocks)
    raise NonFiniteInputError(row, int(layout.block_segment()[block]))


def check_dequantize_args(q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype) -> int:
    """Validate dequantize inputs; return G."""
    check_bits(bits)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    data, scales = q
    if data.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"dequantize: expected uint8 data and float32 scales, got {data.dtype}, {scales.dtype}")
    g = data.shape[0] if data.dim() == 2 else -1
    pb = payload_bytes(layout, bits)
    if data.dim() != 2 or data.shape[1] != pb or tuple(scales.shape) != (g, layout.num_blocks):
        raise ValueError(
            f"dequantize: expected data [G, {pb}] and scales [G, {layout.num_blocks}], "
            f"got {list(data.shape)} and {list(scales.shape)}"
        )
    return g


def check_out(out: torch.Tensor, g: int, layout: BlockLayout, dtype: torch.dtype) -> None:
    """``out`` must be contiguous, of ``dtype``, with G * numel elements (any shape, e.g. a flat buffer)."""
    if out.dtype != dtype or out.numel() != g * layout.numel or not out.is_contiguous():
        raise ValueError(
            f"dequantize: out must be a contiguous {dtype} tensor of {g * layout.numel} elements, "
            f"got {out.dtype} {list(out.shape)}"
        )


def rows_dense(t: torch.Tensor) -> bool:
    """True when each row of the 2-D ``t`` is contiguous (rows may sit apart, e.g. the data bytes of a wire
    buffer whose rows also carry scales): what the kernels can address with one row stride."""
    return t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def check_quantize_out(out: QuantizedRows, g: int, layout: BlockLayout, bits: int) -> None:
    """``out`` must hold uint8 data [G, payload_bytes] (each row contiguous, rows possibly apart) and
    contiguous float32 scales [G, num_blocks]."""
    data, scales = out
    pb, nb = payload_bytes(layout, bits), layout.num_blocks
    ok = (data.dtype == torch.uint8 and scales.dtype == torch.float32 and tuple(data.shape) == (g, pb)
          and tuple(scales.shape) == (g, nb) and rows_dense(data) and scales.is_contiguous())
    if not ok:
        raise ValueError(
            f"quantize: out must be uint8 [{g}, {pb}] with contiguous rows and contiguous float32 [{g}, {nb}], "
            f"got {data.dtype} {list(data.shape)} and {scales.dtype} {list(scales.shape)}"
        )


def _to_blocks(xf: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[G, numel] -> [G, num_blocks, block_size]; padding (only in the unaligned case) is zero."""
    g, bs, nb = xf.shape[0], layout.block_size, layout.num_blocks
    pos = layout_index(layout, xf.device).scratch_pos
    if pos is None:  # every segment is a whole number of blocks: a pure reshape
        return xf.reshape(g, nb, bs)
    scratch = xf.new_zeros(g, nb * bs)
    scratch[:, pos] = xf
    return scratch.view(g, nb, bs)


def _from_blocks(blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[G, num_blocks, block_size] -> [G, numel] in row order (drops the padding)."""
    g = blocks.shape[0]
    pos = layout_index(layout, blocks.device).scratch_pos
    flat = blocks.reshape(g, -1)
    return flat if pos is None else flat[:, pos]


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [G, numel] -> uint8 payload [G, payload_bytes]."""
    if bits == 8:
        return q.view(torch.uint8)
    if bits == 2:
        crumbs = (q + 2).to(torch.uint8)
        pad = -crumbs.shape[1] % 4
        if pad:
            crumbs = torch.nn.functional.pad(crumbs, (0, pad))
        return crumbs[:, 0::4] | (crumbs[:, 1::4] << 2) | (crumbs[:, 2::4] << 4) | (crumbs[:, 3::4] << 6)
    nib = (q + 8).to(torch.uint8)
    if nib.shape[1] % 2:  # odd numel: pad the row with one zero nibble
        nib = torch.nn.functional.pad(nib, (0, 1))
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _unpack(data: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """uint8 payload [G, payload_bytes] -> int8 codes [G, numel]."""
    if bits == 8:
        return data.view(torch.int8)
    if bits == 2:
        crumbs = torch.stack([(data >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(data.shape[0], -1)
        return crumbs[:, :numel].to(torch.int8) - 2
    nib = torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], -1)[:, :numel]
    return nib.to(torch.int8) - 8


_FLT_MIN = 2.0 ** -126  # the smallest normal fp32

# Note [reciprocal codes]: the codes are ``x * (1 / scale)``, not ``x / scale``: a division per element cost a
# quarter of the CPU kernel's quantize and a fifth of qgZ's fused middle step, where a product costs what an
# addition does; every implementation rounds the one reciprocal per block and each product the same way
# (IEEE fp32, no fused multiply-add), so they agree bit for bit as they did on the division. The two differ in
# the last bit of the ratio for some inputs, so a code differs (by one) only where the exact ratio lies within
# about 2^-23 of a half-integer; the rounding error of either is far below the quantization step. No clamp is
# needed for a normal scale: scale = absmax / qmax (1 + e1) and r = 1 / scale (1 + e2) with |e1|, |e2| <= 2^-24,
# so every |x| <= absmax gives |x * r| <= qmax (1 + 2^-22) (another 2^-24 for the product's rounding), which
# rounds to at most qmax (int2's r is subnormal above absmax 2^126, with |e2| <= 2^-21: still far below the
# 1 / (2 qmax) that would matter). A subnormal scale (absmax below about 1e-37: gradients that are zero in all but name)
# can be far from absmax / qmax, so those blocks keep the clamped division.


def quantize(x: torch.Tensor, layout: BlockLayout, bits: int, out: QuantizedRows | None = None, *,
             poison: bool = False) -> QuantizedRows:
    """Block-wise symmetric abs-max quantization of the rows of ``x``.

    Args:
        x: [G, numel] or [numel] (one row), float32 / bfloat16 / float16, any device.
        layout: block structure shared by every row.
        bits: 8 (int8), 4 (int4, two per byte) or 2 (int2, four per byte).
        out: optional preallocated QuantizedRows (e.g. views of a collective's send buffer: data rows may be
            strided) to write into; its contents are unspecified if an error is raised.
        poison: give blocks holding inf/nan a NaN scale (codes as if those elements were 0) instead of raising.

    Returns:
        QuantizedRows(data uint8 [G, payload_bytes(layout, bits)], scales float32 [G, num_blocks]), or ``out``.

    Raises:
        NonFiniteInputError: some element is inf or nan and ``poison`` is False (names the first such row and
            segment).
    """
    qmax = check_bits(bits)
    x = as_rows(x, layout).detach()
    if out is not None:
        check_quantize_out(out, x.shape[0], layout, bits)
    blocks = _to_blocks(x.float(), layout)
    absmax = blocks.abs().amax(dim=-1)  # [G, nb]; inf and nan propagate
    bad = ~torch.isfinite(absmax)
    any_bad = bool(bad.any())
    if any_bad and not poison:
        raise_non_finite(int(bad.flatten().nonzero()[0]), layout)
    if any_bad:  # poison: quantize the finite part, then mark the block
        blocks = torch.where(torch.isfinite(blocks), blocks, torch.zeros((), dtype=blocks.dtype))
        absmax = blocks.abs().amax(dim=-1)
    # Tensor operands throughout (a scalar divisor may become a reciprocal multiply on some backends).
    scales = absmax / torch.full_like(absmax, qmax)
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-zero block: 0 * 1 = 0
    recip = torch.ones_like(divisor) / divisor
    normal = (divisor >= _FLT_MIN).unsqueeze(-1)  # Note [reciprocal codes]
    ratio = torch.where(normal, blocks * recip.unsqueeze(-1), blocks / divisor.unsqueeze(-1))
    codes = torch.round(ratio).clamp_(-qmax, qmax).to(torch.int8)
    if any_bad:
        scales = scales.masked_fill(bad, float("nan"))
    data = _pack(_from_blocks(codes, layout), bits)
    if out is None:
        return QuantizedRows(data.contiguous(), scales.contiguous())
    out.data.copy_(data)
    out.scales.copy_(scales)
    return out


def dequantize(
    q: QuantizedRows, layout: BlockLayout, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``quantize``: ``q * scale`` in float32, cast to ``dtype``.

    Args:
        q: QuantizedRows as returned by ``quantize`` (possibly after a collective).
        layout, bits: as given to ``quantize``.
        dtype: output dtype (float32, bfloat16 or float16).
        out: optional contiguous ``dtype`` tensor with G * numel elements (any shape) to write into.

    Returns:
        [G, numel] tensor of ``dtype``, or ``out`` when given.
    """
    g = check_dequantize_args(q, layout, bits, dtype)
    codes = _unpack(q.data, layout.numel, bits)
    scales = q.scales
    pos = layout_index(layout, scales.device).scratch_pos
    if pos is None:
        y = codes.reshape(g, layout.num_blocks, layout.block_size).float() * scales.unsqueeze(-1)
    else:
        y = codes.float() * scales[:, pos // layout.block_size]
    y = y.reshape(g, layout.numel).to(dtype)
    if out is None:
        return y
    check_out(out, g, layout, dtype)
    out.view(g, layout.numel).copy_(y)
    return out


def check_pieces(g: int, pieces: int) -> int:
    """Rows per piece of a [pieces * R, ...] stack of quantized rows; raise unless ``pieces`` divides G."""
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1 or g % pieces:
        raise ValueError(f"dequantize_sum: pieces must be a positive int dividing the {g} rows, got {pieces!r}")
    return g // pieces


def check_divisor(divisor: float | None) -> float | None:
    """The divisor rounded to fp32 (the value every implementation divides by), or None; must be > 0, finite."""
    if divisor is None:
        return None
    d = float(torch.tensor(float(divisor), dtype=torch.float32))
    if not (d > 0 and d != float("inf")):
        raise ValueError(f"dequantize_sum: divisor must be a finite number > 0, got {divisor!r}")
    return d


def check_sum_args(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None,
                   divisor: float | None) -> tuple[int, float | None]:
    """Validate ``dequantize_sum``'s arguments (every implementation's); return (rows per piece, divisor)."""
    rows = check_pieces(check_dequantize_args(q, layout, bits, torch.float32), pieces)
    div = check_divisor(divisor)
    if out is not None:
        check_out(out, rows, layout, torch.float32)
    return rows, div


def dequantize_sum(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int, out: torch.Tensor | None = None,
                   divisor: float | None = None) -> torch.Tensor:
    """Sum of ``pieces`` stacked pieces of quantized rows, dequantized in fp32: qgZ's reduction after a hop.

    Args:
        q: QuantizedRows of ``pieces * R`` rows laid out [pieces, R, ...] (piece p's row r is row ``p * R + r``),
            e.g. what an all-to-all delivers from ``pieces`` senders (the kernels read data rows in place when
            each row is contiguous, e.g. the data part of the receive buffer).
        layout, bits: as given to ``quantize``.
        pieces: how many pieces are summed.
        out: optional contiguous float32 tensor with R * numel elements (any shape) to write into.
        divisor: optional number > 0; the sums are divided by it (true fp32 division) at the end, e.g. the
            world size for a mean.

    Returns:
        float32 [R, numel]: ``sum_p deq(q)[p * R + r]`` added left to right in fp32 (module docstring), then
        divided by ``divisor``; or ``out`` when given.
    """
    rows, div = check_sum_args(q, layout, bits, pieces, out, divisor)
    y = dequantize(q, layout, bits, torch.float32).view(pieces, rows, layout.numel)
    acc = y[0].clone()
    for p in range(1, pieces):
        acc += y[p]
    if div is not None:
        acc /= torch.full_like(acc, div)
    if out is None:
        return acc
    out.view(rows, layout.numel).copy_(acc)
    return out


def dequantize_sum_quantize(q: QuantizedRows, layout: BlockLayout, bits: int, pieces: int,
                            out: QuantizedRows | None = None, *, poison: bool = False) -> QuantizedRows:
    """``quantize(dequantize_sum(q, layout, bits, pieces), layout, bits, out, poison=poison)``: qgZ's middle step
    (sum what arrived from the node, requantize for the inter-node hop). Blocks whose sum is not finite (a
    poisoned piece, or an overflow) raise NonFiniteInputError naming the output row, or are poisoned."""
    return quantize(dequantize_sum(q, layout, bits, pieces), layout, bits, out, poison=poison)
