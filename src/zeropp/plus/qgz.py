"""qgZ: gradient reduction as a two-hop quantized all-to-all (ZeRO++ paper, section 3.3).

With ``n`` nodes of ``D`` ranks (rank ``p = node * D + local``), for a ``[W, L]`` bucket whose row ``p`` is
destined for rank ``p``:
1. reorder rows to ``[D, n, L]`` (row ``(j, k)`` is for rank ``k * D + j``) and quantize;
2. intra-node all-to-all: piece ``j`` (the ``n`` rows for local index ``j``) goes to local rank ``j``;
3. dequantize the ``D`` received pieces, sum them in fp32 (one partial sum per node), requantize;
4. inter-node all-to-all among ranks with this local index: row ``k`` goes to node ``k``;
5. dequantize, sum the ``n`` partials, divide by ``W``: the mean, in reduce-scatter's row order.

Each hop is skipped when its group has one member (one node: intra-node hop only; one rank per node:
inter-node hop only), so no value is quantized more often than needed. Dividing by ``W`` once at the end
gives the mean; the public implementation divided by the node count only, leaving ``D`` times the mean.

The reorder costs no copy: each bucket row is quantized straight into its slot of the send buffer. Wire
rows, dequantized rows, partial sums and the result come from pools (Note [buffer pool] in
``comm/buffers.py``).

Note [overlapped second hop]: step 3 and 4 run as soon as hop 1 has arrived, found by ``progress()``, which
the gradient buckets call as backward hands them gradients; ``finish`` only waits for hop 2 then. The
public implementation ran the hops back to back. Starting hop 2 at a moment that differs between ranks is
safe because the inter-node group carries nothing but hop 2, issued in bucket order on every rank (a
bucket is finished, so its hop 2 issued, before the next one can progress); values do not depend on when.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from zeropp.comm.buffers import BufferPools
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.plus.wire import WireFormat, decode_rows, encode_rows
from zeropp.quant import BlockLayout
from zeropp.topology import Group


@dataclass
class _Hop:
    """One quantized all-to-all over a group; ``received`` is valid after ``handle.wait()``."""

    send: torch.Tensor
    received: torch.Tensor
    handle: Handle


class QuantizedReduce:
    """Mean-reduce a ``[W, L]`` gradient bucket with quantized intra- then inter-node all-to-alls."""

    def __init__(self, comm: Comm, bits: int, block_size: int) -> None:
        self.comm = comm
        self.bits = bits
        self.block_size = block_size
        # deq: dequantized rows of a hop; partial: a node's sums; result: the row handed to the buckets
        self.pools = BufferPools("qgz", "send", "recv", "deq", "partial", "scales", "result")

    def start(self, bucket: torch.Tensor, segments: Sequence[int]) -> "_PendingQgz":
        topo = self.comm.topo
        d, n = topo.ranks_per_node, topo.num_nodes
        fmt = WireFormat(BlockLayout(tuple(segments), self.block_size), self.bits)
        pending = _PendingQgz(self, fmt, d, n, bucket.device)
        if d > 1:  # send row (j, k) = bucket row k * D + j
            pending.hop1 = self._send(fmt, [bucket[k * d + j] for j in range(d) for k in range(n)], topo.intra_node)
        elif n > 1:  # one rank per node: quantizing the 16-bit rows equals quantizing their fp32 copies
            pending.hop2 = self._send(fmt, [bucket[k] for k in range(n)], topo.inter_node)
        else:  # a world of one
            numel = fmt.layout.numel
            pending.partial = self.pools["partial"].take(numel, torch.float32, bucket.device).view(1, numel)
            pending.partial.copy_(bucket)
        return pending

    def _send(self, fmt: WireFormat, rows: list[torch.Tensor], group: Group) -> _Hop:
        # inf/nan gradients travel as NaN-scaled blocks (Note [non-finite poisoning] in wire.py): they land
        # in the owning rank's shard of that parameter, where the engine skips the step and names it.
        g, rb, nb, dev = len(rows), fmt.row_bytes, fmt.layout.num_blocks, rows[0].device
        send = self.pools["send"].take(g * rb, torch.uint8, dev).view(g, rb)
        scales = self.pools["scales"].take(g * nb, torch.float32, dev).view(g, nb)
        try:
            encode_rows(fmt, rows, send, scales)
        finally:
            self.pools["scales"].give(scales)
        received = self.pools["recv"].take(g * rb, torch.uint8, dev).view(g, rb)
        handle = self.comm.all_to_all(received, send, group, Phase.GRAD_REDUCE, async_op=group.size > 1)
        return _Hop(send, received, handle)

    def _receive(self, fmt: WireFormat, hop: _Hop) -> torch.Tensor:
        """Wait for ``hop``; its rows dequantized to fp32 in a ``deq`` pool buffer (the caller gives it back)."""
        hop.handle.wait()
        g, numel, nb, dev = hop.received.shape[0], fmt.layout.numel, fmt.layout.num_blocks, hop.received.device
        out = self.pools["deq"].take(g * numel, torch.float32, dev).view(g, numel)
        scales = self.pools["scales"].take(g * nb, torch.float32, dev).view(g, nb)
        try:
            decode_rows(fmt, hop.received, torch.float32, out, scales)
        finally:
            for role, t in (("scales", scales), ("send", hop.send), ("recv", hop.received)):
                self.pools[role].give(t)
        return out

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()


def sum_pieces(pieces: torch.Tensor, out: torch.Tensor) -> None:
    """``out = pieces.sum(dim=0)`` for ``[P, R, L]`` fp32 dequantized pieces, with the same bits.

    torch sums up to 4 pieces over the leading dim left to right from a zero identity; ``add`` then
    ``add_`` does the same about twice as fast (one pass fewer over fp32 rows). The identity only matters
    for -0.0, which a dequantized value never is (``code * scale`` with ``scale >= 0`` or NaN).
    More pieces go to ``torch.sum`` itself, which then uses several accumulators.
    """
    p = pieces.shape[0]
    if p > 4 or p < 2:
        torch.sum(pieces, dim=0, out=out)
        return
    torch.add(pieces[0], pieces[1], out=out)
    for i in range(2, p):
        out.add_(pieces[i])


class _PendingQgz:
    """One bucket's reduction: hop 1 in flight, then (``progress`` or ``finish``) hop 2, then the result row,
    which stays this reduction's until ``recycle``."""

    def __init__(self, owner: QuantizedReduce, fmt: WireFormat, d: int, n: int, device: torch.device) -> None:
        self.owner, self.fmt, self.d, self.n, self.device = owner, fmt, d, n, device
        self.hop1: Optional[_Hop] = None
        self.partial: Optional[torch.Tensor] = None  # [n, L] fp32: this node's sums for each node's rank
        self.hop2: Optional[_Hop] = None
        self.result: Optional[torch.Tensor] = None

    def progress(self) -> None:
        if self.hop1 is not None and self.hop1.handle.is_done():
            self._second_hop()

    def _second_hop(self) -> None:
        """Steps 3-4 once hop 1 is in: sum the D pieces per node, requantize, start hop 2 (Note [overlapped
        second hop])."""
        assert self.hop1 is not None
        pools, numel = self.owner.pools, self.fmt.layout.numel
        received = self.owner._receive(self.fmt, self.hop1)  # [D * n, L]: D senders, n rows each
        self.hop1 = None
        partial = pools["partial"].take(self.n * numel, torch.float32, self.device).view(self.n, numel)
        sum_pieces(received.view(self.d, self.n, numel), partial)
        pools["deq"].give(received)
        if self.n > 1:
            inter = self.owner.comm.topo.inter_node
            self.hop2 = self.owner._send(self.fmt, [partial[k] for k in range(self.n)], inter)
            pools["partial"].give(partial)
        else:
            self.partial = partial

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        pools, numel = self.owner.pools, self.fmt.layout.numel
        if self.hop1 is not None:
            self._second_hop()
        result = pools["result"].take(numel, torch.float32, self.device)
        if self.hop2 is not None:
            received = self.owner._receive(self.fmt, self.hop2)
            self.hop2 = None
            sum_pieces(received.view(self.n, 1, numel), result.view(1, numel))
            pools["deq"].give(received)
        else:
            assert self.partial is not None
            result.copy_(self.partial[0])
            pools["partial"].give(self.partial)
            self.partial = None
        self.result = result.div_(self.owner.comm.topo.world_size)
        return self.result

    def recycle(self) -> None:
        if self.result is not None:
            self.owner.pools["result"].give(self.result)
            self.result = None
