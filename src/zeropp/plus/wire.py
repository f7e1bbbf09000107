"""Quantized rows on the wire: payload bytes and fp32 scales packed into one uint8 row per destination.

One collective per hop instead of two (data, then scales) halves the number of messages; rows stay
independent, so they split evenly across ranks for all-gather and all-to-all.
"""
from __future__ import annotations

import torch

from zeropp.quant import QuantizedRows


def pack(q: QuantizedRows) -> torch.Tensor:
    """``[G, payload + 4 * num_blocks]`` uint8: each row's quantized data followed by its scales' bytes."""
    return torch.cat([q.data, q.scales.contiguous().view(torch.uint8)], dim=1)


def unpack(rows: torch.Tensor, payload: int) -> QuantizedRows:
    """Inverse of :func:`pack` for rows whose data part is ``payload`` bytes."""
    return QuantizedRows(rows[:, :payload].contiguous(), rows[:, payload:].contiguous().view(torch.float32))
