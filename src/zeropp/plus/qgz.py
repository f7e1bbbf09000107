"""qgZ: gradient reduction as a two-hop quantized all-to-all (ZeRO++ paper, section 3.3).

With ``n`` nodes of ``D`` ranks (rank ``p = node * D + local``), for a ``[W, L]`` bucket whose row ``p`` is
destined for rank ``p``:
1. reorder rows to ``[D, n, L]`` (row ``(j, k)`` is for rank ``k * D + j``) and quantize;
2. intra-node all-to-all: piece ``j`` (the ``n`` rows for local index ``j``) goes to local rank ``j``;
3. dequantize the ``D`` received pieces, sum them in fp32 (one partial sum per node), requantize;
4. inter-node all-to-all among ranks with this local index: row ``k`` goes to node ``k``;
5. dequantize, sum the ``n`` partials, divide by ``W``: the mean, in reduce-scatter's row order.

Steps 3 and 5 are one fused kernel pass each (``zeropp.quant.dequantize_sum_quantize`` and
``dequantize_sum``: pieces added left to right in fp32, the same bits on CPU and GPU), reading the
arrived rows in place.

Each hop is skipped when its group has one member (one node: intra-node hop only; one rank per node:
inter-node hop only), so no value is quantized more often than needed. Dividing by ``W`` once at the end
gives the mean; the public implementation divided by the node count only, leaving ``D`` times the mean.

The reorder costs no copy: each bucket row is quantized straight into its slot of the send buffer. Wire
rows, scale scratch and the result come from pools (Note [buffer pool] in
``comm/buffers.py``).

Note [overlapped second hop]: step 3 and 4 run as soon as hop 1 has arrived, found by ``progress()``, which
the gradient buckets call as backward hands them gradients; ``finish`` only waits for hop 2 then. The
public implementation ran the hops back to back. Only on gloo (CPU tensors): NCCL requires the same order
of collectives across concurrent communicators on every rank, so on CUDA hop 2 starts in ``finish``. On
gloo, starting hop 2 at a moment that differs between ranks is safe because its communicator
(``Topology.inter_node_early``) carries nothing but hop 2, issued in bucket order on every rank (a
bucket is finished, so its hop 2 issued, before the next one can progress); values do not depend on when.

With LoCo (``plus/loco.py``, Note [LoCo error feedback]) the first quantization (step 1, or step 4 with one
rank per node) and the requantization of step 3 each add their kept error before quantizing and keep the new
one; step 3 then runs as a sum, an add and a quantization instead of the fused pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from zeropp.comm.buffers import BufferPools
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.plus.loco import BucketKeys, Loco, Stage, keys_of
from zeropp.plus.wire import WireFormat, decode_rows, encode_rows
from zeropp.quant import BlockLayout, QuantizedRows, dequantize_sum, dequantize_sum_quantize
from zeropp.topology import Group


@dataclass
class _Hop:
    """One quantized all-to-all over a group; ``received`` is valid after ``handle.wait()``."""

    send: torch.Tensor
    received: torch.Tensor
    handle: Handle


class QuantizedReduce:
    """Mean-reduce a ``[W, L]`` gradient bucket with quantized intra- then inter-node all-to-alls."""

    def __init__(self, comm: Comm, bits: int, block_size: int, loco: Optional[Loco] = None) -> None:
        self.comm = comm
        self.bits = bits
        self.block_size = block_size
        self.loco = loco  # error feedback (Note [LoCo error feedback]), or None
        # partial: a world of one's copy; scales: aligned scale scratch; result: the row handed to the buckets
        self.pools = BufferPools("qgz", "send", "recv", "partial", "scales", "result")

    def start(self, bucket: torch.Tensor, segments: Sequence[int], names: Sequence[str] = ()) -> "_PendingQgz":
        topo = self.comm.topo
        d, n = topo.ranks_per_node, topo.num_nodes
        fmt = WireFormat(BlockLayout(tuple(segments), self.block_size), self.bits)
        keys = keys_of(names, segments) if self.loco is not None and topo.world_size > 1 else None
        pending = _PendingQgz(self, fmt, d, n, bucket.device, keys)
        if d > 1:  # send row (j, k) = bucket row k * D + j
            order = [k * d + j for j in range(d) for k in range(n)]
            pending.hop1 = self._send_first(fmt, bucket, order, topo.intra_node, keys)
        elif n > 1:  # one rank per node: quantizing the 16-bit rows equals quantizing their fp32 copies
            pending.hop2 = self._send_first(fmt, bucket, list(range(n)), topo.inter_node, keys)
        else:  # a world of one
            numel = fmt.layout.numel
            pending.partial = self.pools["partial"].take(numel, torch.float32, bucket.device).view(1, numel)
            pending.partial.copy_(bucket)
        return pending

    def _send_first(self, fmt: WireFormat, bucket: torch.Tensor, order: list[int], group: Group,
                    keys: Optional[BucketKeys]) -> _Hop:
        """Quantize this rank's bucket rows in ``order`` and send them; with LoCo, compensated first."""
        if keys is None:
            return self._send(fmt, [bucket[i] for i in order], group)
        assert self.loco is not None
        comp = self.loco.compensate(Stage.FIRST, keys, bucket)
        hop = self._send(fmt, [comp.x[i] for i in order], group)
        sent = torch.empty_like(comp.x)
        sent[order] = self._decoded(fmt, hop.send)  # back to bucket-row order
        self.loco.keep(Stage.FIRST, keys, comp, sent)
        return hop

    def _decoded(self, fmt: WireFormat, wire: torch.Tensor) -> torch.Tensor:
        """What the receivers of ``wire``'s rows will dequantize, in fp32 (LoCo's view of the error)."""
        g = wire.shape[0]
        out = torch.empty(g, fmt.layout.numel, dtype=torch.float32, device=wire.device)
        scales = torch.empty(g, fmt.layout.num_blocks, dtype=torch.float32, device=wire.device)
        decode_rows(fmt, wire, torch.float32, out, scales)
        return out

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

    def _arrived(self, fmt: WireFormat, hop: _Hop) -> tuple[QuantizedRows, torch.Tensor]:
        """Wait for ``hop``; its rows as QuantizedRows reading the data in place (scales copied to a 4-byte
        aligned ``scales`` pool buffer; the caller gives back it and ``hop.received``)."""
        hop.handle.wait()
        self.pools["send"].give(hop.send)
        g, pb, nb = hop.received.shape[0], fmt.payload, fmt.layout.num_blocks
        scales = self.pools["scales"].take(g * nb, torch.float32, hop.received.device).view(g, nb)
        scales.view(torch.uint8).copy_(hop.received[:, pb:])
        return QuantizedRows(hop.received[:, :pb], scales), scales

    def _sum_and_resend(self, fmt: WireFormat, hop1: _Hop, d: int, n: int, keys: Optional[BucketKeys]) -> _Hop:
        """Steps 3-4 in one pass per block: dequantize the D pieces, sum them, requantize into hop 2's send rows."""
        if keys is not None:
            return self._sum_compensate_resend(fmt, hop1, d, n, keys)
        q, scales = self._arrived(fmt, hop1)
        pb, nb, dev = fmt.payload, fmt.layout.num_blocks, hop1.received.device
        send = self.pools["send"].take(n * fmt.row_bytes, torch.uint8, dev).view(n, fmt.row_bytes)
        sums = self.pools["scales"].take(n * nb, torch.float32, dev).view(n, nb)
        try:
            # poisoned pieces (NaN scales) make NaN sums, which travel on poisoned (Note [non-finite poisoning])
            dequantize_sum_quantize(q, fmt.layout, fmt.bits, d, out=QuantizedRows(send[:, :pb], sums), poison=True)
            send[:, pb:].copy_(sums.view(torch.uint8))
        finally:
            for role, t in (("scales", scales), ("scales", sums), ("recv", hop1.received)):
                self.pools[role].give(t)
        return self._send_inter(fmt, send)

    def _sum_compensate_resend(self, fmt: WireFormat, hop1: _Hop, d: int, n: int, keys: BucketKeys) -> _Hop:
        """Steps 3-4 with LoCo: sum the D pieces in fp32, add the kept error, quantize, keep the new error."""
        assert self.loco is not None
        q, scales = self._arrived(fmt, hop1)
        dev = hop1.received.device
        try:
            partial = dequantize_sum(q, fmt.layout, fmt.bits, d)  # [n, L]
        finally:
            self.pools["scales"].give(scales)
            self.pools["recv"].give(hop1.received)
        comp = self.loco.compensate(Stage.SECOND, keys, partial)
        send = self.pools["send"].take(n * fmt.row_bytes, torch.uint8, dev).view(n, fmt.row_bytes)
        sums = self.pools["scales"].take(n * fmt.layout.num_blocks, torch.float32, dev).view(n, -1)
        try:
            encode_rows(fmt, [comp.x[k] for k in range(n)], send, sums)
        finally:
            self.pools["scales"].give(sums)
        self.loco.keep(Stage.SECOND, keys, comp, self._decoded(fmt, send))
        return self._send_inter(fmt, send)

    def _send_inter(self, fmt: WireFormat, send: torch.Tensor) -> _Hop:
        n = send.shape[0]
        received = self.pools["recv"].take(n * fmt.row_bytes, torch.uint8, send.device).view(n, fmt.row_bytes)
        inter = self.comm.topo.inter_node_early  # may be issued early, at a rank-dependent moment
        handle = self.comm.all_to_all(received, send, inter, Phase.GRAD_REDUCE, async_op=inter.size > 1)
        return _Hop(send, received, handle)

    def _mean(self, fmt: WireFormat, hop: _Hop, pieces: int, out: torch.Tensor) -> None:
        """Step 5 in one pass: dequantize the arrived pieces, sum them, divide by the world size, into ``out``."""
        q, scales = self._arrived(fmt, hop)
        try:
            dequantize_sum(q, fmt.layout, fmt.bits, pieces, out=out, divisor=float(self.comm.topo.world_size))
        finally:
            self.pools["scales"].give(scales)
            self.pools["recv"].give(hop.received)

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()

    def buffer_bound(self, elements: int, segments: int, itemsize: int) -> int:
        """Per bucket in flight: a send and a receive slab per hop, each as large as the first hop's ``W`` wire
        rows (a role's slabs share the size of its largest request, Note [buffer pool]); two leases of scale
        scratch; the fp32 result row. A row of ``L`` elements has at most ``L / block + segments`` blocks."""
        topo = self.comm.topo
        row = -(-elements // topo.world_size)
        blocks = -(-row // self.block_size) + segments
        wire = topo.world_size * (-(-row * self.bits // 8) + 4 * blocks)
        hops = 2 if topo.ranks_per_node > 1 and topo.num_nodes > 1 else 1
        return 2 * hops * wire + 2 * topo.world_size * blocks * 4 + 4 * row

    def end_step(self, grad_scale: float = 1.0) -> None:
        if self.loco is not None:
            self.loco.end_step(grad_scale)

    def state_dict(self) -> dict:
        """LoCo's kept errors (empty without LoCo): training state, saved in checkpoints."""
        return {"loco": self.loco.state_dict()} if self.loco is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.loco is not None and "loco" in state:
            self.loco.load_state_dict(state["loco"])


class _PendingQgz:
    """One bucket's reduction: hop 1 in flight, then (``progress`` or ``finish``) hop 2, then the result row,
    which stays this reduction's until ``recycle``."""

    def __init__(self, owner: QuantizedReduce, fmt: WireFormat, d: int, n: int, device: torch.device,
                 keys: Optional[BucketKeys] = None) -> None:
        self.owner, self.fmt, self.d, self.n, self.device, self.keys = owner, fmt, d, n, device, keys
        self.hop1: Optional[_Hop] = None
        self.partial: Optional[torch.Tensor] = None  # [n, L] fp32: this node's sums for each node's rank
        self.hop2: Optional[_Hop] = None
        self.result: Optional[torch.Tensor] = None

    def progress(self) -> None:
        # gloo only (CPU): NCCL wants every rank to issue collectives on concurrent communicators in the
        # same order, and an early hop 2 would come before or after the next bucket's hop 1 depending on
        # each rank's timing; on CUDA hop 2 starts in finish, in the same place on every rank.
        if self.device.type == "cpu" and self.hop1 is not None and self.hop1.handle.is_done():
            self._second_hop()

    def _second_hop(self) -> None:
        """Steps 3-4 once hop 1 is in: the D pieces per node summed and requantized, hop 2 started (Note
        [overlapped second hop]); on one node the sum is already the result."""
        assert self.hop1 is not None
        hop1, self.hop1 = self.hop1, None  # [D * n] rows arrived: D senders, n rows each
        if self.n > 1:
            self.hop2 = self.owner._sum_and_resend(self.fmt, hop1, self.d, self.n, self.keys)
        else:
            self.result = self.owner.pools["result"].take(self.fmt.layout.numel, torch.float32, self.device)
            self.owner._mean(self.fmt, hop1, self.d, self.result)

    def finish(self) -> torch.Tensor:
        if self.hop1 is not None:
            self._second_hop()
        if self.result is not None:
            return self.result
        result = self.owner.pools["result"].take(self.fmt.layout.numel, torch.float32, self.device)
        if self.hop2 is not None:
            hop2, self.hop2 = self.hop2, None
            self.owner._mean(self.fmt, hop2, self.n, result)
        else:  # a world of one
            assert self.partial is not None
            result.copy_(self.partial[0])
            self.owner.pools["partial"].give(self.partial)
            self.partial = None
        self.result = result
        return result

    def recycle(self) -> None:
        if self.result is not None:
            self.owner.pools["result"].give(self.result)
            self.result = None
