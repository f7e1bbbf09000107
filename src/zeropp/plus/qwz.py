"""qwZ: the forward all-gather sends each rank's shard as block-quantized int8 (or int4) plus fp32 scales.

Blocks follow parameter boundaries (one segment per parameter chunk), so a LayerNorm gain never shares a
scale with a projection weight. The shard is quantized straight into a reused send row, the group's rows
arrive in a reused ``[group, row]`` buffer and are dequantized into a reused compute-dtype buffer, which
the engine hands back (``recycle``) once it copied the weights out (Note [buffer pool] in
``comm/buffers.py``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

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


class WeightChecks:
    """Whether the rows a qwZ gather decoded hold a poisoned block (a shard with inf/nan).

    Note [deferred weight checks]: telling whether any decoded scale is NaN takes the answer to the host. On
    the CPU that costs nothing, and the gather raises at once. On CUDA it would wait for the device once per
    unit and stall the stream of gathers, so there each gather only records, on the device, the first bad
    block of its rows, and the engine calls :meth:`raise_first` once at the end of each forward and backward: one
    wait per pass, and the same error (parameter and source rank) on every rank, one pass later at most than on
    the CPU. Poisoned weights decode to NaN rows in the meantime, which that pass computes through; nothing is
    stepped before the error. ``defer`` None: defer on CUDA only.
    """

    def __init__(self, defer: Optional[bool] = None) -> None:
        self.defer = defer
        self._pending: list[tuple[torch.Tensor, BlockLayout, Sequence[str]]] = []

    def scan(self, scales: torch.Tensor, ranked: Callable[[], torch.Tensor], layout: BlockLayout,
             names: Sequence[str]) -> Optional[NonFiniteWeightError]:
        """The error for the first poisoned block of ``scales`` (``ranked()``: them in group order), or None;
        with deferred checks, record it for :meth:`raise_first` and return None."""
        defer = self.defer if self.defer is not None else scales.device.type == "cuda"
        if defer:
            bad = ~torch.isfinite(ranked().reshape(-1))
            first = torch.where(bad.any(), bad.int().argmax(), -1)  # argmax: the first of the maxima (int64)
            self._pending.append((first, layout, names))
            return None
        if first_poisoned(scales, layout) is None:
            return None
        source, segment = first_poisoned(ranked(), layout)  # the first bad block in rank order (rare)
        return _weight_error(names, source, segment)

    def raise_first(self) -> None:
        """Raise for the first poisoned block the deferred checks recorded since the last call."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        firsts = torch.stack([first for first, _, _ in pending]).tolist()  # the pass's one host sync
        for flat, (_, layout, names) in zip(firsts, pending):
            if flat >= 0:
                source, block = divmod(flat, layout.num_blocks)
                raise _weight_error(names, source, int(layout.block_segment()[block]))


def _weight_error(names: Sequence[str], source: int, segment: int) -> NonFiniteWeightError:
    return NonFiniteWeightError(
        f"parameter {names[segment]!r} holds inf or nan in rank {source}'s shard; qwZ will not "
        f"quantize it (the weights were corrupted before this gather)")


class PendingQuantized:
    """One unit's quantized gather in flight: holds its send and receive rows until ``finish``, and the
    dequantized rows it returns until ``recycle``.

    ``pools`` has the roles "recv" (``arrival``'s buffer), "out" and "scales" (and "send" when ``send`` is
    given: a send row that came from the pool; None when the strategy sent a row it keeps, e.g. a frozen unit's
    stored int8 row). ``on_arrival`` sees the received ``[G, row_bytes]`` rows in group order once they are
    complete, before they are decoded and recycled (the frozen-weight hpZ copy keeps its slice of them there).
    """

    def __init__(self, pools: BufferPools, fmt: WireFormat, send: Optional[torch.Tensor], arrival: Arrival,
                 unit: Unit, checks: WeightChecks, on_arrival: Optional[Callable[[torch.Tensor], None]] = None
                 ) -> None:
        self.pools, self.fmt, self.checks = pools, fmt, checks
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
            error = self.checks.scan(scales, lambda: arrival.ranked(scales).reshape(g, nb), fmt.layout,
                                     self.names)
        finally:
            for role, t in (("scales", scales), ("send", self.send), ("recv", received)):
                if t is not None:
                    pools[role].give(t)
            self.send = None
        if error is not None:  # every rank received the same rows, so every rank raises here
            pools["out"].give(out)
            raise error
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

    keeps_copies = False

    def __init__(self, comm: Comm, bits: int, block_size: int, group: Group | None = None,
                 defer_checks: Optional[bool] = None) -> None:
        self.comm = comm
        self.checks = WeightChecks(defer_checks)  # Note [deferred weight checks]
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
        return PendingQuantized(self.pools, fmt, send, arrival, unit, self.checks)

    def two_hop(self, unit: Unit) -> bool:
        return self.route.two_hop

    def on_release(self, unit: Unit) -> None:
        pass

    def check_deferred(self) -> None:
        self.checks.raise_first()

    def held_tensors(self) -> list[torch.Tensor]:
        return []

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()
