"""``GatheredParameters``: full parameters outside the forward, to read them or to change them on one rank.

Under stage 3 a parameter has no storage between its unit's forward and backward. DeepSpeed's context
manager gives code outside the training step (initialization, surgery on embeddings, inspection) the
full values; with ``modifier_rank=r`` the values rank ``r`` holds at exit become the parameters on every
rank: its shards, the fp32 masters and (by the version bump) every hpZ secondary slice. Unlike
DeepSpeed's, the masters follow the change, so the optimizer steps the new values.

Values come from the fp32 masters over a plain all-gather (never qwZ's quantized one), cast to the
compute dtype, so what is read is exactly the 16-bit shard the next forward would gather. A parameter
that rank ``r`` left unchanged keeps its fp32 master bit for bit; a changed one takes the new 16-bit value.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from zeropp.comm.ledger import Phase
from zeropp.zero.construction import PARAMS
from zeropp.partition.unit import ParamSlot, Unit, UnitState
from zeropp.partition.access import ParameterAccessError
from zeropp.zero.param_use import register_external_parameter
from zeropp.zero.state import EngineHandle

_ENGINES: "weakref.WeakSet[EngineHandle]" = weakref.WeakSet()  # live engines, to find a parameter's owner


def track(engine: EngineHandle) -> None:
    """Called by each engine at construction, so GatheredParameters can find who manages a parameter."""
    _ENGINES.add(engine)


def untrack(engine: EngineHandle) -> None:
    """The engine gave its model back (``destroy()``): its parameters are no longer managed."""
    _ENGINES.discard(engine)


def gather_from_masters(engine: EngineHandle) -> None:
    """Gather every sharded unit of ``engine`` from its fp32 masters and keep it gathered (collective)."""
    _Opened(engine, {id(s.param) for u in engine.state.units for s in u.slots}, snapshot=False)


def managed_ids() -> set[int]:
    """The ids of the parameters that live engines manage."""
    return {id(s.param) for engine in list(_ENGINES) for u in engine.state.units for s in u.slots}


class _Opened:
    """What one engine gathered for the context: units, the given parameters' slots, values at entry."""

    def __init__(self, engine: EngineHandle, ids: set[int], snapshot: bool) -> None:
        self.engine = engine
        self.units = [u for u in engine.state.units if any(id(s.param) in ids for s in u.slots)]
        self.slots = [(u, s) for u in self.units for s in u.slots if id(s.param) in ids]
        engine.join_update()
        self.gathered = [u for u in self.units if u.state is UnitState.SHARDED]
        self.gather_from_masters()
        self.users = {id(s): s.users() for u in self.gathered for s in u.slots}  # before the block's aliases
        self.before = {id(s): _flat(s).clone() for _, s in self.slots} if snapshot else {}

    def gather_from_masters(self) -> None:
        """The gathered units' full values from the fp32 masters (collective), cast to the compute dtype."""
        engine, world = self.engine, self.engine.state.topo.world
        for u in self.gathered:
            rows = torch.empty(world.size, u.row.numel, dtype=torch.float32, device=u.device)
            with engine.state.residency.resident([u], dirty=False):
                engine.state.comm.all_gather(rows, u.master.to(u.device), world, Phase.OTHER)
            u.materialize(rows.to(u.compute_dtype), u.row)

    def publish(self, modifier_rank: int) -> None:
        """Broadcast rank ``modifier_rank``'s values and write the changed ones into the masters."""
        engine = self.engine
        for _, slot in self.slots:
            engine.state.comm.broadcast(_flat(slot), modifier_rank, engine.state.topo.world, Phase.OTHER)
        changed = [(u, s) for u, s in self.slots if not torch.equal(_flat(s), self.before[id(s)])]
        if not changed:  # every rank compares the same broadcast values, so all take this branch together
            return
        by_unit: dict[Unit, set[int]] = {}
        for u, s in changed:
            by_unit.setdefault(u, set()).add(id(s))
        with torch.no_grad():
            for u, ids in by_unit.items():
                with engine.state.residency.resident([u]):
                    for slot, view in zip(u.slots, u.master_views()):
                        if id(slot) in ids:
                            start, stop = slot.spec.owned(u.rank)
                            view.zero_()
                            view[: stop - start].copy_(_flat(slot)[start:stop].float())
        engine.masters_changed()  # recast shards, bump versions (stale hpZ slices), rebuild resident weights

    def close(self) -> None:
        """Release what the block gathered (no hpZ slice is kept from an out-of-band gather). Tensors the block
        took from the parameters (``state_dict()`` values, ``detach()``) keep the gathered values: their storage
        is handed over to them instead of freed (Note [released storage] in ``partition/unit.py``)."""
        moved = False
        for u in self.gathered:
            if u.state is UnitState.GATHERED:
                moved |= u.release(self.users)
        if moved:
            self.engine.storages_moved()


def _flat(slot: ParamSlot) -> torch.Tensor:
    return slot.full[: slot.spec.numel]


class GatheredParameters:
    """Gather full parameters for the duration of a ``with`` block (DeepSpeed's ``zero.GatheredParameters``).

    ``params``: a parameter, an iterable of them, or None. Collective: every rank enters and leaves the
    block together. ``modifier_rank=None`` gathers for reading; changes are discarded (and stages 0-2,
    whose weights are resident, do not see them either way). ``modifier_rank=r`` makes rank ``r``'s values
    at exit the parameters everywhere. ``fwd_module`` also registers the parameters as read by that module's
    forward (:func:`register_external_parameter`). ``enabled=False`` does nothing. Parameters partitioned at
    construction (``zero.Init``) and not yet handed to ``initialize`` are gathered from their chunks and
    partitioned again at exit, from rank ``modifier_rank``'s values (or unchanged). Other parameters no engine
    manages are left alone, as DeepSpeed does.
    """

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter], None], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        if modifier_rank is not None and (not isinstance(modifier_rank, int) or modifier_rank < 0):
            raise ValueError(f"GatheredParameters: modifier_rank must be None or a rank >= 0, got {modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._opened: list[_Opened] = []
        self._constructed: list[nn.Parameter] = []
        self._versions: list[int] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled or not self.params:
            return self
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        self._constructed = [p for p in self.params if PARAMS.get(p) is not None]
        for p in self._constructed:
            PARAMS.gather(p).pins += 1
        ids = {id(p) for p in self.params}
        for engine in sorted(_ENGINES, key=id):  # one engine per model; sorted only for a fixed order
            if self.modifier_rank is not None and self.modifier_rank >= engine.state.topo.world_size:
                raise ValueError(f"GatheredParameters: modifier_rank {self.modifier_rank} is not a rank of the "
                                 f"world of {engine.state.topo.world_size}")
            if any(id(s.param) in ids for u in engine.state.units for s in u.slots):
                self._opened.append(_Opened(engine, ids, snapshot=self.modifier_rank is not None))
        self._versions = [p._version for p in self.params]  # in-place writes bump them (Note below)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        opened, self._opened = self._opened, []
        constructed, self._constructed = self._constructed, []
        written = []
        if exc_type is None and self.modifier_rank is None and (opened or constructed):
            comm = opened[0].engine.state.comm if opened else PARAMS.comm
            written = self._writes_anywhere(comm)
            if written and not any(o.engine.state.policy.sanity_checks for o in opened):
                written = self._changed_anywhere(opened, comm)
        for p in constructed:
            rec = PARAMS.get(p)
            if rec is not None:
                rec.pins -= 1
                if rec.pins == 0:  # an exception may be on one rank only: then no collective
                    PARAMS.repartition(p, self.modifier_rank if exc_type is None else None)
        try:
            if exc_type is None and self.modifier_rank is not None:
                for o in opened:
                    o.publish(self.modifier_rank)
        finally:
            for o in opened:
                o.close()
        if written:
            raise ParameterAccessError(
                f"GatheredParameters(modifier_rank=None): an in-place modification of parameters "
                f"{written[1:] or '(on another rank)'} inside the block, on rank(s) {written[0]}, is discarded at its "
                "end: with modifier_rank=None the gathered values are for reading. Pass modifier_rank=r to make rank "
                "r's values the parameters everywhere (writing back the values already there passes, unless "
                "zero_optimization.enable_sanity_checks is true)")

    def _changed_anywhere(self, opened: list[_Opened], comm: Any) -> list:
        """Note [writes in a read-only gather], without ``enable_sanity_checks``: some rank wrote; did a value
        change? Each rank keeps what it wrote, gathers the units again from the masters (every rank, every
        unit: collective) and compares. A write outside the units the context gathered (a resident weight, a
        parameter still under construction) counts as a change. ``[ranks that changed a value, names...]``, or
        ``[]`` when every write put back the values that were there (``load_state_dict`` of the same weights)."""
        checkable = {id(s.param) for o in opened for u in o.gathered for s in u.slots}
        mine = [(i, p) for i, (p, v) in enumerate(zip(self.params, self._versions)) if p._version != v]
        kept = {i: p.detach().clone() for i, p in mine if id(p) in checkable}
        for o in opened:
            o.gather_from_masters()
        changed = [i for i, p in mine if i not in kept or not torch.equal(kept[i], p.detach())]
        return self._agree(comm, changed)

    def _writes_anywhere(self, comm: Any) -> list:
        """Note [writes in a read-only gather]: parameters written in place inside a ``modifier_rank=None`` block
        (their version counters moved) would lose the write silently, on the ranks that made it; the ranks agree
        (one all-reduce) so that every rank raises. With ``enable_sanity_checks`` any write raises (DeepSpeed's
        check); without it only one that changed a value does (``_changed_anywhere``), so writing back the
        values already there passes. ``[ranks that wrote, names written here...]``, or ``[]``."""
        return self._agree(comm, [i for i, (p, v) in enumerate(zip(self.params, self._versions)) if p._version != v])

    def _agree(self, comm: Any, mine: list[int]) -> list:
        """One all-reduce: which ranks have a non-empty ``mine`` (indices into ``params``); ``[ranks, names of
        mine...]`` or ``[]``."""
        flags = torch.zeros(comm.topo.world_size)
        flags[comm.topo.rank] = float(bool(mine))
        comm.all_reduce(flags, comm.topo.world, Phase.OTHER)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if not ranks:
            return []
        names = {id(s.param): s.name for engine in list(_ENGINES) for u in engine.state.units for s in u.slots}

        def name(p: nn.Parameter, i: int) -> str:
            rec = PARAMS.get(p)
            return names.get(id(p)) or (rec.label if rec is not None else f"params[{i}]")
        return [ranks] + [name(self.params[i], i) for i in mine]
