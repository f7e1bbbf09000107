"""Triton kernels for the block-wise quantizers: the device code (host wrappers: ``triton_path.py``).

Every kernel is bit-identical to ``blockwise.py`` (up to NaN payloads) on a GPU and under Triton's CPU
interpreter (``TRITON_INTERPRET=1``), which is how the CPU suite tests them. That rests on a few rules:

* Arithmetic is exact IEEE fp32: ``tl.div_rn`` (Triton's ``/`` on fp32 is an approximate division on NVIDIA),
  products and sums as separate roundings (launches pass ``enable_fp_fusion=False``, so no FMA contraction).
* Rounding to nearest even is done with integer steps (truncate, then compare the exact remainder with 1/2):
  libdevice's ``rint`` does not run in the interpreter, and the 1.5 * 2^23 trick is one compiler
  simplification away from a truncation.
* Conversions the interpreter gets wrong are done on bit patterns: bf16 -> fp32 is ``bits << 16`` (the
  interpreter flushes bf16 subnormals) and fp32 -> bf16 is c10's round-to-nearest-even on the bits (the
  interpreter rounds ties away and drops the carry). fp16 <-> fp32 use Triton's casts (numpy in the
  interpreter, ``cvt.rn`` on the GPU: both exact / round to nearest even).
* max |x| runs on the bit patterns of |x| (they order like the values), with inf/nan counted as +inf, so one
  integer max also tells whether the block is bad (a float ``tl.maximum`` would drop NaN on the GPU).

Layout: one program per (row, block); block ``b`` covers row elements ``[starts[b], starts[b + 1])``. Chunks of
``CH`` elements start at an even element so that int4 nibble pairs never split across chunks. An int4 byte
whose two nibbles belong to two blocks (a block starting at an odd element) is written by neither block's
program but by ``_int4_seam_kernel``, launched after, which reads both blocks' scales: no two programs ever
write one byte.

``ALIGN`` (constexpr): what each chunk's first element offset and each block's end are known to be multiples
of (up to 16) when the layout is aligned (blocks start at multiples of the block size, and the row length is a
multiple too); 2 otherwise (no hint). Offsets get ``tl.multiple_of`` and masks ``tl.max_constancy`` (a block's
bounds cut no aligned run of ALIGN elements in two), so that masked loads and stores vectorize: without the
mask hint every element is its own 1- or 2-byte access, which ran the kernels at 0.17x a copy on an H200.

Sources (constexpr ``SRC``): 0 = a float tensor ``x`` [G, numel] (passed as its int32 / int16 bit patterns,
``DT`` 0 fp32, 1 bf16, 2 fp16); 1 = quantized rows stacked as [pieces, R, ...] whose dequantized values are
summed over the pieces left to right in fp32 (the spec's order): dequantize is the case pieces = 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

QNAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # the NaN torch writes for float("nan")
NO_BAD_BLOCK = 2**31 - 1  # initial value of the first-bad-block flag (atomic_min)


@triton.jit
def _values(src, src_scales, row, blk, c, lo, hi, numel, payload_in, nb, rows, pieces,
            SRC: tl.constexpr, DT: tl.constexpr, BITS_IN: tl.constexpr, CH: tl.constexpr, ALIGN: tl.constexpr):
    """fp32 values and finiteness of elements [c, c + CH) (c even) of source row ``row``, 0 outside [lo, hi).

    SRC 0: ``x`` bit patterns. SRC 1: the sum over pieces of ``code * scale`` of quantized row
    ``p * rows + row``; ``blk`` is the block of the elements (a scalar, or a [CH] tensor). The sum starts from
    -0.0, the exact additive identity (-0 + x == x bit for bit, x = -0 included), so it equals the spec's sum
    that starts from piece 0. One helper, not three: the interpreter pays for every nested jit call."""
    offs = c + tl.arange(0, CH)
    if ALIGN > 2:  # vectorization hint: see ALIGN in the module docstring
        offs = tl.multiple_of(offs, ALIGN)
    inside = (offs >= lo) & (offs < hi)
    if ALIGN > 2:
        inside = tl.max_constancy(inside, ALIGN)
    if SRC == 0:
        bits = tl.load(src + row * numel + offs, mask=inside, other=0)
        if DT == 0:
            v = bits.to(tl.float32, bitcast=True)
            fin = (bits & 0x7FFFFFFF) < 0x7F800000
        elif DT == 1:
            b = bits.to(tl.int32) & 0xFFFF
            v = (b << 16).to(tl.float32, bitcast=True)
            fin = (b & 0x7FFF) < 0x7F80
        else:
            v = bits.to(tl.float16, bitcast=True).to(tl.float32)
            fin = (bits.to(tl.int32) & 0x7FFF) < 0x7C00
    else:
        # -0.0 from its bits: Triton may build a float literal equal to 0 as +0.0
        v = tl.full([CH], -2147483648, tl.int32).to(tl.float32, bitcast=True)
        j = c // 2 + tl.arange(0, CH // 2)
        if ALIGN // 2 > 2:  # vectorization hint: see ALIGN in the module docstring
            j = tl.multiple_of(j, ALIGN // 2)
        for p in range(0, pieces):
            qrow = p * rows + row
            sc = tl.load(src_scales + qrow * nb + blk)
            if BITS_IN == 8:
                code = tl.load(src + qrow * payload_in + offs, mask=inside, other=0).to(tl.float32)
            else:
                owned = (2 * j + 1 >= lo) & (2 * j < hi)
                if ALIGN // 2 > 2:
                    owned = tl.max_constancy(owned, ALIGN // 2)
                byte = tl.load(src + qrow * payload_in + j, mask=owned, other=0)
                byte = byte.to(tl.int32)
                nib = tl.reshape(tl.join(byte & 15, byte >> 4), [CH])  # element 2j: low nibble, 2j + 1: high
                code = (nib - 8).to(tl.float32)
            # 0 outside [lo, hi) after the product: a neighbour's nibble, or 0 * a NaN scale, must not leak in.
            v = v + tl.where(inside, code * sc, 0.0)
        fin = (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    return v, fin


@triton.jit
def _block_absmax(src, src_scales, row, blk, s, e, numel, payload_in, nb, rows, pieces,
                  SRC: tl.constexpr, DT: tl.constexpr, BITS_IN: tl.constexpr, CH: tl.constexpr, ALIGN: tl.constexpr):
    """(max |v| over the finite values of block [s, e) as fp32, whether some value is inf/nan).

    One max over bit patterns (for |v| they order like the values) with inf/nan counted as +inf; only a bad
    block takes a second pass for its finite-only max."""
    m = tl.full([CH], 0, tl.int32)
    for c in range(s - s % 2, e, CH):
        v, fin = _values(src, src_scales, row, blk, c, s, e, numel, payload_in, nb, rows, pieces,
                         SRC, DT, BITS_IN, CH, ALIGN)
        m = tl.maximum(m, tl.where(fin, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800000))
    top = tl.max(m, axis=0)
    bad = top >= 0x7F800000
    if bad:
        m = tl.full([CH], 0, tl.int32)
        for c in range(s - s % 2, e, CH):
            v, fin = _values(src, src_scales, row, blk, c, s, e, numel, payload_in, nb, rows, pieces,
                             SRC, DT, BITS_IN, CH, ALIGN)
            m = tl.maximum(m, tl.where(fin, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
        top = tl.max(m, axis=0)
    return top.to(tl.float32, bitcast=True), bad


@triton.jit
def _codes(v, fin, div, QMAX: tl.constexpr, ONE_DIV: tl.constexpr):
    """``clamp(round_half_even(v * (1 / div)), -QMAX, QMAX)`` as int32, with non-finite ``v`` taken as 0; the
    clamped ``v / div`` where ``div`` is subnormal (Note [reciprocal codes] in ``blockwise.py``).

    ONE_DIV: ``div`` is one scalar, so the subnormal case is a branch, not an exact division of every element
    that a ``tl.where`` would throw away (a dozen instructions an element on a GPU)."""
    w = tl.where(fin, v, 0.0)
    if ONE_DIV:
        if div >= 1.1754943508222875e-38:  # 2^-126
            t = w * tl.div_rn(1.0, div)
        else:
            t = tl.div_rn(w, div)
    else:
        t = tl.where(div >= 1.1754943508222875e-38, w * tl.div_rn(1.0, div), tl.div_rn(w, div))
    # Clamping first is the same as clamping after (QMAX is an integer) and keeps |t| small.
    t = tl.minimum(tl.maximum(t, -QMAX * 1.0), QMAX * 1.0)
    i = t.to(tl.int32)  # toward zero
    f = tl.abs(t - i.to(tl.float32))  # exact
    up = (f > 0.5) | ((f == 0.5) & ((i & 1) != 0))
    return tl.where(up, tl.where(t < 0, i - 1, i + 1), i)


@triton.jit
def _put_codes(out, v, fin, div, c, s, e, jlo, jhi, BITS: tl.constexpr, QMAX: tl.constexpr, CH: tl.constexpr,
               ALIGN: tl.constexpr):
    """Store the codes of chunk [c, c + CH) that block [s, e) owns: int8 bytes, or the int4 bytes [jlo, jhi)."""
    offs = c + tl.arange(0, CH)
    if ALIGN > 2:  # vectorization hint: see ALIGN in the module docstring
        offs = tl.multiple_of(offs, ALIGN)
    mine = (offs >= s) & (offs < e)
    if ALIGN > 2:
        mine = tl.max_constancy(mine, ALIGN)
    if BITS == 8:
        tl.store(out + offs, _codes(v, fin, div, QMAX, True).to(tl.int8), mask=mine)
    else:
        nib = tl.where(mine, _codes(v, fin, div, QMAX, True) + 8, 0)
        lo, hi = tl.split(tl.reshape(nib, [CH // 2, 2]))
        j = c // 2 + tl.arange(0, CH // 2)
        if ALIGN // 2 > 2:
            j = tl.multiple_of(j, ALIGN // 2)
        owned = (j >= jlo) & (j < jhi)
        if ALIGN // 2 > 2:
            owned = tl.max_constancy(owned, ALIGN // 2)
        tl.store(out + j, (lo | (hi << 4)).to(tl.uint8), mask=owned)


@triton.jit
def _quantize_kernel(src, src_scales, data, scales, flag, starts, numel, payload_in, payload, nb, rows, pieces,
                     SRC: tl.constexpr, DT: tl.constexpr, BITS_IN: tl.constexpr, BITS: tl.constexpr,
                     QMAX: tl.constexpr, FLAG: tl.constexpr, CH: tl.constexpr, ALIGN: tl.constexpr,
                     ONE_CHUNK: tl.constexpr):
    """One block of one row: scale (NaN if the block holds inf/nan), codes, and the first-bad-block flag.

    ONE_CHUNK: every block fits the chunk that starts at its first even element, so the block is read once and
    its values stay in registers between the max and the codes (without it, the codes pass reads it again)."""
    pid = tl.program_id(0)
    row = (pid // nb).to(tl.int64)
    blk = pid % nb
    s = tl.load(starts + blk)
    e = tl.load(starts + blk + 1)
    if ONE_CHUNK:
        v, fin = _values(src, src_scales, row, blk, s - s % 2, s, e, numel, payload_in, nb, rows, pieces,
                         SRC, DT, BITS_IN, CH, ALIGN)
        mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # as in _block_absmax
        top = tl.max(tl.where(fin, mag, 0x7F800000), axis=0)
        bad = top >= 0x7F800000
        if bad:
            top = tl.max(tl.where(fin, mag, 0), axis=0)
        m = top.to(tl.float32, bitcast=True)
    else:
        m, bad = _block_absmax(src, src_scales, row, blk, s, e, numel, payload_in, nb, rows, pieces,
                               SRC, DT, BITS_IN, CH, ALIGN)
    sc = tl.div_rn(m, QMAX * 1.0)
    div = tl.where(sc == 0.0, 1.0, sc)
    tl.store(scales + pid, tl.where(bad, QNAN_BITS, sc.to(tl.int32, bitcast=True)))
    if FLAG:
        tl.atomic_min(flag, pid, mask=bad)
    out = data + row * payload
    # int4: the bytes this block owns, not one shared with the previous block (odd s) nor with the next (odd
    # e, unless e ends the row: that byte's high nibble is the zero padding).
    jlo = (s + 1) // 2
    jhi = (e + (e == numel).to(tl.int64)) // 2
    if ONE_CHUNK:
        _put_codes(out, v, fin, div, s - s % 2, s, e, jlo, jhi, BITS, QMAX, CH, ALIGN)
    else:
        for c in range(s - s % 2, e, CH):
            v, fin = _values(src, src_scales, row, blk, c, s, e, numel, payload_in, nb, rows, pieces,
                             SRC, DT, BITS_IN, CH, ALIGN)
            _put_codes(out, v, fin, div, c, s, e, jlo, jhi, BITS, QMAX, CH, ALIGN)


@triton.jit
def _divisor(scales, src, src_scales, row, blk, starts, numel, payload_in, nb, rows, pieces,
             SRC: tl.constexpr, DT: tl.constexpr, BITS_IN: tl.constexpr, QMAX: tl.constexpr, CH: tl.constexpr):
    """The divisor block ``blk``'s codes were computed with, from its stored scale; a poisoned block (NaN
    scale) has its finite-only scale recomputed from the source."""
    sc = tl.load(scales + row * nb + blk).to(tl.float32, bitcast=True)
    if sc != sc:
        s = tl.load(starts + blk)
        e = tl.load(starts + blk + 1)
        m, _ = _block_absmax(src, src_scales, row, blk, s, e, numel, payload_in, nb, rows, pieces,
                             SRC, DT, BITS_IN, CH, 2)
        sc = tl.div_rn(m, QMAX * 1.0)
    return tl.where(sc == 0.0, 1.0, sc)


@triton.jit
def _int4_seam_kernel(src, src_scales, data, scales, starts, seams, n_seams, numel, payload_in, payload, nb,
                      rows, pieces, SRC: tl.constexpr, DT: tl.constexpr, BITS_IN: tl.constexpr,
                      QMAX: tl.constexpr, CH: tl.constexpr):
    """The byte holding the last element of block b - 1 (low nibble) and the first of block b (high nibble),
    for each block b in ``seams`` (blocks starting at an odd element), of each row."""
    pid = tl.program_id(0)
    row = (pid // n_seams).to(tl.int64)
    b = tl.load(seams + pid % n_seams)
    s = tl.load(starts + b)
    d0 = _divisor(scales, src, src_scales, row, b - 1, starts, numel, payload_in, nb, rows, pieces,
                  SRC, DT, BITS_IN, QMAX, CH)
    d1 = _divisor(scales, src, src_scales, row, b, starts, numel, payload_in, nb, rows, pieces,
                  SRC, DT, BITS_IN, QMAX, CH)
    k = tl.arange(0, 2)  # element s - 1 + k lies in block b - 1 + k
    v, fin = _values(src, src_scales, row, b - 1 + k, s - 1, s - 1, s + 1, numel, payload_in, nb, rows, pieces,
                     SRC, DT, BITS_IN, 2, 2)
    nib = _codes(v, fin, tl.where(k == 0, d0, d1), QMAX, False) + 8
    tl.store(data + row * payload + (s - 1) // 2, tl.sum(nib << (4 * k), axis=0).to(tl.uint8))


@triton.jit
def _to_bf16_bits(v):
    """fp32 -> bfloat16 bit pattern (int16), round to nearest even; NaN -> 0x7FC0 (c10's rule)."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def _dequantize_kernel(data, scales, y, starts, numel, payload, nb, rows, pieces, divisor,
                       HAS_DIV: tl.constexpr, DT_OUT: tl.constexpr, BITS: tl.constexpr, CH: tl.constexpr,
                       ALIGN: tl.constexpr):
    """One block of one output row: the sum over pieces of the dequantized rows (divided by ``divisor``),
    stored as fp32, bf16 bits or fp16."""
    pid = tl.program_id(0)
    row = (pid // nb).to(tl.int64)
    blk = pid % nb
    s = tl.load(starts + blk)
    e = tl.load(starts + blk + 1)
    for c in range(s - s % 2, e, CH):
        v, _ = _values(data, scales, row, blk, c, s, e, numel, payload, nb, rows, pieces, 1, 0, BITS, CH, ALIGN)
        if HAS_DIV:
            v = tl.div_rn(v, divisor)
        offs = c + tl.arange(0, CH)
        if ALIGN > 2:  # vectorization hint: see ALIGN in the module docstring
            offs = tl.multiple_of(offs, ALIGN)
        mask = (offs >= s) & (offs < e)
        if ALIGN > 2:
            mask = tl.max_constancy(mask, ALIGN)
        if DT_OUT == 0:
            tl.store(y + row * numel + offs, v, mask=mask)
        elif DT_OUT == 1:
            tl.store(y + row * numel + offs, _to_bf16_bits(v), mask=mask)
        else:
            tl.store(y + row * numel + offs, v.to(tl.float16), mask=mask)
