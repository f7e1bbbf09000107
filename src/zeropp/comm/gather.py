"""Plain all-gather of a unit's 16-bit shard rows over the world (ZeRO-3's forward and backward gather)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit
from zeropp.topology import Group


@dataclass
class GatheredRows:
    """A gather in flight: ``out`` is valid once every handle has been waited on."""

    out: torch.Tensor
    layout: RowLayout
    handles: list[Handle] = field(default_factory=list)

    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        for h in self.handles:
            h.wait()
        return self.out, self.layout


class AllGather:
    """Gather every rank's row of the unit over ``group`` (the world for ZeRO-3), in the compute dtype."""

    def __init__(self, comm: Comm, group: Group | None = None) -> None:
        self.comm = comm
        self.group = group or comm.topo.world

    def start(self, unit: Unit, phase: Phase) -> GatheredRows:
        row = unit.shard_row()
        out = torch.empty(self.group.size, unit.row.numel, dtype=row.dtype, device=row.device)
        handle = self.comm.all_gather(out, row, self.group, phase, async_op=True)
        return GatheredRows(out, unit.row, [handle])

    def on_release(self, unit: Unit) -> None:
        pass

    def held_tensors(self) -> list[torch.Tensor]:
        return []
