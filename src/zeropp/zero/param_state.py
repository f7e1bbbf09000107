"""One parameter's model states, whole or this rank's part, read and written through the engine that manages it.

What DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` & co. give scripts (the compatibility layer maps its
names onto these): the fp32 master, the reduced gradient and each optimizer state (Adam's ``exp_avg``...) of a
parameter, gathered whole from every rank's chunk, or this rank's part of it, and the writes back.

* Whole values are collective: every rank calls, and each gets the same full tensor (an all-gather of the chunks
  over the ranks that shard the optimizer state; stage 0 holds them whole already). Writes are local: each rank
  takes its part of the full value it is given, so every rank must be given the same value.
* A rank's part is the range of the flattened parameter it owns (Note [shard layout] in ``partition/spec.py``),
  padding left out: ``local_*`` values have ``stop - start`` elements, possibly none.
* The gradient is the one the next optimizer step would use: after ``engine.backward`` and before
  ``engine.step()``, averaged over the ranks as the step averages it and with the fp16 loss scale taken out
  (stages 0-1 average the whole gradients here, a collective; stages 2-3 hold them reduced already).
* Writes to a master publish it at once (16-bit shards recast, hpZ copies stale; stages 0-2 rebuild their
  resident weights, a collective); a delayed update still running is joined first, and offloaded rows are
  brought into memory around every read and write.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from zeropp.comm.ledger import Phase
from zeropp.partition.unit import ParamSlot, Unit
from zeropp.zero import gathered
from zeropp.zero.state import EngineHandle


@dataclass(frozen=True)
class Located:
    """Where a parameter's states live: its engine, unit and position in the unit."""

    engine: EngineHandle
    unit: Unit
    index: int

    @property
    def slot(self) -> ParamSlot:
        return self.unit.slots[self.index]

    @property
    def span(self) -> tuple[int, int]:
        """The [start, stop) of the flattened parameter this rank owns."""
        return self.slot.spec.owned(self.unit.rank)


def unit_sharing(t: torch.Tensor) -> Optional[tuple[EngineHandle, Unit]]:
    """The stage-3 engine and unit whose weights ``t`` shares storage with (a tensor autograd saved of a
    parameter comes back as a plain tensor over the same storage), or None."""
    for engine in list(gathered._ENGINES):
        unit = engine.unit_of(t)
        if unit is not None:
            return engine, unit
    return None


def locate(param: torch.Tensor) -> Optional[Located]:
    """The engine, unit and slot managing ``param``, or None when no live engine manages it."""
    for engine in list(gathered._ENGINES):
        for unit in engine.state.units:
            for i, slot in enumerate(unit.slots):
                if slot.param is param:
                    return Located(engine, unit, i)
    return None


def _full(loc: Located, chunk: torch.Tensor) -> torch.Tensor:
    """Every rank's ``chunk`` of the parameter (fp32), put together and shaped like it."""
    engine, spec = loc.engine, loc.slot.spec
    chunk = chunk.detach().to(torch.float32).reshape(-1).contiguous()
    if engine.state.shard_world == 1:
        flat = chunk
    else:
        flat = torch.empty(engine.state.shard_world * chunk.numel(), dtype=torch.float32, device=chunk.device)
        engine.state.comm.all_gather(flat, chunk, engine.state.topo.world, Phase.OTHER)
    return flat[: spec.numel].view(spec.shape).clone()


def _own_part(loc: Located, value: torch.Tensor, where: str) -> torch.Tensor:
    spec = loc.slot.spec
    if tuple(value.shape) != tuple(spec.shape) and value.numel() != spec.numel:
        raise ValueError(f"{where}: parameter {loc.slot.name!r} has shape {tuple(spec.shape)}, the value "
                         f"{tuple(value.shape)}")
    start, stop = loc.span
    return value.detach().reshape(-1)[start:stop].to(torch.float32)


def _write(target: torch.Tensor, part: torch.Tensor) -> None:
    with torch.no_grad():
        target.zero_()  # padding stays zero (Note [shard layout])
        target[: part.numel()].copy_(part.to(target.device))


# ---- the fp32 master ------------------------------------------------------------------------------------------
def full_master(loc: Located) -> torch.Tensor:
    """The whole fp32 master of the parameter (collective)."""
    loc.engine.join_update()
    with loc.engine.state.residency.resident([loc.unit], dirty=False):
        return _full(loc, loc.unit.master_values()[loc.index])


def local_master(loc: Located) -> torch.Tensor:
    """This rank's part of the fp32 master (a copy)."""
    loc.engine.join_update()
    start, stop = loc.span
    with loc.engine.state.residency.resident([loc.unit], dirty=False):
        return loc.unit.master_values()[loc.index][: stop - start].detach().float().clone()


def set_master(loc: Located, value: torch.Tensor, local: bool = False) -> None:
    """Write the parameter's fp32 master (``local``: this rank's part only) and publish it as the weights."""
    engine = loc.engine
    engine.join_update()
    part = value.detach().reshape(-1).float() if local else _own_part(loc, value, "set the fp32 parameter")
    start, stop = loc.span
    if part.numel() != stop - start:
        raise ValueError(f"parameter {loc.slot.name!r}: this rank owns {stop - start} elements, the value has "
                         f"{part.numel()}")
    with engine.state.residency.resident([loc.unit]):
        _write(loc.unit.master_views()[loc.index], part)
    engine.masters_changed()


# ---- hpZ's secondary copy -----------------------------------------------------------------------------------------
def hpz_group(loc: Located) -> Any:
    """The process group of hpZ's secondary partition of the parameter (``zero_hpz_partition_size`` > 1), or
    None without hpZ."""
    hpz = loc.engine.state.strategies.secondary
    return None if hpz is None else hpz.group.handle


def secondary_part(loc: Located) -> Optional[torch.Tensor]:
    """This rank's slice of the parameter in hpZ's secondary copy (a copy, padding included), or None: no hpZ, or
    no current slice (the weights changed since the last was cut: Note [secondary staleness] in ``plus/hpz.py``;
    one is cut at initialize and at each forward's release)."""
    hpz = loc.engine.state.strategies.secondary
    return None if hpz is None else hpz.slice(loc.unit, loc.index)


# ---- the gradient ---------------------------------------------------------------------------------------------
def full_grad(loc: Located) -> Optional[torch.Tensor]:
    """The parameter's averaged, unscaled gradient as the next step will use it; None before any backward."""
    engine, slot = loc.engine, loc.slot
    if not engine.state.plan.reduces_as_ready:  # stages 0-1: whole local gradients until the boundary
        g = slot.param.grad
        if g is None:
            return None
        mean = g.detach().to(torch.float32).clone()
        engine.state.comm.all_reduce(mean, engine.state.topo.world, Phase.OTHER)
        return mean.mul_(engine.grad_unscale / engine.state.topo.world_size)
    if loc.unit.grad is None:
        return None
    with engine.state.residency.resident([loc.unit], dirty=False):
        return _full(loc, loc.unit.grad_views()[loc.index]).mul_(engine.grad_unscale)


def local_grad(loc: Located, padded: bool = False) -> Optional[torch.Tensor]:
    """This rank's part of the reduced, unscaled gradient (stages 2-3; ``padded``: the whole chunk, its zero
    padding included); None before any backward."""
    return local_grads([loc], padded)[0]


def local_grads(locs: list[Located], padded: bool = False) -> list[Optional[torch.Tensor]]:
    """:func:`local_grad` of each parameter (of one engine), reading each unit's gradient row once: one pass of
    the residency over the units' rows (with NVMe, each row is read from its file once, nothing else)."""
    if not locs:
        return []
    engine = locs[0].engine
    if not engine.state.plan.reduces_as_ready:
        raise ValueError("the local gradient is a ZeRO-3 (and 2) notion: at stages 0-1 every rank holds the whole "
                         "gradient until the step; use the full gradient")
    out: list[Optional[torch.Tensor]] = [None] * len(locs)
    of_unit: dict[Unit, list[int]] = {}
    for i, loc in enumerate(locs):
        of_unit.setdefault(loc.unit, []).append(i)
    for group in engine.state.residency.grad_pass([u for u in of_unit if u.grad is not None]):
        for unit in group:
            views = unit.grad_views()
            for i in of_unit[unit]:
                start, stop = locs[i].span
                chunk = views[locs[i].index]
                out[i] = (chunk if padded else chunk[: stop - start]).detach().float().mul(engine.grad_unscale)
    return out


def grad_norms(locs: list[Located]) -> list[torch.Tensor]:
    """Each parameter's unscaled gradient L2 norm, as the next step sees it (0 before any backward); collective:
    one all-reduce of the squared norms of this rank's parts (stages 2-3), whole gradients at stages 0-1."""
    if not locs:
        return []
    engine = locs[0].engine
    if not engine.state.plan.reduces_as_ready:
        return [torch.zeros((), dtype=torch.float32) if g is None else torch.linalg.vector_norm(g)
                for g in (full_grad(loc) for loc in locs)]
    device = locs[0].unit.device
    sq = torch.zeros(len(locs), dtype=torch.float64, device=device)
    for i, g in enumerate(local_grads(locs)):
        if g is not None:
            sq[i] = torch.linalg.vector_norm(g.to(device), dtype=torch.float64).square()
    if engine.state.shard_world > 1:
        engine.state.comm.all_reduce(sq, engine.state.topo.world, Phase.OTHER)
    return list(sq.sqrt().to(torch.float32).unbind())


def set_grad(loc: Located, value: torch.Tensor, local: bool = False) -> None:
    """Replace the gradient the next step uses (``value`` unscaled; ``local``: this rank's part, stages 2-3)."""
    engine, slot = loc.engine, loc.slot
    scale = 1.0 / engine.grad_unscale  # what the rows hold per unit of the step's gradient
    if not engine.state.plan.reduces_as_ready:
        if local:
            raise ValueError("the local gradient is a ZeRO-3 (and 2) notion; use the full gradient at stages 0-1")
        # each rank's whole gradient becomes the value: the boundary's reduction averages them back to it
        slot.param.grad = (value.detach().reshape(slot.spec.shape) * scale).to(engine.state.policy.compute_dtype)
        return
    part = value.detach().reshape(-1).float() if local else _own_part(loc, value, "set the gradient")
    with engine.state.residency.resident([loc.unit]):
        _write(loc.unit.grad_views()[loc.index], part * scale)


# ---- optimizer state ------------------------------------------------------------------------------------------
def _state(loc: Located, key: str) -> torch.Tensor:
    view = loc.unit.master_views()[loc.index]
    state = loc.engine.master_optimizer.state.get(view, {})
    if key not in state:
        raise KeyError(f"parameter {loc.slot.name!r} has no optimizer state {key!r} (it has {sorted(state)}; the "
                       "state exists after the first optimizer step)")
    return state[key]


def full_optimizer_state(loc: Located, key: str) -> torch.Tensor:
    """The whole optimizer state ``key`` (``exp_avg``...) of the parameter; a scalar (``step``) as it is."""
    loc.engine.join_update()
    with loc.engine.state.residency.resident([loc.unit], dirty=False):
        value = _state(loc, key)
        if value.dim() == 0:
            return value.detach().clone()
        return _full(loc, value)


def local_optimizer_state(loc: Located, key: str) -> torch.Tensor:
    """This rank's part of the optimizer state ``key`` (a scalar as it is)."""
    loc.engine.join_update()
    start, stop = loc.span
    with loc.engine.state.residency.resident([loc.unit], dirty=False):
        value = _state(loc, key)
        return value.detach().clone() if value.dim() == 0 else value[: stop - start].detach().float().clone()


def set_optimizer_state(loc: Located, key: str, value: torch.Tensor, local: bool = False) -> None:
    """Write the optimizer state ``key`` of the parameter (``local``: this rank's part)."""
    loc.engine.join_update()
    with loc.engine.state.residency.resident([loc.unit]):
        target = _state(loc, key)
        if target.dim() == 0:
            with torch.no_grad():
                target.copy_(value.detach().reshape(()))
            return
        part = value.detach().reshape(-1).float() if local else _own_part(loc, value, f"set {key}")
        _write(target, part)


def parameters_of(module: nn.Module) -> list[tuple[str, torch.Tensor, Optional[Located]]]:
    """``(name, parameter, where it lives)`` for each parameter of ``module``."""
    return [(n, p, locate(p)) for n, p in module.named_parameters()]
