"""The units' full weights, a part the engine owns (:class:`Gathers`): gathering a unit through the pass's
strategy, prefetching the unit that followed it last time, dropping it, and (stages 0-2) rebuilding every full
weight from the shards. The engine's hooks decide when to gather, ``Releases`` (``zero/release.py``) when to drop;
this part does it.
"""
from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Optional, TypeVar

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.strategy import GatherStrategy, PendingGather
from zeropp.offload.link import Transfer
from zeropp.partition.unit import Unit, UnitState
from zeropp.zero.budget import GROUP_ELEMENTS, unit_elements
from zeropp.zero.order_check import GATHER_BACKWARD, GATHER_FORWARD, NormCheck
from zeropp.zero.state import EnginePhase, EngineState
from zeropp.zero.watching import unwatched

# Note [inference mode]: an evaluation under torch.inference_mode() may be the first forward to need a gather
# buffer, an hpZ slice or a prefetch, and a tensor made there is an inference tensor, which the collectives of
# every later training step could not write into ("Inplace update to inference tensor outside
# InferenceMode"). Gathers and releases therefore make their tensors with inference mode off.
F = TypeVar("F", bound=Callable[..., Any])


def _outside_inference_mode(fn: F) -> F:
    """Run ``fn`` with inference mode off (Note [inference mode]); a training step, where it is off already,
    pays one flag read instead of torch's context-manager decorator (about 2% of a launch-bound step)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


# Note [generation gathers]: generation (``engine.held_whole()``: a trainer's ``generate``, TRL's online RL) gathers
# every unit once and keeps the model whole until it ends, instead of once per generated token. The whole-model
# gather goes through the forward's strategy, as a forward's gathers do: with qwZ each unit travels as int8 blocks
# (half the bytes of 16-bit), with hpZ from the intra-node copy where one is current (between a forward and its
# backward; after an optimizer step there is none, so the gather crosses nodes once). The gathered weights are
# freed when generation ends, without cutting hpZ slices (no backward follows). Generation holds the model's
# 16-bit weights plus the shards; where that exceeds ``stage3_max_live_parameters`` the engine warns with the
# bytes and lets each forward gather the units it runs instead.


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


def current_pass(state: EngineState) -> Pass:
    """The pass a gather or release serves now: the backward while one is open, else the forward."""
    return Pass.BACKWARD if state.phase is EnginePhase.BACKWARD else Pass.FORWARD


def coalesces(state: EngineState, strategy: GatherStrategy) -> bool:
    """Whether gathers through ``strategy`` go in groups (Note [gather groups] in ``zero/budget.py``): on (the
    default), prefetching on, a strategy that can (one hop, plain rows), shards in memory (not on NVMe)."""
    return state.policy.coalesced_prefetch and state.budget.prefetch_bucket > 0 and \
        getattr(strategy, "coalesces", False) and not state.residency.swaps_shards


_LEDGER_PHASE = {Pass.FORWARD: Phase.FORWARD_GATHER, Pass.BACKWARD: Phase.BACKWARD_GATHER}
_NOTE_KIND = {Pass.FORWARD: GATHER_FORWARD, Pass.BACKWARD: GATHER_BACKWARD}  # Note [collective order]


class Gathers:
    """Gathers and drops of the state's units (see the module docstring)."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.inflight: dict[Unit, PendingGather] = {}  # prefetches started, not yet landed
        self.passes: dict[Pass, list[Unit]] = {Pass.FORWARD: [], Pass.BACKWARD: []}  # this pass's order
        self.last_order: dict[Pass, list[Unit]] = {Pass.FORWARD: [], Pass.BACKWARD: []}
        self.uploads: dict[Unit, Transfer] = {}  # 16-bit shards on their way up after a step
        # Note [gather groups] in zero/budget.py: each pass's groups of small units, formed at each optimizer step
        self.groups: dict[Pass, dict[Unit, tuple[Unit, ...]]] = {Pass.FORWARD: {}, Pass.BACKWARD: {}}
        # this pass's gathers in the order issued (a dict: ordered, and asked for membership on every gather)
        self.issued: dict[Pass, dict[Unit, None]] = {Pass.FORWARD: {}, Pass.BACKWARD: {}}
        self.last_issued: dict[Pass, list[Unit]] = {Pass.FORWARD: [], Pass.BACKWARD: []}  # the last pass's
        self._cap = min(GROUP_ELEMENTS, state.budget.prefetch_bucket)  # a group's gathered elements, at most
        self._small = frozenset(u for u in state.units if 0 < unit_elements(u) <= self._cap and u not in state.kept)
        # every collective of small units is this long (Note [gather groups]: same sizes on every rank)
        self._pad = min(self._cap, sum(unit_elements(u) for u in self._small))

    def begin(self, which: Pass) -> None:
        """A forward or backward starts: its order and the gathers it has taken are its own."""
        self.passes[which], self.issued[which] = [], {}

    def gather_resident(self, phase: Phase) -> None:
        """Stages 0-2: (re)build every full weight from the shards, after construction and each step."""
        for unit in self.state.units:
            self.await_upload(unit)
            pending = self.state.strategies.forward_gather.start(unit, phase)
            unit.materialize(*pending.finish())
            pending.recycle()  # the rows were copied out: the strategy reuses the buffer
        self.state.strategies.forward_gather.check_deferred()

    def _start(self, unit: Unit, which: Pass, optional: bool = False) -> Optional[PendingGather]:
        """Start gathering ``unit`` once its shard is readable; None when ``optional`` and the shard could not
        be brought in (NVMe buffers busy: the prefetch is skipped)."""
        if not self._prepare(unit, which, optional):
            return None
        return self.strategy(which).start(unit, _LEDGER_PHASE[which])

    def _prepare(self, unit: Unit, which: Pass, optional: bool = False) -> bool:
        """Make ``unit``'s shard readable for its gather (in memory, its upload waited for) and note the gather;
        False when ``optional`` and the shard could not be brought in."""
        if not self.state.residency.shard_in(unit, optional=optional):
            return False
        self.await_upload(unit)
        self.state.order.note(_NOTE_KIND[which], unit.index)
        self.issued[which][unit] = None
        return True

    def await_upload(self, unit: Unit) -> None:
        """Optimizer offload: order the gather after the upload of the shard the last step wrote."""
        upload = self.uploads.pop(unit, None)
        if upload is not None:
            with self.state.timer.span("offload_io"):
                upload.wait()

    def copy_back(self, unit: Unit) -> None:
        """Optimizer offload with device memory apart from the host: start uploading the updated shard."""
        pair = unit.copy_back()
        if pair is None:
            return
        self.uploads[unit] = self.state.link.upload(*pair)
        if self.state.residency.swaps_states and unit.staged_row is None:  # fp32: the source is the master, which
            self.state.link.wait_uploads()                                  # NVMe swaps out next

    def strategy(self, which: Pass) -> GatherStrategy:
        strategies = self.state.strategies
        return strategies.forward_gather if which is Pass.FORWARD else strategies.backward_gather

    @_outside_inference_mode
    @unwatched
    def gather(self, unit: Unit, which: Pass) -> None:
        order = self.passes[which]
        kept = self.state.kept
        if unit.state is UnitState.GATHERED:
            if unit not in kept:
                return
            if kept.holds(unit):  # in the order all the same, so that prefetching sees the same order
                order.append(unit)      # whether it was kept or gathered afresh
                self._prefetch(which, len(order) - 1)
                return
            # persistent, but its shard changed since: gather it afresh. Freed without on_release, so that no
            # hpZ slice is cut from the old weights under the new version.
            self.free(unit)
        order.append(unit)
        pending = self.inflight.pop(unit, None) or self._demand(unit, which)
        self._prefetch(which, len(order) - 1)
        self.land(unit, pending)
        self.state.budget.gathered(unit)
        kept.gathered(unit)

    def _demand(self, unit: Unit, which: Pass) -> PendingGather:
        """Start the gather of ``unit``, needed now: with its group's other members (Note [gather groups])."""
        batch = self._group_from(unit, which)
        if batch is None:
            pending = self._start(unit, which)
            assert pending is not None
            return pending
        self._start_many(batch, which)
        return self.inflight.pop(unit)

    def land(self, unit: Unit, pending: PendingGather) -> None:
        """Wait for ``unit``'s gather and give the unit its full weights."""
        rows, layout = pending.finish()
        self.state.residency.shard_done(unit)
        unit.materialize(rows, layout)
        pending.recycle()  # the rows were copied out: the strategy reuses the buffer (Note [buffer pool])

    def _prefetch(self, which: Pass, position: int) -> None:
        """Start gathering the unit that followed this one last time, so it overlaps this unit's compute.

        A two-hop gather (Note [two-hop gather] in ``comm/gather.py``) starts its first hop two units ahead and
        is advanced (its second hop issued) one unit ahead, here, at the same point on every rank.
        """
        last = self.last_order[which]
        if position + 1 >= len(last) or last[position] is not self.passes[which][position]:
            return
        nxt, current = last[position + 1], last[position]
        ahead = self.inflight.get(nxt)  # started one unit ago: a two-hop gather's first hop
        # one full gather in flight at most, within stage3_prefetch_bucket_size / stage3_max_live_parameters; never
        # the unit being gathered now (a kept unit twice in a row): its shard is let go once it lands
        budget = self.state.budget
        if ahead is None and nxt is not current and nxt.state is UnitState.SHARDED and not self.inflight and \
                budget.admits(nxt, last[position]):
            batch = self._group_from(nxt, which, current)
            if batch is not None:
                self._start_many(batch, which)
            else:
                pending = self._start(nxt, which, optional=True)
                if pending is not None:
                    self.inflight[nxt] = pending
        if position + 2 < len(last):
            after = last[position + 2]
            if nxt in self.inflight and len(self.inflight) == 1 and after not in (nxt, current) and \
                    after.state is UnitState.SHARDED and \
                    self.strategy(which).two_hop(after) and budget.admits(after, last[position], nxt):
                pending = self._start(after, which, optional=True)
                if pending is not None:
                    self.inflight[after] = pending
            self.state.residency.prefetch_shard(after)  # NVMe: read the shard while these gathers run
        if ahead is not None:  # after the next first hop was issued, so the link stays busy while this waits
            ahead.advance()

    def _group_from(self, unit: Unit, which: Pass, *gathering: Unit) -> Optional[list[Unit]]:
        """The units to gather in one collective with ``unit`` (Note [gather groups] in ``zero/budget.py``): the
        members of its group that no gather of this pass has taken yet, in group order, within DeepSpeed's bounds
        while ``gathering`` are gathered; ``[unit]`` for a small unit gathered again or in no group (a padded
        collective all the same); None where this pass forms no groups or ``unit`` is not small."""
        groups = self.groups[which]
        if not groups or unit not in self._small:
            return None
        group = groups.get(unit)
        issued = self.issued[which]
        if group is None or unit in issued:
            return [unit]
        # every member not taken yet, those before ``unit`` too: ranks that run a group's units in another
        # order then still gather each group in one collective, and issue as many collectives
        batch, total = [], unit_elements(unit)
        for u in group:
            if u is not unit:
                if u.state is not UnitState.SHARDED or u in issued:  # (``gathering`` are issued)
                    continue
                if not self.state.budget.admits_elements(total + unit_elements(u), *gathering):
                    continue
                total += unit_elements(u)
            batch.append(u)
        return batch

    def regroup(self, check: NormCheck) -> None:
        """After an optimizer step whose collective order check passed (``check``, what the step's norm returned
        only where the ranks' gathers agreed, or a world of one): each pass's groups from the gathers its last run
        issued, which the check has just found the same on every rank (Note [gather groups])."""
        del check  # what it proves is that it exists: the norm raised where the ranks' gathers differed
        for which in Pass:
            self._form_groups(which, self.last_issued[which])

    def _form_groups(self, which: Pass, order: list[Unit]) -> None:
        """``which``'s groups: runs of distinct small units in ``order``, each of at most the group's elements and
        of one dtype and device (Note [gather groups])."""
        groups: dict[Unit, tuple[Unit, ...]] = {}
        if coalesces(self.state, self.strategy(which)):
            run: list[Unit] = []
            elements = 0
            for unit in dict.fromkeys(order):  # a unit used twice is grouped where it came first
                small = unit in self._small
                if run and (not small or elements + unit_elements(unit) > self._cap or
                            (unit.compute_dtype, unit.device) != (run[0].compute_dtype, run[0].device)):
                    groups.update((u, tuple(run)) for u in run)
                    run, elements = [], 0
                if small:
                    run.append(unit)
                    elements += unit_elements(unit)
            groups.update((u, tuple(run)) for u in run)
        self.groups[which] = groups

    def _start_many(self, units: list[Unit], which: Pass) -> None:
        """Start one collective for ``units``, padded to the length of every collective of small units."""
        for unit in units:
            self._prepare(unit, which)
        strategy = self.strategy(which)
        for unit, pending in zip(units, strategy.start_many(units, _LEDGER_PHASE[which],  # type: ignore
                                                            pad_to=self._pad)):
            self.inflight[unit] = pending

    @_outside_inference_mode
    @unwatched
    def gather_all(self) -> list[Unit]:
        """Gather every released unit through the forward's strategy (qwZ's int8 blocks, hpZ's copy where
        current), in model order; collective. Returns the units gathered here (for :meth:`free_all`)."""
        held = []
        for unit in self.state.units:
            if unit.state is UnitState.SHARDED:
                pending = self._start(unit, Pass.FORWARD)
                assert pending is not None
                self.land(unit, pending)
                self.state.budget.gathered(unit)
                held.append(unit)
        self.state.strategies.forward_gather.check_deferred()
        return held

    @_outside_inference_mode
    @unwatched
    def drop(self, unit: Unit, which: Pass) -> None:
        """Release a gathered unit through the pass's strategy (hpZ keeps its slice); ``Releases`` decides when."""
        self.strategy(which).on_release(unit)
        self.free(unit)

    def free(self, unit: Unit) -> None:
        """Drop a gathered unit's full weights (no strategy sees it: no hpZ slice is kept)."""
        self.state.budget.released(unit)
        unit.release()

    @_outside_inference_mode
    @unwatched
    def drain(self, which: Pass) -> None:
        """Complete and drop prefetches that were not used (the model took another path this time)."""
        for unit, pending in list(self.inflight.items()):
            pending.finish()
            pending.recycle()
            self.state.residency.shard_done(unit)
        self.inflight.clear()
        for unit in self.state.units:  # shards read ahead that no gather used (another path, or already gathered)
            self.state.residency.shard_done(unit)
        if self.issued[which]:  # (a pass on weights held whole, a generation's, issues none and changes nothing)
            # its end, in the check's digest: the gathers regroup() reads are then the same pass's on every rank
            self.state.order.note_end(_NOTE_KIND[which])
            self.last_issued[which] = list(self.issued[which])
        self.last_order[which] = self.passes[which]
        self.begin(which)

    def forget_order(self) -> None:
        """Forget the order the last passes gathered in (what prefetching follows): the next pass learns it."""
        for order in self.last_order.values():
            order.clear()

    def prefetching(self, unit: Unit) -> bool:
        """Whether ``unit``'s gather was started ahead of its use and has not landed yet."""
        return unit in self.inflight

    @property
    def knows_order(self) -> bool:
        """Whether a pass has taught the order prefetching follows."""
        return any(self.last_order.values())
