"""Stage 3's prefetch budget: how many elements of full weights are gathered on this rank now and at their peak,
and whether a prefetch fits DeepSpeed's bounds (:class:`PrefetchBudget`); and the size of a gather group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zeropp.partition.unit import Unit

# Note [gather groups] (``zeropp_coalesced_prefetch``, on by default): over one hop, small units (at most
# GROUP_ELEMENTS gathered, not persistent) are gathered in groups, one collective per group, instead of one each:
# a model of many small units (thin blocks, LoRA adapters in units of their own, stray norms) pays one
# collective's latency per group. A group is gathered whole when its first unit is needed or prefetched (the
# members no gather of the pass has taken yet, that ZeRO-R's bounds admit); each unit still lands (is copied into
# its weights) when it is used, and buffers stay bounded by GROUP_ELEMENTS, never by the number of units. Units
# over GROUP_ELEMENTS are gathered one at a time as before, so models of large blocks see no change; a two-hop
# route, qwZ and hpZ gather one unit at a time. On the launch-bound model (48 blocks of 8,448 elements, 2 ranks
# over loopback) a step's gathers went from 102 collectives to 2 (comm/gather.py's ``AllGather.start_many``).
# Every rank must issue the same collectives, so every rank must hold the same groups. They are formed after each
# optimizer step (``Gathers.regroup``) from the gathers the last forward and the last backward issued: runs of
# distinct small units, at most GROUP_ELEMENTS (and stage3_prefetch_bucket_size) together. The step's collective
# order check has just found those gathers, and where each pass ended, the same on every rank (Note [collective
# order]); a rank's own order of use would not do: a rank that left a frozen block out (a layer drop of its own)
# would form other groups, and its next step's collectives would no longer pair. Until the first step there are
# no groups. A rank that skips a unit gathers it all the same with its group and drains it unused.
# Ranks that run different modules must fail by name, not by a signal: gloo aborts the process when a collective
# brings more bytes than the rank expected. So every collective of small units, a group or a small unit alone
# (gathered again, or in no group), is zero-padded to one length fixed at initialize (the smaller of
# GROUP_ELEMENTS and all small units together, gathered): two ranks that gather different small units issue
# collectives of the same size, and the order check refuses the step by name. Padding costs bytes, not
# collectives: every group but a pass's last is nearly full, and the whole launch-bound model is one group.
GROUP_ELEMENTS = 1 << 20


def unit_elements(unit: Unit) -> int:
    """Elements of ``unit``'s full (padded) weights once gathered."""
    return sum(s.spec.padded for s in unit.slots)


@dataclass
class PrefetchBudget:
    """Stage 3's full weights gathered on this rank: how many elements now, their peak per step, and whether a
    prefetch fits DeepSpeed's bounds.

    ``max_live`` (``stage3_max_live_parameters``) bounds the elements gathered plus in flight when a prefetch
    starts, and ``prefetch_bucket`` (``stage3_prefetch_bucket_size``) the elements one prefetch may bring;
    0 turns prefetching off, as in DeepSpeed. A gather the model needs now is never refused: the bounds
    apply to gathers started ahead of use (the engine prefetches one unit ahead; a two-hop gather's first hop
    two units ahead, counted with the unit between).
    """

    max_live: int
    prefetch_bucket: int
    itemsize: int
    live: int = 0
    peak: int = 0
    last_step_peak: Optional[int] = None
    _units: set[Unit] = field(default_factory=set)

    def gathered(self, unit: Unit) -> None:
        if unit not in self._units:
            self._units.add(unit)
            self.live += unit_elements(unit)
            self.peak = max(self.peak, self.live)

    def released(self, unit: Unit) -> None:
        if unit in self._units:
            self._units.discard(unit)
            self.live -= unit_elements(unit)

    def admits(self, unit: Unit, *gathering: Unit) -> bool:
        """Whether a prefetch of ``unit`` fits while ``gathering`` (not counted yet) are being gathered."""
        return self.admits_elements(unit_elements(unit), *gathering)

    def admits_elements(self, need: int, *gathering: Unit) -> bool:
        """Whether a prefetch of ``need`` elements (a unit, or units in one collective) fits while ``gathering``
        are being gathered."""
        return need <= self.prefetch_bucket and \
            self.live + sum(unit_elements(u) for u in gathering) + need <= self.max_live

    def close_step(self) -> None:
        self.last_step_peak, self.peak = self.peak, self.live

    def peak_bytes(self) -> int:
        peak = self.last_step_peak if self.last_step_peak is not None else self.peak
        return peak * self.itemsize
