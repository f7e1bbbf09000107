"""All-gathers of one row from every rank: the route they take (one collective, or two hops across nodes) and
the plain all-gather of a unit's 16-bit shard rows (ZeRO-3's forward and backward gather).

Note [two-hop gather]: on ``n > 1`` nodes of ``D > 1`` ranks, a gather over the world runs in two hops: an
all-gather over the inter-node group (the ``n`` ranks that share this rank's local index) of the rank's row,
then an all-gather over the intra-node group of the ``n`` rows each rank now holds. A row crosses the link
into a node once, for the one rank there that shares its local index, instead of once for every rank of the
node: per rank, ``n - 1`` rows arrive from other nodes instead of ``W - D``. On the wire a ring over the world
carries ``(W - 1) / W`` of the gathered bytes into every node (a node's own rows go round the other nodes and
come back: 3/4 on 2 x 2), the two hops ``(n - 1) / n`` (1/2 on 2 x 2); gloo's all-gather is such a ring.
The rows arrive ordered by local index, then node (``[D, n]``); :meth:`Arrival.ranked` views them in rank
order (``[n, D]``, a transpose, no copy). On the host the second hop can only be issued once the first has
arrived, and it must be issued at the same point of the program on every rank (the intra-node group carries
other collectives too): the engine starts a two-hop gather's first hop two units ahead and calls
``advance()`` one unit ahead, which waits for the first hop and issues the second, so both overlap compute
(``ZeroEngine._prefetch``); a gather not advanced issues its second hop in ``finish``. On CUDA both hops are
issued at once (waiting on a NCCL collective only orders the stream). The first hop runs on the inter-node
group, which carries nothing issued at a rank-dependent moment (qgZ's early second hop has a communicator
of its own, ``Topology.inter_node_early``). Values do not change: an all-gather only moves bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from zeropp.comm.buffers import BufferPool, BufferPools
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit
from zeropp.topology import Group


@dataclass
class _SecondHop:
    """What a two-hop gather still has to send once its first hop has arrived."""

    comm: Comm
    part: torch.Tensor  # [n, R]: the rows of this rank's local index from every node
    mid: BufferPool  # where ``part`` goes back
    recv: BufferPool  # where the [W, R] buffer of the second hop comes from
    group: Group  # intra-node
    phase: Phase


class Arrival:
    """The rows of one all-gather in flight, one per member of the gathered group.

    ``wait()`` returns the ``[G, R]`` buffer with the rows in arrival order; ``ranked(t)`` views any tensor with
    one row per arrived row (the buffer, or rows decoded from it) in group order. The buffer belongs to the
    caller, who gives it back to the pool it was taken from. A two-hop gather's second hop is issued by
    ``advance()``, or else by ``wait()``.
    """

    def __init__(self, out: Optional[torch.Tensor], handles: list[Handle], second: Optional[_SecondHop] = None,
                 local: int = 0, nodes: int = 1) -> None:
        self.out, self.handles, self.second = out, handles, second
        self.local, self.nodes = local, nodes  # D and n of a two-hop gather; local 0: rows in group order
        self._part: Optional[tuple[BufferPool, torch.Tensor]] = None  # the first hop's rows, until hop 2 is done

    def advance(self) -> None:
        """Wait for the first hop of a two-hop gather and issue the second without waiting for it (Note
        [two-hop gather]); nothing once it is issued, or for a one-hop gather."""
        if self.second is None:
            return
        for h in self.handles:
            h.wait()
        s, self.second = self.second, None
        numel = s.part.shape[1]
        self.out = s.recv.take(self.local * self.nodes * numel, s.part.dtype, s.part.device).view(-1, numel)
        self._part = (s.mid, s.part)
        self.handles = [s.comm.all_gather(self.out, s.part, s.group, s.phase, async_op=True)]

    def wait(self) -> torch.Tensor:
        self.advance()
        for h in self.handles:
            h.wait()
        self.handles = []
        if self._part is not None:
            pool, part = self._part
            self._part = None
            pool.give(part)
        assert self.out is not None
        return self.out

    def ranked(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (rows in arrival order) with rows in group order: ``t`` itself, or a ``[n, D, ...]`` view."""
        if not self.local:
            return t
        return t.view(self.local, self.nodes, *t.shape[1:]).transpose(0, 1)


class WorldRoute:
    """How a row from every member of ``group`` (default: the world) is gathered: one all-gather, or two hops
    when the group is the world on several nodes of several ranks (Note [two-hop gather])."""

    def __init__(self, comm: Comm, group: Optional[Group] = None) -> None:
        topo = comm.topo
        self.comm = comm
        self.group = group or topo.world
        self.two_hop = self.group.ranks == topo.world.ranks and topo.num_nodes > 1 and topo.ranks_per_node > 1

    @property
    def size(self) -> int:
        return self.group.size

    def start(self, row: torch.Tensor, recv: BufferPool, mid: BufferPool, phase: Phase) -> Arrival:
        """Issue the gather of ``row`` (1-D) into a ``[G, row.numel()]`` buffer of ``recv``; ``mid`` lends the
        first hop's rows of a two-hop gather. On CUDA both hops are issued now (a wait on a NCCL collective
        only orders the stream, the host goes on); on the host the second waits for ``advance`` or ``wait``."""
        numel, dtype, dev = row.numel(), row.dtype, row.device
        if not self.two_hop:
            out = recv.take(self.size * numel, dtype, dev).view(self.size, numel)
            return Arrival(out, [self.comm.all_gather(out, row, self.group, phase, async_op=True)])
        topo = self.comm.topo
        part = mid.take(topo.num_nodes * numel, dtype, dev).view(topo.num_nodes, numel)
        handle = self.comm.all_gather(part, row, topo.inter_node, phase, async_op=True)
        arrival = Arrival(None, [handle], _SecondHop(self.comm, part, mid, recv, topo.intra_node, phase),
                          topo.ranks_per_node, topo.num_nodes)
        if dev.type == "cuda":
            arrival.advance()
        return arrival


@dataclass
class GatheredRows:
    """A gather in flight: the rows are valid once it arrived (``finish``), until ``recycle``.

    ``pool``: where the rows' buffer came from (given back by ``recycle``); None for a buffer nobody reuses.
    """

    arrival: Arrival
    layout: RowLayout
    pool: Optional[BufferPool] = None

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        return self.arrival.ranked(self.arrival.wait()), self.layout

    def advance(self) -> None:
        self.arrival.advance()

    def recycle(self) -> None:
        if self.pool is not None:
            out = self.arrival.wait()  # the collectives must be done writing before the buffer is reused
            self.pool.give(out)
            self.pool = None
            self.arrival = Arrival(torch.empty(0, dtype=out.dtype), [])  # a finish() after recycle() sees no rows


def gather_into_pool(comm: Comm, pool: BufferPool, row: torch.Tensor, layout: RowLayout, group: Group,
                     phase: Phase) -> GatheredRows:
    """Start an all-gather of ``row`` over ``group`` (one collective) into a ``[group.size, row.numel()]``
    buffer of ``pool``."""
    out = pool.take(group.size * row.numel(), row.dtype, row.device).view(group.size, row.numel())
    handle = comm.all_gather(out, row, group, phase, async_op=True)
    return GatheredRows(Arrival(out, [handle]), layout, pool)


class _Batch:
    """One all-gather of several units' rows laid end to end (Note [gather groups]): its buffers go back to
    their pools once every member has been recycled."""

    def __init__(self, arrival: Arrival, out: BufferPool, send: BufferPool, row: torch.Tensor, members: int) -> None:
        self.arrival, self.out, self.send, self.row, self.left = arrival, out, send, row, members
        self.rows: Optional[torch.Tensor] = None

    def finish(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = self.arrival.ranked(self.arrival.wait())
            self.send.give(self.row)  # the collective has read it
        return self.rows

    def recycle(self) -> None:
        self.left -= 1
        if not self.left:
            self.finish()
            self.out.give(self.arrival.wait())


@dataclass
class BatchMember:
    """One unit's part of a coalesced gather: its columns ``[at, at + numel)`` of every gathered row."""

    batch: _Batch
    at: int
    numel: int
    layout: RowLayout
    done: bool = False

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        return self.batch.finish()[..., self.at : self.at + self.numel], self.layout

    def advance(self) -> None:
        pass

    def recycle(self) -> None:
        if not self.done:
            self.done = True
            self.batch.recycle()


class AllGather:
    """Gather every rank's row of the unit over ``group`` (the world for ZeRO-3, by the world's route: Note
    [two-hop gather]), in the compute dtype. Over one hop, several units' rows may go in one collective
    (``start_many``: Note [gather groups])."""

    keeps_copies = False

    def __init__(self, comm: Comm, group: Group | None = None) -> None:
        self.comm = comm
        self.route = WorldRoute(comm, group)
        self.pools = BufferPools("gather", "out", "hop1", "send")
        self.coalesces = not self.route.two_hop

    def start(self, unit: Unit, phase: Phase) -> GatheredRows:
        arrival = self.route.start(unit.shard_row(), self.pools["out"], self.pools["hop1"], phase)
        return GatheredRows(arrival, unit.row, self.pools["out"])

    def start_many(self, units: list[Unit], phase: Phase, pad_to: int = 0) -> list[BatchMember]:
        """One all-gather of the rows of ``units`` (same dtype and device) laid end to end, zero-padded to
        ``pad_to`` gathered elements (Note [gather groups]: every collective of small units is that long); a
        pending gather per unit, each finished and recycled on its own."""
        rows = [u.shard_row() for u in units]
        total = sum(r.numel() for r in rows)
        send = self.pools["send"].take(max(total, pad_to // self.route.size), rows[0].dtype, rows[0].device)
        torch.cat(rows, out=send[:total])
        send[total:].zero_()
        batch = _Batch(self.route.start(send, self.pools["out"], self.pools["hop1"], phase), self.pools["out"],
                       self.pools["send"], send, len(units))
        members, at = [], 0
        for unit, row in zip(units, rows):
            members.append(BatchMember(batch, at, row.numel(), unit.row))
            at += row.numel()
        return members

    def two_hop(self, unit: Unit) -> bool:
        return self.route.two_hop

    def on_release(self, unit: Unit) -> None:
        pass

    def check_deferred(self) -> None:
        pass

    def held_tensors(self) -> list[torch.Tensor]:
        return []

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()
