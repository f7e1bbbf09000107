"""Quantized rows on the wire: payload bytes and fp32 scales packed into one uint8 row per destination.

One collective per hop instead of two (data, then scales) halves the number of messages; rows stay
independent, so they split evenly across ranks for all-gather and all-to-all.

Note [non-finite poisoning]: a rank that finds inf/nan in what it must quantize must not raise before the
collective: its peers would wait forever. It sends the block with a NaN scale instead, so the damage arrives
on every receiver, located to the block; each then reacts the same way (qwZ raises naming the parameter,
qgZ delivers NaN gradients to the owning shard, where the engine skips the step and names the parameter).
"""
from __future__ import annotations

from typing import Optional

import torch

from zeropp.quant import BlockLayout, NonFiniteInputError, QuantizedRows, quantize


def pack(q: QuantizedRows) -> torch.Tensor:
    """``[G, payload + 4 * num_blocks]`` uint8: each row's quantized data followed by its scales' bytes."""
    return torch.cat([q.data, q.scales.contiguous().view(torch.uint8)], dim=1)


def unpack(rows: torch.Tensor, payload: int) -> QuantizedRows:
    """Inverse of :func:`pack` for rows whose data part is ``payload`` bytes."""
    # clone, not contiguous(): a single row's slice is already "contiguous" but starts at byte offset
    # `payload`, and viewing bytes as float32 needs a 4-byte aligned offset.
    scales = rows[:, payload:].clone(memory_format=torch.contiguous_format)
    return QuantizedRows(rows[:, :payload].contiguous(), scales.view(torch.float32))


def quantize_poisoning(x: torch.Tensor, layout: BlockLayout, bits: int) -> QuantizedRows:
    """``quantize``, except that blocks holding inf/nan get a NaN scale instead of an exception."""
    try:
        return quantize(x, layout, bits)
    except NonFiniteInputError:
        pass
    rows = x.reshape(-1, layout.numel)
    finite = torch.isfinite(rows)
    q = quantize(torch.where(finite, rows, torch.zeros((), dtype=rows.dtype)), layout, bits)
    starts = layout.block_starts()
    block_of = torch.repeat_interleave(torch.arange(layout.num_blocks), starts[1:] - starts[:-1]).to(rows.device)
    bad = torch.zeros(rows.shape[0], layout.num_blocks, device=rows.device).index_add_(
        1, block_of, (~finite).float()) > 0
    scales = q.scales.clone()
    scales[bad] = float("nan")
    return QuantizedRows(q.data, scales)


def first_poisoned(scales: torch.Tensor, layout: BlockLayout) -> Optional[tuple[int, int]]:
    """``(row, segment)`` of the first block with a non-finite scale, or None when all are finite."""
    bad = ~torch.isfinite(scales)
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    row, block = divmod(flat, layout.num_blocks)
    return row, int(layout.block_segment()[block])
