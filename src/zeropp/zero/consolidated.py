"""Full weights in and out of a sharded engine: the fp32 state dict gathered from the master shards on every
rank, and the reverse, each master shard cut from a full state dict (``engine.consolidated_state_dict()`` and
``engine.load_consolidated_state_dict()`` delegate here)."""
from __future__ import annotations

import torch

from zeropp.comm.ledger import Phase
from zeropp.zero.state import EngineHandle


def consolidated_state_dict(engine: EngineHandle) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (``model.state_dict()``'s keys) on every rank, gathered from the masters."""
    engine.join_update()
    state = engine.state
    full: dict[int, torch.Tensor] = {}
    world = state.topo.world
    for u in state.units:
        rows = torch.empty(world.size, u.row.numel, dtype=torch.float32, device=u.device)
        with state.residency.resident([u], dirty=False):
            state.comm.all_gather(rows, u.master.to(u.device), world, Phase.OTHER)
        for slot, off, c in zip(u.slots, u.row.offsets, u.row.chunks):
            flat = rows[:, off : off + c].reshape(-1)[: slot.spec.numel]
            full[id(slot.param)] = flat.view(slot.spec.shape).clone()
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in full:
            out[name] = full[id(t)]
        else:
            out[name] = t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
    return out


def load_consolidated_state_dict(engine: EngineHandle, weights: dict[str, torch.Tensor]) -> None:
    """Overwrite the master weights (and 16-bit shards) from a full state dict; stale copies are dropped.

    Every entry is checked before anything is written, so a bad state dict leaves the engine unchanged.
    """
    engine.join_update()
    state = engine.state
    names = {id(t): n for n, t in engine.module.state_dict(keep_vars=True).items()}
    sources = {}
    for u in state.units:
        for slot in u.slots:
            name = names[id(slot.param)]
            if name not in weights:
                raise KeyError(f"state dict has no entry for parameter {name}")
            src = weights[name].detach().reshape(-1).float()
            if src.numel() != slot.spec.numel:
                raise ValueError(f"{name}: expected {slot.spec.numel} elements, got {src.numel()}")
            if not torch.isfinite(src).all():
                raise ValueError(f"{name}: the state dict holds inf or nan")
            sources[id(slot.param)] = src
    with torch.no_grad():
        for u in state.units:
            with state.residency.resident([u]):
                for slot, view in zip(u.slots, u.master_views()):
                    start, stop = slot.spec.owned(u.rank)  # u.rank: 0 in stage 0's group of one
                    view.zero_()
                    view[: stop - start].copy_(sources[id(slot.param)][start:stop])
    engine.masters_changed()
