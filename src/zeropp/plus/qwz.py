"""qwZ: the forward all-gather sends each rank's shard as block-quantized int8 (or int4) plus fp32 scales.

Blocks follow parameter boundaries (one segment per parameter chunk), so a LayerNorm gain never shares a
scale with a projection weight. Arriving rows are dequantized straight into the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit
from zeropp.plus.wire import first_poisoned, pack, quantize_poisoning, unpack
from zeropp.quant import BlockLayout, dequantize, payload_bytes
from zeropp.topology import Group


class NonFiniteWeightError(FloatingPointError):
    """A weight to be quantized holds inf or nan: quantizing it would spread garbage over its block.

    Raised on every rank of the gather, not only the one holding the bad shard (Note [non-finite poisoning]
    in ``wire.py``), so no rank is left waiting in a collective.
    """


@dataclass
class _PendingQuantized:
    out: torch.Tensor
    handle: Handle
    layout: BlockLayout
    row: RowLayout
    bits: int
    dtype: torch.dtype

    names: list[str]

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        self.handle.wait()
        q = unpack(self.out, payload_bytes(self.layout, self.bits))
        poisoned = first_poisoned(q.scales, self.layout)
        if poisoned is not None:  # every rank received the same rows, so every rank raises here
            source, segment = poisoned
            raise NonFiniteWeightError(
                f"parameter {self.names[segment]!r} holds inf or nan in rank {source}'s shard; qwZ will not "
                f"quantize it (the weights were corrupted before this gather)"
            )
        return dequantize(q, self.layout, self.bits, self.dtype), self.row


class QuantizedGather:
    """Gather a unit over ``group`` as quantized rows; dequantize on arrival."""

    def __init__(self, comm: Comm, bits: int, block_size: int, group: Group | None = None) -> None:
        self.comm = comm
        self.bits = bits
        self.block_size = block_size
        self.group = group or comm.topo.world
        self._layouts: dict[int, BlockLayout] = {}

    def layout(self, unit: Unit) -> BlockLayout:
        if unit.index not in self._layouts:
            self._layouts[unit.index] = BlockLayout(unit.row.chunks, self.block_size)
        return self._layouts[unit.index]

    def start(self, unit: Unit, phase: Phase) -> _PendingQuantized:
        layout = self.layout(unit)
        wire = pack(quantize_poisoning(unit.shard_row().view(1, -1), layout, self.bits))[0]
        out = torch.empty(self.group.size, wire.numel(), dtype=torch.uint8, device=wire.device)
        handle = self.comm.all_gather(out, wire, self.group, phase, async_op=True)
        return _PendingQuantized(out, handle, layout, unit.row, self.bits, unit.compute_dtype, unit.segment_names())

    def on_release(self, unit: Unit) -> None:
        pass

    def held_tensors(self) -> list[torch.Tensor]:
        return []
