"""Stage 3's persistent units: small units that stay gathered from their first use until the weights change.

Note [persistent units]
~~~~~~~~~~~~~~~~~~~~~~~
DeepSpeed keeps every parameter of at most ``stage3_param_persistence_threshold`` elements whole on every rank
(``ds_persist``), so that a LayerNorm's 2 x hidden values do not cost an all-gather, with its latency, in every
forward and every backward. zeropp gathers units, not parameters, so the threshold applies to a unit's
elements: a unit of at most that many stays gathered after its forward, through backward and the following
micro-steps, and is gathered again only after the optimizer (or a weight load) changed its shard. With
``gather_granularity: "block"`` a block's small parameters already ride in the block's gather; what persists
there are the small units outside blocks (a final norm, a small head). ``stage3_model_persistence_threshold``
caps the elements persistent units hold together, taken in model order as DeepSpeed takes parameters.

Staleness is read from ``Unit.version``, which every write of a unit's shard bumps
(``refresh_shard_from_master``): a kept unit whose version moved is released and gathered afresh at its next
use. No step has to remember to drop it, so a checkpoint load, ``GatheredParameters(modifier_rank=...)`` or
a delayed update's publication are all covered.

Every rank picks the same units from the same plan, and keeps and re-gathers them at the same points, so the
collectives stay in one order on every rank.
"""
from __future__ import annotations

from typing import Iterable

from zeropp.partition.unit import Unit, UnitState


def persistent_units(units: Iterable[Unit], threshold: int, model_threshold: int) -> frozenset[Unit]:
    """The units that persist: each of at most ``threshold`` elements, within ``model_threshold`` in total."""
    chosen, total = [], 0
    for unit in units:
        numel = sum(slot.spec.numel for slot in unit.slots)
        if numel > threshold or total + numel > model_threshold:
            continue
        chosen.append(unit)
        total += numel
    return frozenset(chosen)


class KeptUnits:
    """Which persistent units are gathered and current (Note [persistent units])."""

    def __init__(self, units: frozenset[Unit]) -> None:
        self.units = units
        self._version: dict[Unit, int] = {}  # unit -> the shard version its gathered weights were built from

    def __contains__(self, unit: Unit) -> bool:
        return unit in self.units

    def gathered(self, unit: Unit) -> None:
        if unit in self.units:
            self._version[unit] = unit.version

    def holds(self, unit: Unit) -> bool:
        """Whether ``unit`` is gathered from its current shard and stays so (its releases are skipped)."""
        return unit.state is UnitState.GATHERED and self._version.get(unit, -1) == unit.version
