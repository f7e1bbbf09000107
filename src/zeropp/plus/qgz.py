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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.plus.wire import pack, quantize_poisoning, unpack
from zeropp.quant import BlockLayout, dequantize, payload_bytes
from zeropp.topology import Group


@dataclass
class _Hop:
    """One quantized all-to-all over ``group``; ``received`` is valid after ``handle.wait()``."""

    received: torch.Tensor
    handle: Handle


class QuantizedReduce:
    """Mean-reduce a ``[W, L]`` gradient bucket with quantized intra- then inter-node all-to-alls."""

    def __init__(self, comm: Comm, bits: int, block_size: int) -> None:
        self.comm = comm
        self.bits = bits
        self.block_size = block_size

    def start(self, bucket: torch.Tensor, segments: Sequence[int]) -> "_PendingQgz":
        topo = self.comm.topo
        d, n = topo.ranks_per_node, topo.num_nodes
        layout = BlockLayout(tuple(segments), self.block_size)
        rows = bucket.view(n, d, -1).transpose(0, 1).reshape(d * n, -1)  # row (j, k) -> rank k*D + j
        pending = _PendingQgz(self, layout, d, n)
        if d > 1:
            pending.hop1 = self._send(rows, layout, topo.intra_node)
        else:
            pending.partial = rows.float()
        return pending

    def _send(self, rows: torch.Tensor, layout: BlockLayout, group: Group) -> _Hop:
        # inf/nan gradients travel as NaN-scaled blocks (Note [non-finite poisoning] in wire.py): they land
        # in the owning rank's shard of that parameter, where the engine skips the step and names it.
        wire = pack(quantize_poisoning(rows, layout, self.bits))
        received = torch.empty_like(wire)
        handle = self.comm.all_to_all(received, wire, group, Phase.GRAD_REDUCE, async_op=group.size > 1)
        return _Hop(received, handle)

    def _receive(self, hop: _Hop, layout: BlockLayout) -> torch.Tensor:
        hop.handle.wait()
        q = unpack(hop.received, payload_bytes(layout, self.bits))
        return dequantize(q, layout, self.bits, torch.float32)


class _PendingQgz:
    def __init__(self, owner: QuantizedReduce, layout: BlockLayout, d: int, n: int) -> None:
        self.owner = owner
        self.layout = layout
        self.d, self.n = d, n
        self.hop1: _Hop | None = None
        self.partial: torch.Tensor | None = None  # [n, L] fp32: this node's sums for each node's rank

    def finish(self) -> torch.Tensor:
        topo = self.owner.comm.topo
        if self.hop1 is not None:
            received = self.owner._receive(self.hop1, self.layout)  # [D * n, L]: D senders, n rows each
            self.partial = received.view(self.d, self.n, -1).sum(dim=0)
        assert self.partial is not None
        if self.n > 1:
            hop2 = self.owner._send(self.partial, self.layout, topo.inter_node)
            total = self.owner._receive(hop2, self.layout).sum(dim=0)
        else:
            total = self.partial[0]
        return total.div_(topo.world_size)
