"""What a checkpoint reads and writes of an engine, shared by zeropp's format (``engine_io.py``) and DeepSpeed's
(``zeropp/deepspeed/checkpoint_io.py``): each parameter as this rank holds it (:class:`Param`), everything a load will write
(:class:`Loaded`, checked before anything is written), writing it into the engine (:func:`apply_loaded`), and
the random states as data.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from zeropp.zero.state import EngineHandle


@dataclass
class Param:
    """One parameter as the engine holds it on this rank."""

    name: str
    aliases: list[str]
    shape: tuple[int, ...]
    numel: int
    unit: int
    chunk: int
    master: torch.Tensor  # this rank's fp32 master chunk (a fixed view the optimizer steps)
    grad: torch.Tensor
    optimizer_index: Optional[int]


def engine_params(engine: EngineHandle, writing: bool = True) -> list[Param]:
    """The engine's parameters; ``writing=False`` (a save) reads a frozen int8 unit's values as copies, where
    a load gets the views it writes and ``masters_changed`` re-quantizes (``plus/frozen.py``)."""
    opt_index = {id(t): i for i, t in enumerate(p for g in engine.master_optimizer.param_groups for p in g["params"])}
    aliases: dict[int, list[str]] = {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), []).append(key)
    out = []
    for u in engine.state.units:
        masters = u.master_views() if writing else u.master_values()
        for slot, master, grad in zip(u.slots, masters, u.grad_views()):
            out.append(Param(slot.name, aliases.get(id(slot.param), [slot.name]), tuple(slot.spec.shape),
                              slot.spec.numel, u.index, slot.spec.chunk, master, grad, opt_index.get(id(master))))
    return out

def engine_buffers(engine: EngineHandle) -> dict[str, torch.Tensor]:
    """State-dict entries that are not sharded parameters (buffers), as this rank holds them."""
    params = {id(s.param) for u in engine.state.units for s in u.slots}
    return {k: t for k, t in engine.module.state_dict(keep_vars=True).items() if id(t) not in params}

@dataclass
class Loaded:
    """Everything a rank will write into the engine, read and checked before anything is written."""

    masters: dict[str, torch.Tensor]
    grads: Optional[dict[str, torch.Tensor]]
    optimizer: dict
    scheduler: Optional[dict]
    counters: dict
    rng: Optional[dict]
    buffers: dict[str, torch.Tensor]
    client_state: Any
    loss_scaler: Optional[dict] = None  # fp16 only
    reduce_state: Optional[dict] = None  # as saved, then the reduce strategy's state for this topology
    frozen_rows: Optional[dict] = None  # same world: the int8 rows of frozen units, by unit index

def apply_loaded(engine: EngineHandle, params: list[Param], loaded: Loaded, what: "What") -> None:
    with torch.no_grad():
        for p in params:
            p.master.copy_(loaded.masters[p.name])
            if loaded.grads is not None and not what.module_only:
                p.grad.copy_(loaded.grads[p.name])
            else:
                p.grad.zero_()
        live = engine_buffers(engine)
        for key, value in loaded.buffers.items():
            if key in live:
                live[key].copy_(value)
    engine.masters_changed()  # recast 16-bit shards, drop hpZ slices, rebuild resident weights (stages 1-2)
    for u in engine.state.units:  # same world: the saved int8 bytes themselves, not a re-quantization of their values
        row = (loaded.frozen_rows or {}).get(str(u.index))
        held = u.quantized_state()
        if held is not None and isinstance(row, torch.Tensor) and row.shape == held.shape and row.dtype == held.dtype:
            u.load_quantized_state(row)
    if what.module_only:
        return
    if loaded.loss_scaler is not None and engine.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(loaded.loss_scaler)
    if loaded.reduce_state is not None:
        engine.state.strategies.reduce.load_state_dict(loaded.reduce_state)
    if what.optimizer:
        engine.master_optimizer.load_state_dict(loaded.optimizer)
    if what.scheduler and loaded.scheduler is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(loaded.scheduler)
    engine.micro_steps = int(loaded.counters["micro_steps"])
    engine.global_steps = int(loaded.counters["global_steps"])
    if loaded.rng is not None:
        set_rng_state(loaded.rng)


@dataclass(frozen=True)
class What:
    """Which parts of a checkpoint to restore (DeepSpeed's ``load_*`` switches)."""

    optimizer: bool = True
    scheduler: bool = True
    module_only: bool = False
    strict: bool = True  # False: a checkpoint saved without its frozen parameters loads, keeping the model's

def rng_as_data(rng: dict) -> dict:
    """Random states as tensors and plain numbers (Note [data, not code] in ``safe_io.py``): Python's and NumPy's
    state tuples (a NumPy array among them) become dicts of tensors; a state already in that form is kept."""
    out = dict(rng)
    py, nump = rng.get("python"), rng.get("numpy")
    if isinstance(py, tuple):
        version, mt, gauss = py
        out["python"] = {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss}
    if isinstance(nump, tuple):
        kind, keys, pos, has_gauss, cached = nump
        out["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return out


def rng_state() -> dict:
    """This rank's random states (CPU, CUDA, Python, NumPy), as data."""
    out: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state_all()
    return rng_as_data(out)


def set_rng_state(rng: dict) -> None:
    """Restore what :func:`rng_state` saved (or a format-2 shard's tuples)."""
    torch.set_rng_state(rng["torch_cpu"])
    py, nump = rng["python"], rng["numpy"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"])
    random.setstate(py)
    if isinstance(nump, dict):
        nump = (nump["kind"], nump["keys"].numpy().astype(np.uint32), nump["pos"], nump["has_gauss"],
                nump["cached_gaussian"])
    np.random.set_state(nump)
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["torch_cuda"])
