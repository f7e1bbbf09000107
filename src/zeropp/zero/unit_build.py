"""Building the engine's units (:func:`build_units`): each gather unit's parameters cut into shards with the
values every rank agrees on (Note [one model at initialize] in ``zero/values.py``), a meta-device model
materialized unit by unit, frozen parameters apart at stage 3 (Note [frozen units] in ``partition/unit.py``), and
at initialize under hpZ the secondary copies cut (:func:`cut_copies`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from zeropp.comm.ledger import Phase
from zeropp.partition import listeners
from zeropp.partition.assign import is_leaf, plan_units
from zeropp.partition.meta import MetaMaterializer
from zeropp.partition.unit import FrozenUnit, Unit, UnitState
from zeropp.zero import idle_watch
from zeropp.zero.construction import PARAMS
from zeropp.zero.gathers import Gathers
from zeropp.zero.state import EngineState
from zeropp.zero.values import Plan, UnitValues, agreed_rng


class Built(NamedTuple):
    units: list[Unit]
    modules: list[tuple[Unit, nn.Module, bool]]  # each unit, the module it belongs to, and whether a leaf's
    trainable: Optional[set[int]]  # the caller's trainable ids, meta parameters mapped to their replacements


def build_units(state: EngineState, module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]],
                trainable: Optional[set[int]]) -> Built:
    """Cut every unit's parameters into shards, with the values every rank agrees on (Note [one model at
    initialize] in ``zero/values.py``); a meta-device model is materialized unit by unit."""
    plan, policy = state.plan, state.policy
    shard_rank = state.topo.rank if plan.shards_optimizer else 0
    plans = plan_units(module, policy.gather_granularity)
    agreed = Plan.agree(state.comm, module, MetaMaterializer.needed(module), policy.broadcast_rank0)
    meta = None
    if agreed.meta_init or agreed.meta_alloc:
        largest = max((sum(p.numel() for _, p in plan_.params) for plan_ in plans), default=0)
        meta = MetaMaterializer(module, param_init_fn, init=agreed.meta_init, rebuild_limit=largest)
    values = UnitValues(state.comm, agreed)
    units: list[Unit] = []
    modules: list[tuple[Unit, nn.Module, bool]] = []
    with agreed_rng(state.comm) if agreed.meta_init else contextlib.nullcontext():
        for unit_plan in plans:
            if meta is not None:
                unit_plan = meta.realize(unit_plan)
            for params, frozen in _split_frozen(state, unit_plan.params):
                chunks = values.chunks(unit_plan.module_name, params, state.shard_world, shard_rank)
                for _, p in params:
                    PARAMS.adopt(p)  # the unit owns it from here
                unit = _make_unit(state, len(units), unit_plan.module_name, params, frozen, shard_rank, chunks)
                if plan.shards_weights:
                    for _, p in params:
                        listeners.partitioned(p)
                state.residency.adopt(unit)
                modules.append((unit, unit_plan.module, is_leaf(unit_plan.module)))  # Note [partly used units]
                units.append(unit)
        if meta is not None:
            meta.finish()
    values.finish(module)
    if not len(PARAMS):
        idle_watch.unwatch(PARAMS)  # nothing partitioned at construction is left unadopted
    if meta is not None and trainable is not None:
        trainable = {id(meta.replaced[pid]) if pid in meta.replaced else pid for pid in trainable}
    return Built(units, modules, trainable)


def _split_frozen(state: EngineState, params: list[tuple[str, nn.Parameter]]) -> list[tuple[list, bool]]:
    """One module's parameters as ``(params, frozen)`` unit contents: in stage 3 the trainable and the
    frozen ones apart (Note [frozen units]), else all of them in one unit. Under NVMe optimizer offload
    every unit keeps a gradient record in the swap files, so units stay whole there."""
    apart = state.plan.shards_weights and not state.residency.swaps_states
    if state.strategies.frozen_units is None and not apart:
        return [(params, False)]
    trainable = [(n, p) for n, p in params if p.requires_grad]
    frozen = [(n, p) for n, p in params if not p.requires_grad]
    return [(part, part is frozen) for part in (trainable, frozen) if part]


def _make_unit(state: EngineState, index: int, module_name: str, params: list[tuple[str, nn.Parameter]],
               frozen: bool, shard_rank: int, chunks: Optional[list[Optional[torch.Tensor]]] = None) -> Unit:
    policy, residency, link = state.policy, state.residency, state.link
    if frozen and state.strategies.frozen_units is not None:
        return state.strategies.frozen_units.make_unit(index, module_name, params, state.shard_world, shard_rank,
                                                       policy.compute_dtype, chunks)
    # A delayed update writes the masters while the next forward gathers the shard, and NVMe moves
    # shards and masters separately: never alias them then. Masters on NVMe: keep a 16-bit shard to
    # rebuild resident weights from (stages 1-2). A frozen unit is never stepped: no upload to stage.
    swaps = residency.swaps_shards or residency.swaps_states
    kind = FrozenUnit if frozen else Unit
    return kind(index, module_name, params, state.shard_world, shard_rank, policy.compute_dtype,
                keep_shard=state.plan.shards_weights or residency.swaps_states,
                alias_fp32_shard=policy.delayed_update_after is None and not swaps,
                host_masters=policy.offload_optimizer, host_shard=policy.offload_param,
                host_zeros=link.host_zeros, staged_copy_back=link.distinct and not frozen,
                chunks=chunks)


def cut_copies(state: EngineState, gathers: Gathers) -> None:
    """Note [hpZ slices at initialize] in ``plus/hpz.py``: gather each unit once through the forward strategy
    and release it, one unit at a time, so that the copies its release keeps exist from the start."""
    gather = state.strategies.forward_gather
    for unit in state.units:
        if unit.state is UnitState.SHARDED and state.residency.shard_in(unit):
            gathers.land(unit, gather.start(unit, Phase.OTHER))
            gather.on_release(unit)
            unit.release()
    gather.check_deferred()


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point buffers in the compute dtype, as its weights are."""
    for buf_owner in module.modules():
        for name, buf in buf_owner.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(buf_owner, name, buf.to(dtype))
