"""hpZ: a secondary copy of the weights, partitioned only inside a group of ``s`` ranks (normally a node).

When a unit's full weights are released, each rank keeps its 1/s slice of them (the secondary shard). Until
the weights change, later gathers of that unit (backward, recomputation, further micro-steps) gather the
slices over the hpZ group only, so they never cross the slow inter-node link.

Note [secondary staleness]: a slice records the unit's ``version`` it was cut from; the engine bumps the
version on every weight change (optimizer step, state-dict or checkpoint load). A slice whose version
differs is never read: the gather falls back to the primary strategy and a fresh slice is cut on release.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeropp.comm.gather import GatheredRows
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm
from zeropp.comm.strategy import GatherStrategy, PendingGather
from zeropp.partition.unit import Unit


@dataclass
class SecondaryStore:
    """This rank's secondary slices, one row per unit, allocated once and reused (2M/s bytes in all)."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)

    def is_current(self, unit: Unit) -> bool:
        return self.versions.get(unit.index) == unit.version

    def keep(self, unit: Unit, index: int, group_size: int) -> None:
        row = unit.full_chunk_row(index, group_size)
        held = self.rows.get(unit.index)
        if held is None:
            self.rows[unit.index] = row
        else:
            held.copy_(row)
        self.versions[unit.index] = unit.version


class HpzGather:
    """Gather from current secondary slices over the hpZ group; otherwise through ``primary``."""

    def __init__(self, comm: Comm, primary: GatherStrategy, store: SecondaryStore) -> None:
        self.comm = comm
        self.primary = primary
        self.store = store
        self.group = comm.topo.hpz

    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        if not self.store.is_current(unit):
            return self.primary.start(unit, phase)
        row = self.store.rows[unit.index]
        out = torch.empty(self.group.size, row.numel(), dtype=row.dtype, device=row.device)
        handle = self.comm.all_gather(out, row, self.group, phase, async_op=True)
        return GatheredRows(out, unit.group_layout(self.group.size), [handle])

    def on_release(self, unit: Unit) -> None:
        if not self.store.is_current(unit):
            self.store.keep(unit, self.group.index_of(self.comm.topo.rank), self.group.size)
        self.primary.on_release(unit)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.store.rows.values()) + self.primary.held_tensors()
