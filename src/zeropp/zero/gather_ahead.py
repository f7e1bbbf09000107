"""The next forward's first gathers, started while the optimizer step still runs.

Note [gathers ahead of the forward]: on a slow link a stage-3 forward lasts as long as its gathers take on the
link, and with gradient clipping no gather of the next step can start before the global norm is known: the
optimizer step is the only work left to hide one behind. So the engine updates first the units the last forward
began with, starts their gathers as the forward's first hook and prefetch would (the first unit whole, the next
one's first hop when its gather has two), and updates the rest while those bytes travel. The values are the
same: the gathers read shards already updated, and their bytes count in the next step
(``CommLedger.for_next_step``).

Guards:
* the gathers read the shards as they are when started; a write before the forward (a load, ``GatheredParameters``
  with a modifier) bumps the unit's version, and the forward then gathers again (:meth:`GatherAhead.stale`);
  a forward on another path drains them as any unused prefetch, ``engine.close()`` too;
* updating part of the masters first is the same update only for an optimizer that treats each parameter alone
  (:data:`PER_PARAMETER_OPTIMIZERS`); with any other, with offloaded or NVMe shards or a delayed update, the
  forward starts its gathers itself.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from zeropp.comm.ledger import CommLedger
from zeropp.comm.strategy import PendingGather
from zeropp.offload.cpu_adam import CpuAdam
from zeropp.optim import UncorrectedAdam
from zeropp.partition.unit import Unit, UnitState

# optimizers whose step updates each parameter from its own gradient and state alone (a step counter per
# parameter, no group-wide norm or counter): stepping some masters first is the same update
PER_PARAMETER_OPTIMIZERS = frozenset({torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, UncorrectedAdam, CpuAdam})


class GatherAhead:
    """Which gathers the step started for the next forward, and the weight versions they read."""

    def __init__(self) -> None:
        self.versions: dict[Unit, int] = {}

    @staticmethod
    def head(last_forward: list[Unit], optimizer: torch.optim.Optimizer, allowed: bool) -> list[Unit]:
        """The units whose gathers the step may start: the first one or two of the last forward."""
        if not (allowed and last_forward and type(optimizer) in PER_PARAMETER_OPTIMIZERS
                and last_forward[0].state is UnitState.SHARDED):
            return []
        second = last_forward[1:2]
        if second and (second[0] is last_forward[0] or second[0].state is not UnitState.SHARDED):
            second = []
        return last_forward[:1] + second

    def start(self, head: list[Unit], ledger: CommLedger, two_hop: Callable[[Unit], bool],
              admits: Callable[..., bool], start: Callable[[Unit], Optional[PendingGather]],
              inflight: dict[Unit, PendingGather]) -> None:
        """Start the gathers of ``head`` (already updated) into ``inflight``, within the prefetch bounds."""
        with ledger.for_next_step():
            for i, unit in enumerate(head):
                # as the forward's prefetch: the second unit only for its first hop (known once it is updated)
                if i and not two_hop(unit) or not admits(unit, *head[:i]):
                    return
                pending = start(unit)
                if pending is None:
                    return
                inflight[unit], self.versions[unit] = pending, unit.version

    def stale(self, unit: Unit) -> bool:
        """Whether a gather of ``unit`` the step started read weights written since (forget it either way)."""
        return self.versions.pop(unit, unit.version) != unit.version

    def clear(self) -> None:
        self.versions.clear()
