"""DeepSpeed's universal checkpoint layout, read and written without DeepSpeed, over zeropp's universal checkpoints
(``zeropp/checkpoint/universal.py``: one whole fp32 value and optimizer state per parameter, any world size).

The layout (DeepSpeed 0.19.8's ``ds_to_universal`` writes it; ``load_universal`` engines read it)::

    save_dir/latest_universal                        text: the name of the folder below
    save_dir/<folder>/mp_rank_00_model_states.pt     read by ZeRO stage 1-2 engines: scheduler, counters, client keys
    save_dir/<folder>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, read by stage 3 engines
    save_dir/<folder>/zero/optimizer_state.pt        the optimizer's groups and global state (loss scaler, clipping)
    save_dir/<folder>/zero/<param>/fp32.pt           {"param": the whole fp32 value, "cat_dim": 0} (stage-3 sources:
                                                     the bare flat tensor)
    save_dir/<folder>/zero/<param>/exp_avg.pt, exp_avg_sq.pt   Adam's moments, as fp32.pt
    save_dir/<folder>/zero/<param>/step.pt           Adam's step, a 0-dim tensor (stage-3 sources keep it in
                                                     optimizer_state.pt's ['optimizer_state_dict']['state'][g])

DeepSpeed's converter copies the source's model-states files, so its output loads only into engines of the stage
that saved it; zeropp writes both model-states files and a ``optimizer_state.pt`` with what stage 1-2 engines read
(``param_groups``, ``clip_grad``, ``ds_version``) and what stage 3 engines read (``optimizer_state_dict``), so its
output loads into DeepSpeed at any stage and world size. Every file is read with ``torch.load(weights_only=True)``
and the stand-ins of Note [reading DeepSpeed's pickles] (``checkpoint_format.py``).

Not supported: tensor or pipeline parallel checkpoints (``mp_rank_01``, sub-parameter patterns), MoE experts.
Vocabulary tensors whose padding rows the converter cut off (``vocab_tensor``) load padded with zeros, as in
DeepSpeed.
"""
from __future__ import annotations

import os
import re
import shutil
from collections import OrderedDict
from typing import Any, Optional

import torch

from zeropp.checkpoint.engine_state import What
from zeropp.checkpoint.format import CheckpointError, atomic_write_text, fsync_dir, rename_into_place
from zeropp.checkpoint.universal import (
    ADAM, ParamValues, Universal, UniversalParam, from_checkpoint, load_universal, schedule_position,
)
from zeropp.checkpoint.universal_format import is_universal_dir, read_universal, write_universal
from zeropp.deepspeed import checkpoint_format as fmt
from zeropp.deepspeed.checkpoint.constants import (
    CAT_DIM, CLIP_GRAD, DS_VERSION, LOSS_SCALER, OPTIMIZER_STATE_DICT, ORIGINAL_VOCAB_SIZE, PARAM, PARAM_GROUPS,
    PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCAB_TENSOR, VOCABULARY_PARAMETER_PATTERNS, ZERO_STAGE,
)
from zeropp.zero.state import EngineHandle

LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
MODEL_STATES_3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_MP = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_ZERO3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_STATES = ("exp_avg", "exp_avg_sq")
_DS_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _error(path: str, what: str, problem: str = "unreadable") -> CheckpointError:
    return CheckpointError(f"{path}: {what}", file=os.path.basename(path), problem=problem)


# ---- where it is ----------------------------------------------------------------------------------------------------
def universal_folder(load_dir: str, tag: Optional[str]) -> str:
    """``load_dir/tag``, or the folder ``load_dir/latest_universal`` names (DeepSpeed's rule for ``load_universal``)."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST_UNIVERSAL)
        if not os.path.isfile(latest):
            raise _error(latest, f"no such file: checkpoint.load_universal is set, so load_checkpoint reads the "
                         f"universal checkpoint {LATEST_UNIVERSAL} names; pass its folder as tag, or write one "
                         "(zeropp to-universal, python -m deepspeed.checkpoint.ds_to_universal)", "missing")
        with open(latest, "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
    folder = os.path.join(load_dir, str(tag))
    if not os.path.isdir(folder):
        raise _error(folder, "no such universal checkpoint folder", "missing")
    return folder


def open_universal(folder: str) -> Universal:
    """The universal checkpoint in ``folder``: zeropp's files (``universal.json``) or DeepSpeed's layout (``zero/``)."""
    if is_universal_dir(folder):
        return read_universal(folder)
    if os.path.isdir(os.path.join(folder, ZERO_DIR)):
        return read_ds_universal(folder)
    hint = ""
    if os.path.isfile(os.path.join(folder, "manifest.json")) or fmt.deepspeed_tag_dir(*os.path.split(folder)):
        hint = ("; it is a regular checkpoint: convert it (zeropp to-universal) or set checkpoint.load_universal "
                "to false to load it as it is")
    raise _error(folder, f"not a universal checkpoint (no universal.json, no {ZERO_DIR}/ directory){hint}", "missing")


def loads_universal(config: Any) -> bool:
    """Whether an engine's config asks ``load_checkpoint`` for universal checkpoints (``checkpoint.load_universal``)."""
    section = getattr(config, "checkpoint", None)
    return bool(getattr(section, "load_universal", False))


def load_universal_checkpoint(engine: EngineHandle, load_dir: str, tag: Optional[str] = None,
                              load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                              load_module_only: bool = False, strict: bool = True) -> tuple[str, Any]:
    """``engine.load_checkpoint`` under ``checkpoint.load_universal``: restore the engine from a universal checkpoint
    (DeepSpeed's layout or zeropp's) on any world size and stage; every rank calls. ``(folder, client_state)``."""
    what = What(load_optimizer_states, load_lr_scheduler_states, load_module_only, strict)
    return load_universal(engine, lambda: open_universal(universal_folder(load_dir, tag)), what)


# ---- reading DeepSpeed's layout -------------------------------------------------------------------------------------
def _model_states(folder: str) -> str:
    """The model-states file a universal load reads (stage 1-2's, else stage 3's rank 0); model parallel refused."""
    names = os.listdir(folder)
    for name in names:
        m = _MP.fullmatch(name) or _ZERO3.fullmatch(name)
        if m is not None and m.groups()[-1] != "00":
            raise _error(os.path.join(folder, name), "a model-parallel rank's file (tensor or pipeline parallelism): "
                         "zeropp loads data-parallel universal checkpoints only", "not supported")
    for name in ("mp_rank_00_model_states.pt", MODEL_STATES_3):
        if name in names:
            return os.path.join(folder, name)
    raise _error(os.path.join(folder, MODEL_STATES_3), "no mp_rank_00_model_states.pt or "
                 f"{MODEL_STATES_3}: not a DeepSpeed universal checkpoint", "missing")


def _dict(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise _error(path, f"holds a {type(value).__name__} where DeepSpeed writes a dict")
    return value


def _group_of_entries(optim: dict, shapes: list, path: str) -> list[int]:
    """The optimizer group of each ``param_shapes`` entry: entries are groups (stage 1-2) or sub-groups of the groups
    that list them (stage 3, ``optimizer_state_dict.param_groups[g]['params']``)."""
    inner = optim.get(OPTIMIZER_STATE_DICT)
    if int(optim.get(ZERO_STAGE, 1)) == 3 and isinstance(inner, dict):
        owner = {s: g for g, grp in enumerate(inner.get(PARAM_GROUPS) or []) for s in grp.get("params", [])}
        if sorted(owner) != list(range(len(shapes))):
            raise _error(path, f"its groups list sub-groups {sorted(owner)}, the model states {len(shapes)}")
        return [owner[s] for s in range(len(shapes))]
    return list(range(len(shapes)))


def _stage3_steps(optim: dict, subs: int) -> dict[int, torch.Tensor]:
    """Adam's step per sub-group where a stage-3 source keeps it (rank 0's optimizer state)."""
    inner = optim.get(OPTIMIZER_STATE_DICT)
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        return {}
    return {s: st["step"] for s, st in state.items() if isinstance(st, dict) and "step" in st and s < subs}


def read_ds_universal(folder: str) -> Universal:
    """Open DeepSpeed's universal layout in ``folder``: its model states and optimizer state now, each parameter's
    files when :attr:`Universal.read` asks for them."""
    folder = os.path.abspath(folder)
    head_path = _model_states(folder)
    head = _dict(fmt.load_file(head_path), head_path)
    opt_path = os.path.join(folder, ZERO_DIR, OPTIMIZER_STATE_FILE)
    if not os.path.isfile(opt_path):
        raise _error(opt_path, "no such file: the universal checkpoint's optimizer state is missing", "missing")
    optim = _dict(fmt.load_file(opt_path), opt_path)
    shapes = head.get(PARAM_SHAPES)
    groups_raw = optim.get(PARAM_GROUPS)
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise _error(head_path, f"no '{PARAM_SHAPES}' list of parameter shapes")
    if not isinstance(groups_raw, list) or not all(isinstance(g, dict) for g in groups_raw):
        raise _error(opt_path, f"no '{PARAM_GROUPS}' list of optimizer groups")
    info = head.get(UNIVERSAL_CHECKPOINT_INFO) or {}
    vocab = info.get(VOCABULARY_PARAMETER_PATTERNS) or []
    owners = _group_of_entries(optim, shapes, opt_path)
    params, steps = [], {}
    sub_steps = _stage3_steps(optim, len(shapes))
    for s, (group, entry) in enumerate(zip(owners, shapes)):
        if group >= len(groups_raw):
            raise _error(opt_path, f"parameters of optimizer group {group}, which it does not describe")
        for name, shape in entry.items():
            trimmed = any(re.match(p, name) for p in vocab) and ORIGINAL_VOCAB_SIZE in info
            shape = (int(info[ORIGINAL_VOCAB_SIZE]), *tuple(shape)[1:]) if trimmed else tuple(int(d) for d in shape)
            held = tuple(k for k in _STATES if os.path.isfile(os.path.join(folder, ZERO_DIR, name, f"{k}.pt")))
            params.append(UniversalParam(name, shape, group, held, trimmed))
            if s in sub_steps:
                steps[name] = sub_steps[s]
    for name, shape in (head.get("frozen_param_shapes") or {}).items():
        params.append(UniversalParam(name, tuple(int(d) for d in shape), None))
    module = _dict(head.get("module"), head_path)
    buffers = set(head.get("buffer_names") or [])
    sched = head.get("lr_scheduler")
    scaler = optim.get(LOSS_SCALER)
    weights = [v for k, v in module.items() if k not in buffers and isinstance(v, torch.Tensor)]
    return Universal(
        path=folder, params=params, read=_ParamReader(folder, head, steps), optimizer=ADAM,
        groups=[{k: v for k, v in g.items() if k != "params"} for g in groups_raw],
        scheduler_steps=schedule_position(sched), scheduler_state=sched if isinstance(sched, dict) else None,
        global_steps=int(head.get("global_steps") or 0),
        loss_scale=float(getattr(scaler, "cur_scale", 1.0)) if scaler is not None else None,
        buffers={k: v for k, v in module.items() if k in buffers}, client_state=_client_state(head),
        aliases=dict(head.get("shared_params") or {}), state_dict_keys=list(module),
        compute_dtype=str(weights[0].dtype).removeprefix("torch.") if weights else None,
        config=head.get("ds_config") if isinstance(head.get("ds_config"), dict) else None,
        world_size=head.get("dp_world_size"))


def _client_state(head: dict) -> dict:
    return {k: v for k, v in head.items() if k not in fmt.DS_KEYS}


class _ParamReader:
    """Reads one parameter's files from ``zero/<name>/`` (a frozen one's from the model states when it has none)."""

    def __init__(self, folder: str, head: dict, steps: dict[str, torch.Tensor]) -> None:
        self.folder, self.head, self.steps = folder, head, steps

    def tensor(self, path: str, p: UniversalParam) -> torch.Tensor:
        if not os.path.isfile(path):
            raise _error(path, f"no such file: parameter {p.name} is incomplete in the universal checkpoint", "missing")
        value = fmt.load_file(path)
        if isinstance(value, dict):
            if PARAM not in value:
                raise _error(path, f"a dict without '{PARAM}' (keys {sorted(map(str, value))[:6]})")
            value = value[PARAM]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise _error(path, f"holds a {type(value).__name__}, not a floating-point tensor")
        if value.numel() != p.numel:
            raise _error(path, f"holds {value.numel()} elements of shape {list(value.shape)}; parameter {p.name} has "
                         f"shape {list(p.shape)} ({p.numel})")
        return value.detach().reshape(p.shape).float()

    def __call__(self, p: UniversalParam, with_state: bool) -> ParamValues:
        where = os.path.join(self.folder, ZERO_DIR, p.name)
        fp32 = os.path.join(where, "fp32.pt")
        if p.group is None and not os.path.isfile(fp32):
            return ParamValues(self.frozen(p))
        values = ParamValues(self.tensor(fp32, p))
        if not with_state or p.group is None or not p.state_keys:
            return values
        for key in _STATES:  # both moments or neither: one alone is a damaged checkpoint
            values.state[key] = self.tensor(os.path.join(where, f"{key}.pt"), p)
        step_path = os.path.join(where, "step.pt")
        step = fmt.load_file(step_path) if os.path.isfile(step_path) else self.steps.get(p.name)
        if step is None:
            raise _error(step_path, f"no such file, and no step of parameter {p.name} in {OPTIMIZER_STATE_FILE}",
                         "missing")
        if not (isinstance(step, (int, float)) or (isinstance(step, torch.Tensor) and step.numel() == 1)):
            raise _error(step_path, f"holds a {type(step).__name__}, not Adam's step")
        values.state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return values

    def frozen(self, p: UniversalParam) -> torch.Tensor:
        """A frozen parameter the converter left out of ``zero/`` (stage 3): its pieces in every rank's model states."""
        fragments = self.head.get("frozen_param_fragments") or {}
        if p.name in fragments and fragments[p.name].numel() >= p.numel:  # stage 1-2: whole in the one file
            return fragments[p.name].reshape(-1)[: p.numel].float().view(p.shape)
        pieces = []
        for r in range(int(self.head.get("dp_world_size") or 1)):
            path = os.path.join(self.folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
            if not os.path.isfile(path):
                raise _error(path, f"no such file: it holds rank {r}'s piece of frozen parameter {p.name}", "missing")
            piece = (_dict(fmt.load_file(path), path).get("frozen_param_fragments") or {}).get(p.name)
            if not isinstance(piece, torch.Tensor):
                raise _error(path, f"no piece of frozen parameter {p.name}")
            pieces.append(piece.reshape(-1))
        flat = torch.cat(pieces)
        if flat.numel() < p.numel:
            raise _error(self.folder, f"frozen parameter {p.name}'s pieces hold {flat.numel()} of {p.numel} elements")
        return flat[: p.numel].float().view(p.shape)


# ---- writing DeepSpeed's layout ------------------------------------------------------------------------------------
def write_ds_universal(uc: Universal, out_folder: str, write_latest: bool = True) -> str:
    """Write ``uc`` in DeepSpeed's universal layout into ``out_folder`` (replaced whole if it exists) and, with
    ``write_latest``, name it in ``<parent>/latest_universal``; returns ``out_folder``. DeepSpeed loads it into an
    engine of any ZeRO stage and world size (``"checkpoint": {"load_universal": true}``)."""
    out_folder = os.path.abspath(out_folder)
    parent, name = os.path.split(out_folder)
    nonce = os.urandom(6).hex()
    tmp, aside = os.path.join(parent, f".{name}.tmp-{nonce}"), os.path.join(parent, f".{name}.old-{nonce}")
    os.makedirs(os.path.join(tmp, ZERO_DIR))
    try:  # written aside, then renamed into place: the folder is the old checkpoint or the whole new one
        steps = _write_params(uc, os.path.join(tmp, ZERO_DIR))
        fmt.save_file(_optimizer_state(uc, steps), os.path.join(tmp, ZERO_DIR, OPTIMIZER_STATE_FILE))
        for file, placeholders in (("mp_rank_00_model_states.pt", False), (MODEL_STATES_3, True)):
            fmt.save_file(_model_states_tree(uc, placeholders), os.path.join(tmp, file))
        fsync_dir(tmp)
        rename_into_place(tmp, out_folder, aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    if write_latest:
        write_latest_universal(out_folder)
    fsync_dir(parent)
    return out_folder


def write_latest_universal(folder: str) -> None:
    """Name ``folder`` in its parent's ``latest_universal`` (written aside and renamed, as zeropp writes ``latest``)."""
    parent, name = os.path.split(os.path.abspath(folder))
    atomic_write_text(os.path.join(parent, LATEST_UNIVERSAL), name)


def _write_params(uc: Universal, zero: str) -> dict[int, float]:
    """Each parameter's files; returns each optimizer group's step (DeepSpeed keeps one per group)."""
    steps: dict[int, set[float]] = {}
    for p in uc.params:
        if "/" in p.name or p.name in (".", "..", ""):
            raise CheckpointError(f"parameter name {p.name!r} cannot be a directory of DeepSpeed's universal layout")
        values = uc.read(p, True)
        where = os.path.join(zero, p.name)
        os.makedirs(where)
        extra = {VOCAB_TENSOR: True} if p.rows_trimmed else {}
        fmt.save_file({PARAM: values.fp32.detach().float().contiguous().clone(), CAT_DIM: 0, **extra},
                      os.path.join(where, "fp32.pt"))
        if p.group is None or not p.state_keys:
            continue
        if set(p.state_keys) != set(_STATES):
            raise CheckpointError(f"{uc.path}: parameter {p.name} has optimizer states {list(p.state_keys)}; "
                                  f"DeepSpeed's universal layout holds Adam's {list(_STATES)}")
        for key in _STATES:
            fmt.save_file({PARAM: values.state[key].detach().float().contiguous().clone(), CAT_DIM: 0, **extra},
                          os.path.join(where, f"{key}.pt"))
        step = values.state.get("step")
        if step is not None:
            fmt.save_file(torch.tensor(float(step), dtype=torch.float32), os.path.join(where, "step.pt"))
            steps.setdefault(p.group, set()).add(float(step))
    out = {}
    for g, values_ in steps.items():
        if len(values_) > 1:
            raise CheckpointError(f"{uc.path}: the parameters of optimizer group {g} have different Adam steps "
                                  f"{sorted(values_)}; DeepSpeed keeps one per group")
        out[g] = values_.pop()
    return out


def _source_stage(uc: Universal) -> int:
    stage = ((uc.config or {}).get("zero_optimization") or {}).get("stage")
    return int(stage) if isinstance(stage, int) and 0 <= stage <= 3 else 3


def _optimizer_state(uc: Universal, steps: dict[int, float]) -> dict:
    """What stage 1-2 engines read (``param_groups``, ``clip_grad``, ``ds_version``, the loss scaler) and what stage 3
    engines read (``optimizer_state_dict``: one sub-group per group, its step)."""
    groups = [dict(g, params=[i]) for i, g in enumerate(uc.groups)]
    # a group none of whose parameters was ever stepped has no step of its own: Adam's count is the optimizer's steps
    state = {g: {"step": torch.tensor(steps.get(g, float(uc.global_steps)), dtype=torch.float32)}
             for g in range(len(groups))}
    return {
        LOSS_SCALER: fmt.LossScaler(float(uc.loss_scale or 1.0)), "dynamic_loss_scale": False, "overflow": False,
        CLIP_GRAD: float((uc.config or {}).get("gradient_clipping") or 0.0),
        ZERO_STAGE: fmt.ZeroStageEnum(_source_stage(uc)), "partition_count": int(uc.world_size or 1),
        DS_VERSION: fmt.DS_VERSION, PARAM_GROUPS: groups,
        OPTIMIZER_STATE_DICT: {"state": state, "param_groups": [dict(g) for g in groups]},
    }


def _model_states_tree(uc: Universal, placeholders: bool) -> dict:
    """A model-states file as DeepSpeed writes it: whole weights in the compute dtype (stage 1-2) or empty
    placeholders (stage 3), the buffers, shapes per group, the schedule, counters, config and client keys."""
    dtype = getattr(torch, uc.compute_dtype or "float32", torch.float32)
    by_name = {p.name: p for p in uc.params}
    module: OrderedDict = OrderedDict()
    for key in uc.state_dict_keys or [*(p.name for p in uc.params), *uc.buffers]:
        p = uc.param(key)
        if p is not None and key not in uc.buffers:
            module[key] = torch.empty(0, dtype=dtype) if placeholders else uc.read(p, False).fp32.to(dtype)
        elif key in uc.buffers:
            module[key] = uc.buffers[key]
    trained = [p for p in uc.params if p.group is not None]
    frozen = [p for p in uc.params if p.group is None]
    state = {
        "module": module, "buffer_names": [k for k in module if k in uc.buffers], "optimizer": None,
        PARAM_SHAPES: [OrderedDict((p.name, torch.Size(p.shape)) for p in trained if p.group == g)
                       for g in range(len(uc.groups))],
        "frozen_param_shapes": OrderedDict((p.name, torch.Size(p.shape)) for p in frozen),
        "shared_params": {a: n for a, n in uc.aliases.items() if n in by_name},
        "frozen_param_fragments": OrderedDict((p.name, uc.read(p, False).fp32.to(dtype)) for p in frozen),
        "lr_scheduler": _ds_schedule(uc), "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
        "global_steps": int(uc.global_steps), "global_samples": int(uc.global_steps) * _train_batch(uc),
        "dp_world_size": int(uc.world_size or 1), "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _ds_config(uc), "ds_version": fmt.DS_VERSION,
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE},
    }
    client = uc.client_state
    if client is not None and not isinstance(client, dict):
        raise CheckpointError(f"{uc.path}: the client state is a {type(client).__name__}; DeepSpeed merges a dict of "
                              "client keys into its model-states files")
    clash = sorted(set(client or {}) & set(fmt.DS_KEYS))
    if clash:
        raise CheckpointError(f"{uc.path}: client state keys {clash} are DeepSpeed's own")
    state.update(client or {})
    return state


def _ds_schedule(uc: Universal) -> Optional[dict]:
    """DeepSpeed's schedules keep their last iteration; a client's torch schedule its own state dict."""
    kind = ((uc.config or {}).get("scheduler") or {}).get("type")
    if uc.scheduler_steps is not None and (kind in _DS_SCHEDULES or uc.scheduler_state is None
                                           or "last_batch_iteration" in uc.scheduler_state):
        return {"last_batch_iteration": int(uc.scheduler_steps) - 1}
    return uc.scheduler_state


def _train_batch(uc: Universal) -> int:
    cfg = uc.config or {}
    if cfg.get("train_batch_size"):
        return int(cfg["train_batch_size"])
    micro = cfg.get("train_micro_batch_size_per_gpu") or 1
    return int(micro) * int(cfg.get("gradient_accumulation_steps") or 1) * int(uc.world_size or 1)


def _ds_config(uc: Universal) -> dict:
    """The DeepSpeed keys of the saving run's config, for the files' ``ds_config``."""
    cfg, out = uc.config or {}, {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "optimizer", "scheduler"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    for key in ("bf16", "fp16"):
        if (cfg.get(key) or {}).get("enabled"):
            out[key] = {"enabled": True}
    out["zero_optimization"] = {"stage": _source_stage(uc)}
    return out


# ---- from DeepSpeed's ZeRO checkpoints -----------------------------------------------------------------------------
def from_deepspeed_zero(tag_dir: str) -> Universal:
    """The universal view of a DeepSpeed ZeRO checkpoint's tag directory (``checkpoint_format.read``, read whole)."""
    ds = fmt.read(tag_dir)
    params = []
    for g, names in enumerate(ds.groups):
        for n in names:
            params.append(UniversalParam(n, tuple(ds.shapes[n]), g, _STATES if n in ds.moments else ()))
    params += [UniversalParam(n, tuple(t.shape), None) for n, t in ds.frozen.items()]

    def read(p: UniversalParam, with_state: bool) -> ParamValues:
        if p.group is None:
            return ParamValues(ds.frozen[p.name])
        state = {}
        if with_state and p.state_keys:
            state = {k: ds.moments[p.name][k] for k in _STATES}
            state["step"] = torch.tensor(float(ds.steps[p.name]), dtype=torch.float32)
        return ParamValues(ds.params[p.name], state)

    cfg = ds.ds_config if isinstance(ds.ds_config, dict) else None
    dtype = "bfloat16" if ds.bf16 else "float16" if ((cfg or {}).get("fp16") or {}).get("enabled") else "float32"
    return Universal(
        path=tag_dir, params=params, read=read, groups=[dict(h) for h in ds.hyper], optimizer=ADAM,
        scheduler_steps=schedule_position(ds.scheduler),
        scheduler_state=ds.scheduler if isinstance(ds.scheduler, dict) else None,
        global_steps=int(ds.counters.get("global_steps", 0)),
        loss_scale=float(ds.loss_scale.get("cur_scale", 1.0)) if ds.loss_scale else None,
        buffers=dict(ds.buffers), client_state=dict(ds.client_state), aliases=dict(ds.shared),
        state_dict_keys=list(ds.module_keys), compute_dtype=dtype, config=cfg, world_size=ds.world)


def open_source(src: str, tag: Optional[str] = None, drop_unsupported: bool = False) -> Universal:
    """A checkpoint to convert: zeropp's or DeepSpeed's ZeRO checkpoint, given as its save directory (with ``tag``,
    or what its ``latest`` names) or as the tag directory itself."""
    src = os.path.abspath(src)
    if os.path.isfile(os.path.join(src, "manifest.json")):  # a zeropp tag directory
        return from_checkpoint(os.path.dirname(src), os.path.basename(src), drop_unsupported)
    ds_tag = fmt.deepspeed_tag_dir(src, tag)
    if ds_tag is None and tag is None and any(n.endswith("_optim_states.pt") for n in _listdir(src)):
        ds_tag = src  # DeepSpeed's tag directory (ds_to_universal's --input_folder)
    if ds_tag is not None:
        return from_deepspeed_zero(ds_tag)
    return from_checkpoint(src, tag, drop_unsupported)


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def to_universal(src: str, out_folder: str, tag: Optional[str] = None, layout: str = "deepspeed",
                 drop_unsupported: bool = False) -> str:
    """Convert checkpoint ``src`` (zeropp's or DeepSpeed's ZeRO checkpoint) into a universal one in ``out_folder``:
    DeepSpeed's layout (``layout="deepspeed"``, named in ``<parent>/latest_universal``) or zeropp's files
    (``"zeropp"``). Returns ``out_folder``. Needs no process group."""
    if layout not in ("deepspeed", "zeropp"):
        raise ValueError(f"to-universal: layout must be 'deepspeed' or 'zeropp', got {layout!r}")
    uc = open_source(src, tag, drop_unsupported)
    if layout == "zeropp":
        out = write_universal(uc, out_folder)
        write_latest_universal(out)
        return out
    return write_ds_universal(uc, out_folder)
