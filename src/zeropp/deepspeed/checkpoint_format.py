"""DeepSpeed's ZeRO checkpoint format (0.19.8), read and written without DeepSpeed: the one place that knows it.

Layout (``save_dir/latest`` names the tag)::

    global_stepN/mp_rank_00_model_states.pt                       stage 1-2: weights, shapes, scheduler, counters
    global_stepN/zero_pp_rank_R_mp_rank_00_model_states.pt        stage 3: the same per rank, weights empty
    global_stepN/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt one per rank: fp32 partitions, Adam's moments

Note [reading DeepSpeed's pickles]: DeepSpeed's files are pickles. They are read with
``torch.load(weights_only=True)``, which runs no code and builds only tensors and plain data, plus an allowlist
of the three DeepSpeed classes its optimizer files hold: ``LossScaler`` (and fp16's ``DynamicLossScaler``),
``ZeroStageEnum`` and ``fragment_address``. They are registered under DeepSpeed's names as the stand-ins below,
so DeepSpeed need not be installed and nothing of it is imported; any other global is refused by torch and the
error names the file. Writing (an export) pickles the same stand-ins under the same names, through a pickler
that writes their global references by name (:class:`_DeepSpeedPickler`), so DeepSpeed finds its own classes.

Flat layouts (``tests/data/deepspeed/README.md`` has them at length, proved on DeepSpeed's own files):

* stage 1-2: per parameter group, the parameters back to back (each followed by its alignment padding) form N
  elements, zero-padded to a multiple of 2W and cut into W partitions; a rank's fp32 partition is stored without
  its tail padding, Adam's moments with it;
* stage 3: each parameter is cut on its own, ``ceil(n / W)`` elements per rank (the padding of the fp32
  master is garbage), and a rank's pieces lie back to back in its sub-groups' flat tensors; Adam's state is
  the torch optimizer's, one entry per sub-group laid out the same way.
"""
from __future__ import annotations

import enum
import glob
import io
import math
import os
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zeropp.checkpoint.format import CheckpointError

DS_VERSION = "0.19.8"
MODEL_STATES_12 = "mp_rank_00_model_states.pt"
_MODEL_STATES_3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
#: the model-states keys DeepSpeed writes itself; the others are the client state it merged in
DS_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
           "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
           "ds_version")


# ---- stand-ins for the classes DeepSpeed pickles (Note [reading DeepSpeed's pickles]) --------------------------
class LossScaler:
    """DeepSpeed's static loss scaler as its checkpoints hold it (``cur_scale``, ``dynamic``)."""

    def __init__(self, cur_scale: float = 1.0) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic (fp16) loss scaler as its checkpoints hold it: its attributes, as pickled."""


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's ZeRO stage enum (an ``int``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's class name, under which its files pickle it
    """Where a parameter lies in a stage 1-2 partition."""

    numel: int
    start: int


_STAND_INS = {
    LossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    DynamicLossScaler: ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ZeroStageEnum: ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    fragment_address: ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


def load_file(path: str) -> Any:
    """One DeepSpeed ``.pt`` file, read as data (``weights_only`` plus the stand-ins); errors name the file."""
    allowed = [(cls, f"{module}.{name}") for cls, (module, name) in _STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = next((ln for ln in str(err).splitlines() if "Unsupported global" in ln), str(err).splitlines()[0])
        raise CheckpointError(f"{path}: not loaded, it holds objects beyond DeepSpeed's checkpoint format "
                              f"[{first.strip()}]", file=os.path.basename(path), problem="unreadable") from err
    except Exception as err:  # a torn zip, an I/O error
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {err}", file=os.path.basename(path),
                              problem="unreadable") from err


class _DeepSpeedPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """The pure-Python pickler, writing the stand-ins' global references under DeepSpeed's names."""

    def save_global(self, obj: Any, name: Optional[str] = None) -> None:
        where = _STAND_INS.get(obj)
        if where is None:
            return super().save_global(obj, name)
        module, qualname = where
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


class _PickleModule:
    """What ``torch.save(pickle_module=...)`` needs: a ``Pickler`` (and ``Unpickler``, unused)."""

    Pickler = _DeepSpeedPickler
    Unpickler = pickle.Unpickler


def save_file(obj: Any, path: str) -> None:
    """``torch.save`` as DeepSpeed writes its files (protocol 2), the stand-ins under DeepSpeed's names."""
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_PickleModule, pickle_protocol=2)  # type: ignore[arg-type]
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


# ---- layout ---------------------------------------------------------------------------------------------------
def deepspeed_tag_dir(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag directory of a DeepSpeed checkpoint in ``load_dir`` (``tag``, or what ``latest`` names), or None
    when ``load_dir`` does not hold one."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest, "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
    tag_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(tag_dir) or os.path.exists(os.path.join(tag_dir, "manifest.json")):
        return None
    return tag_dir if glob.glob(os.path.join(tag_dir, "*_optim_states.pt")) else None


@dataclass
class Files:
    """The files of one DeepSpeed tag, by rank."""

    model_states: list[str]  # one (stage 1-2) or one per rank (stage 3)
    optim_states: list[str]  # one per rank
    bf16: bool


def list_files(tag_dir: str) -> Files:
    names = sorted(os.listdir(tag_dir))
    optim: dict[int, str] = {}
    bf16 = False
    for name in names:
        m = _OPTIM.fullmatch(name)
        if m is None:
            continue
        if m.group(3) != "00":
            raise CheckpointError(f"{tag_dir}: {name} belongs to model-parallel rank {m.group(3)}; zeropp imports "
                                  "data-parallel checkpoints only (mp_rank_00)", file=name, problem="not supported")
        optim[int(m.group(2))] = os.path.join(tag_dir, name)
        bf16 = bf16 or m.group(1) is not None
    if not optim or sorted(optim) != list(range(len(optim))):
        raise CheckpointError(f"{tag_dir}: the optimizer files are not one per rank 0..W-1: {sorted(optim)}",
                              problem="missing")
    stage3 = {int(m.group(1)): os.path.join(tag_dir, n) for n in names if (m := _MODEL_STATES_3.fullmatch(n))}
    if stage3:
        if sorted(stage3) != sorted(optim):
            raise CheckpointError(f"{tag_dir}: model-states files for ranks {sorted(stage3)}, optimizer files for "
                                  f"{sorted(optim)}", problem="missing")
        model = [stage3[r] for r in sorted(stage3)]
    elif MODEL_STATES_12 in names:
        model = [os.path.join(tag_dir, MODEL_STATES_12)]
    else:
        raise CheckpointError(f"{tag_dir}: no {MODEL_STATES_12} or zero_pp_rank_R_mp_rank_00_model_states.pt",
                              file=MODEL_STATES_12, problem="missing")
    return Files(model, [optim[r] for r in sorted(optim)], bf16)


# ---- reading ----------------------------------------------------------------------------------------------------
@dataclass
class DsState:
    """A DeepSpeed ZeRO checkpoint as full tensors, in DeepSpeed's parameter order."""

    tag_dir: str
    stage: int
    world: int
    bf16: bool
    groups: list[list[str]]  # trainable parameter names per optimizer group, in flat order
    shapes: dict[str, torch.Size]
    params: dict[str, torch.Tensor]  # fp32 masters, full
    moments: dict[str, dict[str, torch.Tensor]]  # exp_avg, exp_avg_sq per parameter, full
    steps: dict[str, float]
    hyper: list[dict]  # each group's optimizer settings (lr, betas, ...), without "params"
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # tied alias -> the parameter holding the data
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    scheduler: Optional[dict] = None
    counters: dict[str, int] = field(default_factory=dict)  # global_steps, global_samples, skipped_steps
    client_state: dict = field(default_factory=dict)
    loss_scale: Optional[dict] = None  # the loss scaler's attributes
    ds_config: Any = None
    module_keys: list[str] = field(default_factory=list)  # the model's state-dict keys, in the files' order


def read(tag_dir: str) -> DsState:
    """Read every file of a DeepSpeed tag into full tensors (each rank of an import reads them all)."""
    files = list_files(tag_dir)
    models = [load_file(p) for p in files.model_states]
    optims = [load_file(p) for p in files.optim_states]
    head = _dict(models[0], files.model_states[0])
    inner = [_dict(_dict(o, p).get("optimizer_state_dict"), p) for o, p in zip(optims, files.optim_states)]
    if "zero_stage" not in inner[0]:
        raise CheckpointError(f"{files.optim_states[0]}: no 'zero_stage': a ZeRO stage 1 checkpoint in bf16 "
                              "(DeepSpeed's BF16_Optimizer) or not a ZeRO checkpoint; not supported yet",
                              problem="not supported")
    stage = int(inner[0]["zero_stage"])
    if (head.get("mp_world_size") or 1) != 1:
        raise CheckpointError(f"{files.model_states[0]}: mp_world_size {head['mp_world_size']}: model parallelism "
                              "is not supported by zeropp", problem="not supported")
    shapes_by_group = [OrderedDict(g) for g in head["param_shapes"]]
    groups = [list(g) for g in shapes_by_group]
    shapes = {n: torch.Size(s) for g in shapes_by_group for n, s in g.items()}
    reader = _read_stage3 if stage == 3 else _read_stage12
    params, moments, steps, hyper = reader(groups, shapes, inner, files)
    state = DsState(tag_dir, stage, len(optims), files.bf16, groups, shapes, params, moments, steps, hyper)
    state.frozen = _frozen(head, models, stage)
    state.shared = dict(head.get("shared_params") or {})
    names = set(head.get("buffer_names") or [])
    state.buffers = {k: v for k, v in head["module"].items() if k in names}
    state.scheduler = head.get("lr_scheduler")
    state.counters = {k: int(head.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
    state.client_state = {k: v for k, v in head.items() if k not in DS_KEYS}
    scaler = inner[0].get("loss_scaler")
    state.loss_scale = dict(vars(scaler)) if scaler is not None else None
    state.ds_config = head.get("ds_config")
    state.module_keys = list(head["module"])
    return state


def _dict(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a {type(value).__name__} where DeepSpeed writes a dict",
                              file=os.path.basename(path), problem="unreadable")
    return value


def _numel(shape: torch.Size) -> int:
    return math.prod(shape)


def _adam_state(state: dict, where: str) -> dict:
    missing = [k for k in ("exp_avg", "exp_avg_sq", "step") if k not in state]
    if missing:
        raise CheckpointError(f"{where}: optimizer state without {missing} (keys {sorted(state)}): not Adam's; "
                              "zeropp imports DeepSpeed checkpoints of Adam and AdamW", problem="not supported")
    return state


def _read_stage12(groups: list[list[str]], shapes: dict, inner: list[dict], files: Files) -> tuple:
    params: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, float] = {}
    base = [i["base_optimizer_state"] for i in inner]
    if not isinstance(base[0], dict):
        raise CheckpointError(f"{files.optim_states[0]}: saved with elastic_checkpoint; not supported yet",
                              problem="not supported")
    for g, names in enumerate(groups):
        fp32 = torch.cat([i["single_partition_of_fp32_groups"][g].reshape(-1) for i in inner])
        state = [_adam_state(b["state"][g], f"{p} group {g}") for b, p in zip(base, files.optim_states)]
        exp_avg = torch.cat([s["exp_avg"].reshape(-1) for s in state])
        exp_avg_sq = torch.cat([s["exp_avg_sq"].reshape(-1) for s in state])
        pads = inner[0]["param_alignment_paddings"][g]
        offset = 0
        for name, pad in zip(names, pads):
            n = _numel(shapes[name])
            params[name] = fp32[offset:offset + n].view(shapes[name]).clone()
            moments[name] = {"exp_avg": exp_avg[offset:offset + n].view(shapes[name]).clone(),
                             "exp_avg_sq": exp_avg_sq[offset:offset + n].view(shapes[name]).clone()}
            steps[name] = float(state[0]["step"])
            offset += n + int(pad)
        if offset != fp32.numel():
            raise CheckpointError(f"{files.optim_states[0]}: group {g}'s parameters cover {offset} elements, its fp32 "
                                  f"partitions {fp32.numel()}", problem="unreadable")
    hyper = [{k: v for k, v in grp.items() if k != "params"} for grp in base[0]["param_groups"]]
    return params, moments, steps, hyper


def _read_stage3(groups: list[list[str]], shapes: dict, inner: list[dict], files: Files) -> tuple:
    world = len(inner)
    flats = [torch.cat([t.reshape(-1) for t in i["fp32_flat_groups"]]) for i in inner]
    opt = [i["optimizer_state_dict"] for i in inner]
    subs = len(inner[0]["fp32_flat_groups"])
    state = [[_adam_state(o["state"][s], f"{p} sub-group {s}") for s in range(subs)]
             for o, p in zip(opt, files.optim_states)]
    exp_avg = [torch.cat([s["exp_avg"].reshape(-1) for s in st]) for st in state]
    exp_avg_sq = [torch.cat([s["exp_avg_sq"].reshape(-1) for s in st]) for st in state]
    sub_of_group = {s: k for k, grp in enumerate(opt[0]["param_groups"]) for s in grp["params"]}
    params, moments, steps = {}, {}, {}
    offset = 0
    ends = _sub_group_ends(inner[0]["fp32_flat_groups"])
    for names in groups:
        for name in names:
            n = _numel(shapes[name])
            c = -(-n // world)

            def whole(rows: list[torch.Tensor]) -> torch.Tensor:
                return torch.cat([r[offset:offset + c] for r in rows])[:n].view(shapes[name]).clone()
            params[name] = whole(flats)
            moments[name] = {"exp_avg": whole(exp_avg), "exp_avg_sq": whole(exp_avg_sq)}
            steps[name] = float(state[0][_sub_at(ends, offset)]["step"])
            offset += c
    if offset != flats[0].numel():
        raise CheckpointError(f"{files.optim_states[0]}: the parameters cover {offset} elements per rank, the flat "
                              f"groups {flats[0].numel()}", problem="unreadable")
    hyper = [{k: v for k, v in grp.items() if k != "params"} for grp in opt[0]["param_groups"]]
    if len(hyper) != len(groups) or sorted(sub_of_group) != list(range(subs)):
        raise CheckpointError(f"{files.optim_states[0]}: {len(hyper)} optimizer groups for {len(groups)} groups of "
                              "parameters", problem="unreadable")
    return params, moments, steps, hyper


def _sub_group_ends(flat_groups: list[torch.Tensor]) -> list[int]:
    ends, acc = [], 0
    for t in flat_groups:
        acc += t.numel()
        ends.append(acc)
    return ends


def _sub_at(ends: list[int], offset: int) -> int:
    return next(i for i, e in enumerate(ends) if offset < e)


def _frozen(head: dict, models: list[dict], stage: int) -> dict[str, torch.Tensor]:
    shapes = head.get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        n = _numel(torch.Size(shape))
        if stage == 3:  # each rank's own piece
            out[name] = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])[:n]
        else:
            out[name] = head["frozen_param_fragments"][name].reshape(-1)[:n]
        out[name] = out[name].float().view(torch.Size(shape)).clone()
    return out
