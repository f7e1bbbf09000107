"""hpZ: a secondary copy of the weights, partitioned only inside a group of ``s`` ranks (normally a node).

When a unit's full weights are released, each rank keeps its 1/s slice of them (the secondary shard). Until
the weights change, later gathers of that unit (backward, recomputation, further micro-steps) gather the
slices over the hpZ group only, so they never cross the slow inter-node link. Those gathers land in reused
buffers (Note [buffer pool] in ``comm/buffers.py``); the slices themselves are model state, one row per
unit, allocated once.

Note [hpZ slices at initialize]: ``initialize`` gathers each unit once through the forward strategy (one unit's
full weights at a time, before the ledger is reset: set-up traffic) and releases it, which cuts its slice, as
DeepSpeed cuts the secondary partition when it partitions a parameter. So the slices exist from the start (a
parameter's ``ds_secondary_tensor`` is there before the first forward, as in DeepSpeed), and the first forward
gathers inside the node, as every backward does. The forward and backward strategies share one store and one
pool of output rows, so a forward that gathers from slices adds no buffer of its own.

Note [secondary staleness]: a slice records the unit's ``version`` it was cut from; the engine bumps the
version on every weight change (optimizer step, state-dict or checkpoint load). A slice whose version
differs is never read: the gather falls back to the primary strategy and a fresh slice is cut on release.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from zeropp.comm.buffers import BufferPools
from zeropp.comm.gather import gather_into_pool
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

    def put(self, index: int, version: int, row: torch.Tensor) -> None:
        """Keep a copy of ``row`` as unit ``index``'s slice, cut from weights of ``version`` (row allocated once)."""
        held = self.rows.get(index)
        if held is None:
            held = self.rows[index] = torch.empty_like(row)
        held.copy_(row)
        self.versions[index] = version

    def keep(self, unit: Unit, index: int, group_size: int) -> None:
        """While ``unit`` is gathered: copy chunk ``index`` of ``group_size`` of each parameter into its row."""
        layout = unit.group_layout(group_size)
        held = self.rows.get(unit.index)
        if held is None:
            held = self.rows[unit.index] = torch.empty(layout.numel, dtype=unit.compute_dtype, device=unit.device)
        for slot, off, c in zip(unit.slots, layout.offsets, layout.chunks):  # no concatenated temporary
            held[off : off + c].copy_(slot.full.view(group_size, c)[index])
        self.versions[unit.index] = unit.version


class HpzGather:
    """Gather from current secondary slices over the hpZ group; otherwise through ``primary``.

    The forward and backward instances share ``store`` and ``pools`` (Note [hpZ slices at initialize]); only the
    one built with ``reports_pools`` lists the pools' bytes, so the memory report counts them once."""

    keeps_copies = True

    def __init__(self, comm: Comm, primary: GatherStrategy, store: SecondaryStore,
                 pools: Optional[BufferPools] = None, reports_pools: bool = True) -> None:
        self.comm = comm
        self.primary = primary
        self.store = store
        self.group = comm.topo.hpz
        self.pools = pools if pools is not None else BufferPools("hpz", "out")
        self.reports_pools = reports_pools


    def slice(self, unit: Unit, index: int) -> Optional[torch.Tensor]:
        """This rank's slice of ``unit``'s parameter ``index`` in the secondary copy (a copy, padding included),
        or None while the unit has no current slice (Note [secondary staleness])."""
        if not self.store.is_current(unit):
            return None
        layout = unit.group_layout(self.group.size)
        off, size = layout.offsets[index], layout.chunks[index]
        return self.store.rows[unit.index][off : off + size].clone()
    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        if not self.store.is_current(unit):
            return self.primary.start(unit, phase)
        row = self.store.rows[unit.index]
        return gather_into_pool(self.comm, self.pools["out"], row, unit.group_layout(self.group.size), self.group,
                                phase)

    def two_hop(self, unit: Unit) -> bool:
        return not self.store.is_current(unit) and self.primary.two_hop(unit)

    def on_release(self, unit: Unit) -> None:
        if not self.store.is_current(unit):
            self.store.keep(unit, self.group.index_of(self.comm.topo.rank), self.group.size)
        self.primary.on_release(unit)

    def check_deferred(self) -> None:
        self.primary.check_deferred()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.store.rows.values()) + self.primary.held_tensors()

    def buffer_bytes(self) -> dict[str, int]:
        own = self.pools.buffer_bytes() if self.reports_pools else {}
        return {**own, **self.primary.buffer_bytes()}
