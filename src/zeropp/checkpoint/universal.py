"""Universal checkpoints: a training state with no parallel layout in it, which loads on any world size and stage.

A universal checkpoint holds every parameter whole: its fp32 value and its per-element optimizer states (Adam's
``exp_avg`` and ``exp_avg_sq``, shaped like the parameter) plus its step, and beside them what is not per parameter:
each optimizer group's settings, the schedule's position, the global step, the buffers and the client state. Nothing
in it depends on how many ranks saved it or how they cut it, so any engine takes its own chunks from it
(Note [universal checkpoints]). :class:`Universal` is that state as a reader over some files; zeropp's own files for it
are in ``universal_format.py`` (``zeropp to-universal --format zeropp``), DeepSpeed's layout
(``zero/<param>/fp32.pt`` ...) in ``zeropp/deepspeed/checkpoint/``; both give a :class:`Universal`, and
:func:`load_universal` restores an engine from either.

Note [universal checkpoints]: what the format keeps is what a change of layout cannot break: whole fp32 values and
whole optimizer states, each read once per rank and cut to the rank's chunk (Note [shard layout]), one parameter at a
time, so a rank holds one whole parameter beside its own chunks. What it does not keep is per rank or per layout: the
RNG states, LoCo's kept errors, partly accumulated gradients (a universal checkpoint is taken at an accumulation
boundary), and int8 frozen rows (their dequantized values are the fp32 value; a load quantizes them again). The
schedule travels as its position (how many times it stepped), so an engine resumes its own configured schedule
there, as DeepSpeed's do; a schedule without a closed form (a client's torch scheduler) travels as its state dict.

Like every checkpoint load, reading and checking happen inside one agreement of all ranks (Note [one outcome for
all ranks]): a missing file, a wrong shape or a damaged file raises on every rank, naming it, before the engine
changes.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from zeropp.checkpoint.collective import agree
from zeropp.checkpoint.consolidate import FullCheckpoint, load_full_checkpoint
from zeropp.checkpoint.engine_state import Loaded, Param, What, apply_loaded, engine_buffers, engine_params
from zeropp.checkpoint.fit import check_buffers
from zeropp.checkpoint.format import CheckpointError, CheckpointWarning
from zeropp.zero.state import EngineHandle

#: optimizers whose state is Adam's (``exp_avg``, ``exp_avg_sq``, ``step``); the universal name of that layout
ADAM = "adam"
_ADAM_CLASSES = ("Adam", "AdamW", "CpuAdam", "UncorrectedAdam")


def optimizer_layout(class_name: Optional[str]) -> Optional[str]:
    """The state layout an optimizer class keeps: :data:`ADAM` for torch's Adam family and zeropp's, else its name."""
    if class_name is None:
        return None
    return ADAM if class_name in _ADAM_CLASSES else class_name


@dataclass(frozen=True)
class UniversalParam:
    """One parameter of a universal checkpoint.

    ``group`` is its optimizer group (None: frozen, no optimizer state); ``state_keys`` the per-element states it
    holds beside its fp32 value (empty when it was never stepped). ``rows_trimmed``: its padding rows were cut off
    (DeepSpeed's vocabulary tensors), so a model whose first dimension is larger takes it padded with zeros.
    """

    name: str
    shape: tuple[int, ...]
    group: Optional[int]
    state_keys: tuple[str, ...] = ()
    rows_trimmed: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ParamValues:
    """A parameter read whole: its fp32 value and its optimizer states (per-element ones shaped like the value,
    scalars such as ``step`` as 0-dim tensors)."""

    fp32: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Universal:
    """A universal checkpoint, as a reader over its files (Note [universal checkpoints]).

    ``read(param, with_state)`` reads one parameter whole; everything else is held here. ``groups``: each optimizer
    group's settings (lr, betas, eps, weight decay, ...), without its parameters. ``optimizer``: the state layout
    (:data:`ADAM`), None when it holds no optimizer state. ``scheduler_steps``: how many times the lr schedule
    stepped (torch's ``last_epoch``), None without a schedule; ``scheduler_state`` a schedule's own state dict, when
    it has no closed form. ``state_dict_keys``: the model's state-dict keys in order (a tied weight under each of
    its names), with ``aliases`` mapping each other name of a parameter to its own.
    """

    path: str
    params: list[UniversalParam]
    read: Callable[[UniversalParam, bool], ParamValues]
    groups: list[dict] = field(default_factory=list)
    optimizer: Optional[str] = ADAM
    scheduler_steps: Optional[int] = None
    scheduler_state: Optional[dict] = None
    global_steps: int = 0
    loss_scale: Optional[float] = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    client_state: Any = None
    aliases: dict[str, str] = field(default_factory=dict)
    state_dict_keys: list[str] = field(default_factory=list)
    compute_dtype: Optional[str] = None  # "float32", "bfloat16", "float16": the weights' dtype in the saving run
    config: Optional[dict] = None  # the saving run's config (DeepSpeed's keys), when known
    world_size: Optional[int] = None  # the saving run's world size, for the record

    def param(self, name: str) -> Optional[UniversalParam]:
        """The parameter called ``name`` or holding it as a tied alias, or None."""
        by_name = self.__dict__.setdefault("_by_name", {p.name: p for p in self.params})
        return by_name.get(name) or by_name.get(self.aliases.get(name, ""))


# ---- from a zeropp checkpoint ---------------------------------------------------------------------------------------
def from_checkpoint(ckpt_dir: str, tag: Optional[str] = None, drop_unsupported: bool = False) -> Universal:
    """The universal view of zeropp checkpoint ``ckpt_dir`` (tag ``tag``, default ``latest``), read whole.

    A checkpoint saved between accumulation boundaries is refused (the format keeps no gradients); LoCo's kept errors
    are refused unless ``drop_unsupported`` (then error feedback starts from zero where it loads, with a warning).
    """
    full = load_full_checkpoint(ckpt_dir, tag, with_optimizer=True)
    _refuse_unsupported(full, drop_unsupported)
    m, rank0 = full.manifest, full.rank0
    groups_raw = rank0.get("optimizer_param_groups") or []
    group_of = {i: g for g, grp in enumerate(groups_raw) for i in grp.get("params", [])}
    params, values = [], {}
    for p in m.params:
        state = full.optimizer.get(p.name, {})
        per_element = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape
                            and v.dim() > 0)
        group = group_of.get(p.optimizer_index) if p.optimizer_index is not None else None
        params.append(UniversalParam(p.name, tuple(p.shape), group, per_element if group is not None else ()))
        key = p.aliases[0] if p.aliases else p.name
        values[p.name] = ParamValues(full.state_dict[key].reshape(p.shape),
                                     {k: _as_tensor(v) for k, v in state.items()} if group is not None else {})
    engine = m.raw["engine"]
    sched = rank0.get("scheduler")
    return Universal(
        path=m.tag_dir, params=params, read=lambda p, with_state: _values_of(values[p.name], with_state),
        groups=[{k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in groups_raw],
        optimizer=optimizer_layout(engine.get("optimizer")),
        scheduler_steps=schedule_position(sched),
        scheduler_state=sched if isinstance(sched, dict) else None,
        global_steps=int(engine["global_steps"]),
        loss_scale=float((rank0.get("loss_scaler") or {}).get("scale", 1.0)) if rank0.get("loss_scaler") else None,
        buffers=dict(rank0.get("buffers") or {}),
        client_state=full.client_state,
        aliases={a: p.name for p in m.params for a in p.aliases if a != p.name},
        state_dict_keys=[e["key"] for e in m.state_dict_keys],
        compute_dtype=engine.get("compute_dtype"), config=m.raw.get("config"), world_size=m.world_size)


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float32)


def _values_of(values: ParamValues, with_state: bool) -> ParamValues:
    return values if with_state else ParamValues(values.fp32)


def _refuse_unsupported(full: FullCheckpoint, drop: bool) -> None:
    engine = full.manifest.raw["engine"]
    if engine.get("micro_steps", 0) % max(1, engine.get("gradient_accumulation_steps", 1)):
        raise CheckpointError(f"{full.manifest.tag_dir}: saved between gradient accumulation boundaries; a universal "
                              "checkpoint holds no partly accumulated gradients: save at a boundary")
    if "loco" in ((full.rank0.get("reduce_state") or {}).get("state") or {}):
        if not drop:
            raise CheckpointError(f"{full.manifest.tag_dir}: a universal checkpoint cannot hold LoCo's kept "
                                  "quantization errors (zeropp_loco_param); drop them (drop_unsupported=True, "
                                  "--drop-unsupported) and error feedback starts from zero where it loads")
        warnings.warn(f"{full.manifest.tag_dir}: dropped LoCo's kept errors", CheckpointWarning, stacklevel=3)


# ---- into an engine -----------------------------------------------------------------------------------------------
def load_universal(engine: EngineHandle, open_source: Callable[[], Universal], what: What = What()) -> tuple[str, Any]:
    """Restore ``engine`` from the universal checkpoint ``open_source()`` opens; every rank calls, on any world
    size and stage. Returns ``(path, client_state)``.

    Opening, reading and every check run on each rank before anything of the engine changes, and end in one
    agreement (Note [one outcome for all ranks]), so an error raises on every rank. The masters, Adam's moments and
    step, the groups' settings, the schedule's position, the global step, the buffers and the client state come back
    (``what`` selects as for a zeropp checkpoint); RNG states stay as they are (Note [universal checkpoints]).
    ``what.strict=False`` keeps the model's own values of frozen parameters the checkpoint lacks and ignores
    parameters the model lacks.
    """
    engine.join_update()
    with engine.state.residency.resident(engine.state.units):  # NVMe: in memory while loading, written back after
        params = engine_params(engine)
        loaded: Optional[Loaded] = None
        loading: list[Param] = []
        path = "the universal checkpoint"
        error: Optional[BaseException] = None
        try:
            source = open_source()
            path = source.path
            loading, loaded = _to_loaded(engine, params, source, what)
        except CheckpointError as err:
            error = err
        except Exception as err:  # noqa: BLE001 - reported to every rank by agree
            error = CheckpointError(f"loading universal checkpoint {path}: {type(err).__name__}: {err}")
        agree(engine, error, "loading the universal checkpoint", lambda name: os.path.join(path, name))
        assert loaded is not None
        apply_loaded(engine, loading, loaded, what)
    return path, loaded.client_state


def _match(params: list[Param], uc: Universal, strict: bool) -> tuple[list[Param], dict[str, UniversalParam]]:
    """The engine parameters the checkpoint holds and, by engine name, the entry holding each; mismatches raise."""
    out: dict[str, UniversalParam] = {}
    missing = []
    for p in params:
        entry = next((e for n in (p.name, *p.aliases) if (e := uc.param(n)) is not None), None)
        if entry is None:
            missing.append(p)
            continue
        if not _fits(entry, p.shape):
            raise CheckpointError(f"{uc.path}: parameter {entry.name} has shape {list(entry.shape)} in the universal "
                                  f"checkpoint, {list(p.shape)} in the model")
        out[p.name] = entry
    trains = [p.name for p in missing if p.optimizer_index is not None]
    if trains or (missing and strict):
        raise CheckpointError(f"{uc.path}: the universal checkpoint lacks the model's parameters "
                              f"{(trains or [p.name for p in missing])[:10]}" +
                              ("" if trains else "; load it non-strict (load_module_strict=False) to keep the "
                               "model's own values of these frozen parameters"))
    extra = sorted({e.name for e in uc.params} - {e.name for e in out.values()})
    if extra and strict:
        raise CheckpointError(f"{uc.path}: the universal checkpoint holds parameters the model lacks {extra[:10]}")
    return [p for p in params if p.name in out], out


def _fits(entry: UniversalParam, shape: tuple[int, ...]) -> bool:
    if tuple(entry.shape) == tuple(shape):
        return True
    return (entry.rows_trimmed and len(shape) == len(entry.shape) and len(shape) > 0 and shape[0] >= entry.shape[0]
            and tuple(shape[1:]) == tuple(entry.shape[1:]))


def _chunk(full: torch.Tensor, p: Param, entry: UniversalParam, start: int, path: str, what: str) -> torch.Tensor:
    """Elements ``[start, start + chunk)`` of ``full`` laid out as ``p``: zeros past its end (Note [shard layout]),
    which for a tensor whose padding rows were trimmed are those rows (row-major: they come last)."""
    if tuple(full.shape) != tuple(entry.shape):
        raise CheckpointError(f"{path}: {what} of parameter {entry.name} has shape {list(full.shape)}, the "
                              f"checkpoint records {list(entry.shape)}")
    flat = full.reshape(-1).float()
    out = torch.zeros(p.chunk, dtype=torch.float32)
    lo, hi = min(start, flat.numel()), min(start + p.chunk, flat.numel())
    out[: hi - lo] = flat[lo:hi]
    return out


def _to_loaded(engine: EngineHandle, params: list[Param], uc: Universal, what: What) -> tuple[list[Param], Loaded]:
    loading, entries = _match(params, uc, what.strict)
    with_optimizer = what.optimizer and not what.module_only
    kind = optimizer_layout(type(engine.master_optimizer).__name__)
    stateful = any(e.state_keys for e in entries.values())
    if with_optimizer and stateful and uc.optimizer is not None and uc.optimizer != kind:
        raise CheckpointError(f"{uc.path}: the universal checkpoint holds {uc.optimizer} optimizer state, the engine's "
                              f"optimizer is {type(engine.master_optimizer).__name__}: configure one that keeps it, or "
                              "load the weights alone (load_optimizer_states=False)")
    start = engine.state.topo.rank if engine.state.plan.shards_optimizer else 0  # stage 0 holds it whole
    masters, state = {}, {}
    for p in loading:
        entry = entries[p.name]
        values = uc.read(entry, with_optimizer and p.optimizer_index is not None)
        masters[p.name] = _chunk(values.fp32, p, entry, start * p.chunk, uc.path, "the fp32 value")
        if with_optimizer and p.optimizer_index is not None and entry.state_keys:
            state[p.optimizer_index] = _optimizer_state(values, entry, p, start * p.chunk, uc.path)
    optimizer: dict = {"state": state, "param_groups": engine.master_optimizer.state_dict()["param_groups"]}
    if with_optimizer:
        _apply_group_settings(optimizer["param_groups"], loading, entries, uc)
    buffers = dict(uc.buffers)
    check_buffers(buffers, uc.path, engine_buffers(engine))
    gas = engine.state.policy.gradient_accumulation_steps
    counters = {"micro_steps": uc.global_steps * gas, "global_steps": uc.global_steps}
    scaler = None
    if engine.loss_scaler is not None:
        scaler = engine.loss_scaler.state_dict()
        if uc.loss_scale is not None:
            scaler["scale"] = float(uc.loss_scale)
    sched = _scheduler(engine, uc) if what.scheduler and not what.module_only else None
    return loading, Loaded(masters, None, optimizer, sched, counters, None, buffers, uc.client_state, scaler)


def _optimizer_state(values: ParamValues, entry: UniversalParam, p: Param, start: int, path: str) -> dict:
    out = {}
    for key in entry.state_keys:
        if key not in values.state:
            raise CheckpointError(f"{path}: parameter {entry.name} has no optimizer state {key!r}")
        out[key] = _chunk(values.state[key], p, entry, start, path, f"optimizer state {key!r}")
    for key, value in values.state.items():
        if key not in out:
            if value.dim() != 0:
                raise CheckpointError(f"{path}: optimizer state {key!r} of parameter {entry.name} has shape "
                                      f"{list(value.shape)}, neither a scalar nor shaped like the parameter")
            out[key] = value.detach().clone().float()
    return out


def _apply_group_settings(groups: list[dict], loading: list[Param], entries: dict[str, UniversalParam],
                          uc: Universal) -> None:
    """Each engine group takes the settings of the checkpoint group its parameters came from."""
    by_index = {p.optimizer_index: entries[p.name] for p in loading if p.optimizer_index is not None}
    for i, group in enumerate(groups):
        theirs = {by_index[j].group for j in group["params"] if j in by_index and by_index[j].group is not None}
        if len(theirs) > 1:
            raise CheckpointError(f"{uc.path}: optimizer group {i} of the engine holds parameters of the checkpoint's "
                                  f"groups {sorted(theirs)}; build the optimizer with the checkpoint's groups")
        if theirs:
            g = theirs.pop()
            if g >= len(uc.groups):
                raise CheckpointError(f"{uc.path}: parameters of optimizer group {g}, which the checkpoint does not "
                                      f"describe ({len(uc.groups)} groups)")
            group.update({k: v for k, v in uc.groups[g].items() if k in group and k not in ("params", "initial_lr")})


def schedule_position(state: Any) -> Optional[int]:
    """How many times a schedule stepped, from its state dict: zeropp's schedules keep their last iteration
    (``last_batch_iteration``, -1 before the first step), torch's schedulers ``last_epoch``; None for neither."""
    if not isinstance(state, dict):
        return None
    if "last_batch_iteration" in state:
        return int(state["last_batch_iteration"]) + 1
    if "last_epoch" in state:
        return int(state["last_epoch"])
    return None


def _scheduler(engine: EngineHandle, uc: Universal) -> Optional[dict]:
    """The engine's own schedule moved to the checkpoint's position (a schedule that keeps its last iteration, or
    one with a closed form ``lr_at``), or a client schedule's state dict as saved."""
    sched = engine.lr_scheduler
    if sched is None or (uc.scheduler_steps is None and uc.scheduler_state is None):
        return None
    n = uc.scheduler_steps
    own = sched.state_dict() if hasattr(sched, "state_dict") else {}
    if n is not None and "last_batch_iteration" in own:
        return {**own, "last_batch_iteration": int(n) - 1}
    if n is not None and hasattr(sched, "lr_at"):
        return {**own, "last_epoch": int(n), "_step_count": int(n) + 1, "_last_lr": sched.lr_at(int(n) - 1)}
    if uc.scheduler_state is not None and set(uc.scheduler_state) == set(own):
        return uc.scheduler_state
    raise CheckpointError(f"{uc.path}: the universal checkpoint's schedule (position {n}) does not map onto the "
                          f"engine's {type(sched).__name__}; use the config's scheduler section, or load without the "
                          "schedule (load_lr_scheduler_states=False)")
