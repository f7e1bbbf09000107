"""Plain all-gather of a unit's 16-bit shard rows over the world (ZeRO-3's forward and backward gather)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from zeropp.comm.buffers import BufferPool, BufferPools
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit
from zeropp.topology import Group


@dataclass
class GatheredRows:
    """A gather in flight: ``out`` is valid once every handle has been waited on, until ``recycle``.

    ``pool``: where ``out`` came from (given back by ``recycle``); None for a tensor nobody reuses.
    """

    out: torch.Tensor
    layout: RowLayout
    handles: list[Handle] = field(default_factory=list)
    pool: Optional[BufferPool] = None

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        for h in self.handles:
            h.wait()
        return self.out, self.layout

    def recycle(self) -> None:
        if self.pool is not None:
            for h in self.handles:  # the collective must be done writing before the buffer is reused
                h.wait()
            self.pool.give(self.out)
            self.pool = None
            self.handles = []
            self.out = torch.empty(0, dtype=self.out.dtype)  # a finish() after recycle() sees no rows


def gather_into_pool(comm: Comm, pool: BufferPool, row: torch.Tensor, layout: RowLayout, group: Group,
                     phase: Phase) -> GatheredRows:
    """Start an all-gather of ``row`` over ``group`` into a ``[group.size, row.numel()]`` buffer of ``pool``."""
    out = pool.take(group.size * row.numel(), row.dtype, row.device).view(group.size, row.numel())
    handle = comm.all_gather(out, row, group, phase, async_op=True)
    return GatheredRows(out, layout, [handle], pool)


class AllGather:
    """Gather every rank's row of the unit over ``group`` (the world for ZeRO-3), in the compute dtype."""

    def __init__(self, comm: Comm, group: Group | None = None) -> None:
        self.comm = comm
        self.group = group or comm.topo.world
        self.pools = BufferPools("gather", "out")

    def start(self, unit: Unit, phase: Phase) -> GatheredRows:
        return gather_into_pool(self.comm, self.pools["out"], unit.shard_row(), unit.row, self.group, phase)

    def on_release(self, unit: Unit) -> None:
        pass

    def held_tensors(self) -> list[torch.Tensor]:
        return []

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()
