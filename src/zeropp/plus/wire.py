"""Quantized rows on the wire: payload bytes and fp32 scales packed into one uint8 row per destination.

One collective per hop instead of two (data, then scales) halves the number of messages; rows stay
independent, so they split evenly across ranks for all-gather and all-to-all.

``encode_rows`` / ``decode_rows`` are the strategies' hot path: they quantize straight into the rows of a
reused send buffer and dequantize straight out of a reused receive buffer into a reused output (Note
[buffer pool] in ``comm/buffers.py``). One quantizer call per row: a row's payload is a contiguous slice of
the packed buffer, several rows' payloads are not. The scales go through a small fp32 scratch (``4 *
num_blocks`` bytes a row, about 1/500 of an int8 payload at blocks of 2048) because a row's scale bytes
start at byte offset ``payload``, which need not be a multiple of 4, and the byte counts on the wire are
fixed by ``accounting.py`` (no padding). ``pack`` / ``unpack`` are the allocating reference of the same
format (tests, and the "before" of ``bench/bench_hot_path.py``).

Note [non-finite poisoning]: a rank that finds inf/nan in what it must quantize must not raise before the
collective: its peers would wait forever. It sends the block with a NaN scale instead, so the damage arrives
on every receiver, located to the block; each then reacts the same way (qwZ raises naming the parameter,
qgZ delivers NaN gradients to the owning shard, where the engine skips the step and names the parameter).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from zeropp.quant import BlockLayout, QuantizedRows, dequantize, payload_bytes, quantize


@dataclass(frozen=True)
class WireFormat:
    """Byte layout of one quantized row on the wire: ``payload`` data bytes, then ``4 * num_blocks`` scale bytes."""

    layout: BlockLayout
    bits: int

    @functools.cached_property
    def payload(self) -> int:
        return payload_bytes(self.layout, self.bits)

    @functools.cached_property
    def row_bytes(self) -> int:
        return self.payload + 4 * self.layout.num_blocks


def pack(q: QuantizedRows) -> torch.Tensor:
    """``[G, payload + 4 * num_blocks]`` uint8: each row's quantized data followed by its scales' bytes."""
    return torch.cat([q.data, q.scales.contiguous().view(torch.uint8)], dim=1)


def unpack(rows: torch.Tensor, payload: int) -> QuantizedRows:
    """Inverse of :func:`pack` for rows whose data part is ``payload`` bytes."""
    # clone, not contiguous(): a single row's slice is already "contiguous" but starts at byte offset
    # `payload`, and viewing bytes as float32 needs a 4-byte aligned offset.
    scales = rows[:, payload:].clone(memory_format=torch.contiguous_format)
    return QuantizedRows(rows[:, :payload].contiguous(), scales.view(torch.float32))


def encode_rows(fmt: WireFormat, rows: Sequence[torch.Tensor], wire: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``rows[i]`` (``[numel]`` each) into row ``i`` of ``wire`` (``[len(rows), fmt.row_bytes]`` uint8).

    ``scales``: a ``[len(rows), num_blocks]`` fp32 scratch. Bytes equal ``pack(quantize_poisoning(...))``.
    """
    layout, pb = fmt.layout, fmt.payload
    for i, x in enumerate(rows):
        out = QuantizedRows(wire[i, :pb].view(1, pb), scales[i : i + 1])
        quantize_poisoning(x.reshape(1, layout.numel), layout, fmt.bits, out)
    wire[:, pb:].copy_(scales.view(torch.uint8))


def decode_rows(fmt: WireFormat, wire: torch.Tensor, dtype: torch.dtype, out: torch.Tensor,
                scales: torch.Tensor) -> None:
    """Dequantize every row of ``wire`` into ``out`` (``[G, numel]`` of ``dtype``); ``scales`` ([G, num_blocks]
    fp32) is left holding the rows' scales, for :func:`first_poisoned`."""
    layout, pb = fmt.layout, fmt.payload
    scales.view(torch.uint8).copy_(wire[:, pb:])
    for i in range(wire.shape[0]):
        q = QuantizedRows(wire[i, :pb].view(1, pb), scales[i : i + 1])
        dequantize(q, layout, fmt.bits, dtype, out=out[i : i + 1])


def quantize_poisoning(x: torch.Tensor, layout: BlockLayout, bits: int,
                       out: Optional[QuantizedRows] = None) -> QuantizedRows:
    """``quantize`` (into ``out`` when given), except that blocks holding inf/nan get a NaN scale instead of
    an exception: the quantizer's own ``poison=True`` (one pass, no host sync on CUDA)."""
    return quantize(x, layout, bits, out, poison=True)


def first_poisoned(scales: torch.Tensor, layout: BlockLayout) -> Optional[tuple[int, int]]:
    """``(row, segment)`` of the first block with a non-finite scale, or None when all are finite."""
    bad = ~torch.isfinite(scales)
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    row, block = divmod(flat, layout.num_blocks)
    return row, int(layout.block_segment()[block])
