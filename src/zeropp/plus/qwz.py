"""qwZ: the forward all-gather sends each rank's shard as block-quantized int8 (or int4) plus fp32 scales.

Blocks follow parameter boundaries (one segment per parameter chunk), so a LayerNorm gain never shares a
scale with a projection weight. The shard is quantized straight into a reused send row, the group's rows
arrive in a reused ``[group, row]`` buffer and are dequantized into a reused compute-dtype buffer, which
the engine hands back (``recycle``) once it copied the weights out (Note [buffer pool] in
``comm/buffers.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from zeropp.comm.buffers import BufferPools
from zeropp.comm.gather import Arrival, WorldRoute
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit
from zeropp.plus.wire import WireFormat, decode_rows, encode_rows, first_poisoned
from zeropp.quant import BlockLayout
from zeropp.topology import Group


class NonFiniteWeightError(FloatingPointError):
    """A weight to be quantized holds inf or nan: quantizing it would spread garbage over its block.

    Raised on every rank of the gather, not only the one holding the bad shard (Note [non-finite poisoning]
    in ``wire.py``), so no rank is left waiting in a collective.
    """


class PendingQuantized:
    """One unit's quantized gather in flight: holds its send and receive rows until ``finish``, and the
    dequantized rows it returns until ``recycle``.

    ``pools`` has the roles "recv" (``arrival``'s buffer), "out" and "scales" (and "send" when ``send`` is
    given: a send row that came from the pool; None when the strategy sent a row it keeps, e.g. a frozen unit's
    stored int8 row). ``on_arrival`` sees the received ``[G, row_bytes]`` rows in group order once they are
    complete, before they are decoded and recycled (the frozen-weight hpZ copy keeps its slice of them there).
    """

    def __init__(self, pools: BufferPools, fmt: WireFormat, send: Optional[torch.Tensor], arrival: Arrival,
                 unit: Unit, on_arrival: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self.pools, self.fmt = pools, fmt
        self.send: Optional[torch.Tensor] = send
        self.arrival: Optional[Arrival] = arrival
        self.row, self.dtype, self.names = unit.row, unit.compute_dtype, unit.segment_names()
        self.on_arrival = on_arrival
        self.out: Optional[torch.Tensor] = None  # the decoded rows in arrival order (a pool buffer)
        self.ranked = torch.empty(0)  # ``out`` in group order (a view)

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        if self.out is not None:
            return self.ranked, self.row
        pools, fmt, arrival = self.pools, self.fmt, self.arrival
        assert arrival is not None, "finish after a failed finish"
        self.arrival = None
        received = arrival.wait()
        g, nb = received.shape[0], fmt.layout.num_blocks
        if self.on_arrival is not None:
            self.on_arrival(arrival.ranked(received).reshape(g, -1))
        numel = fmt.layout.numel
        out = pools["out"].take(g * numel, self.dtype, received.device).view(g, numel)
        scales = pools["scales"].take(g * nb, torch.float32, received.device).view(g, nb)
        try:
            decode_rows(fmt, received, self.dtype, out, scales)
            poisoned = first_poisoned(scales, fmt.layout)
            if poisoned is not None:  # name the first bad block in rank order (rare: the copy is affordable)
                poisoned = first_poisoned(arrival.ranked(scales).reshape(g, nb), fmt.layout)
        finally:
            for role, t in (("scales", scales), ("send", self.send), ("recv", received)):
                if t is not None:
                    pools[role].give(t)
            self.send = None
        if poisoned is not None:  # every rank received the same rows, so every rank raises here
            pools["out"].give(out)
            source, segment = poisoned
            raise NonFiniteWeightError(
                f"parameter {self.names[segment]!r} holds inf or nan in rank {source}'s shard; qwZ will not "
                f"quantize it (the weights were corrupted before this gather)"
            )
        self.out, self.ranked = out, arrival.ranked(out)
        return self.ranked, self.row

    def advance(self) -> None:
        if self.arrival is not None:
            self.arrival.advance()

    def recycle(self) -> None:
        if self.out is not None:
            self.pools["out"].give(self.out)
            self.out = None


class QuantizedGather:
    """Gather a unit over ``group`` (default: the world, by its route: Note [two-hop gather] in
    ``comm/gather.py``) as quantized rows; dequantize on arrival."""

    def __init__(self, comm: Comm, bits: int, block_size: int, group: Group | None = None) -> None:
        self.comm = comm
        self.bits = bits
        self.block_size = block_size
        self.route = WorldRoute(comm, group)
        self._formats: dict[int, WireFormat] = {}
        self.pools = BufferPools("qwz", "send", "recv", "hop1", "out", "scales")

    def layout(self, unit: Unit) -> BlockLayout:
        return self.wire_format(unit).layout

    def wire_format(self, unit: Unit) -> WireFormat:
        if unit.index not in self._formats:
            self._formats[unit.index] = WireFormat(BlockLayout(unit.row.chunks, self.block_size), self.bits)
        return self._formats[unit.index]

    def start(self, unit: Unit, phase: Phase) -> PendingQuantized:
        fmt = self.wire_format(unit)
        shard = unit.shard_row()
        rb, dev = fmt.row_bytes, shard.device
        send = self.pools["send"].take(rb, torch.uint8, dev).view(1, rb)
        nb = fmt.layout.num_blocks
        scales = self.pools["scales"].take(nb, torch.float32, dev).view(1, nb)
        try:
            encode_rows(fmt, [shard], send, scales)
        finally:
            self.pools["scales"].give(scales)
        arrival = self.route.start(send[0], self.pools["recv"], self.pools["hop1"], phase)
        return PendingQuantized(self.pools, fmt, send, arrival, unit)

    def two_hop(self, unit: Unit) -> bool:
        return self.route.two_hop

    def on_release(self, unit: Unit) -> None:
        pass

    def held_tensors(self) -> list[torch.Tensor]:
        return []

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()
