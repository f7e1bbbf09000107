"""DeepSpeed ZeRO checkpoints into a zeropp engine (``engine.load_checkpoint(ds_dir)``), and zeropp checkpoints out
to DeepSpeed's stage-3 layout (``zeropp export-deepspeed``). What the files hold is ``checkpoint_format.py``'s
concern; this module maps it onto zeropp's state and back.

Import, on any world size: every rank reads the DeepSpeed files into full tensors and takes its chunk of each
fp32 master and of Adam's ``exp_avg``/``exp_avg_sq``; Adam's step, the groups' settings (lr, betas, eps, weight
decay), the scheduler's position (DeepSpeed's ``last_batch_iteration``), the global step, the buffers and the
client state (the model-states keys that are not DeepSpeed's) come with them. Parameters are matched by name
(tied aliases through DeepSpeed's ``shared_params``); one the checkpoint lacks, one the model lacks, another
shape, or an optimizer other than Adam is an error that names it, on every rank, before the engine changes.

Export writes, for a data-parallel world of N ranks, exactly the files DeepSpeed 0.19.8 writes for ZeRO-3, with
their keys, dtypes and shapes, and nothing of zeropp's own. What DeepSpeed's format cannot hold is refused by
name (``drop_unsupported`` drops it with a warning): LoCo's kept errors, frozen weights kept as int8 (exported
as their dequantized values), an hpZ setting, a checkpoint saved between accumulation boundaries.
"""
from __future__ import annotations

import os
import shutil
import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch

from zeropp.deepspeed import checkpoint_format as fmt
from zeropp.checkpoint.collective import agree
from zeropp.checkpoint.consolidate import FullCheckpoint, load_full_checkpoint
from zeropp.checkpoint.engine_state import Loaded, Param, What, apply_loaded, engine_params
from zeropp.checkpoint.format import CheckpointError, fsync_dir
from zeropp.zero.engine import ZeroEngine

_ADAM = ("AdamW", "Adam", "CpuAdam", "UncorrectedAdam")


# ---- import ---------------------------------------------------------------------------------------------------
def load_deepspeed(engine: ZeroEngine, tag_dir: str, optimizer: bool = True, scheduler: bool = True,
                   module_only: bool = False) -> tuple[str, Any]:
    """Restore ``engine`` from the DeepSpeed tag ``tag_dir``; every rank calls. ``(tag_dir, client_state)``."""
    engine.join_update()
    with engine.residency.resident(engine.units):  # NVMe: in memory while loading, written back after
        return _load(engine, tag_dir, What(optimizer, scheduler, module_only))


def _load(engine: ZeroEngine, tag_dir: str, what: What) -> tuple[str, Any]:
    params = engine_params(engine)
    loaded: Optional[Loaded] = None
    error: Optional[BaseException] = None
    try:
        loaded = _to_loaded(engine, params, fmt.read(tag_dir), what)
    except CheckpointError as err:
        error = err
    except Exception as err:  # noqa: BLE001 - reported to every rank by agree
        error = CheckpointError(f"importing DeepSpeed checkpoint {tag_dir}: {type(err).__name__}: {err}")
    agree(engine, error, "importing the DeepSpeed checkpoint", lambda name: os.path.join(tag_dir, name))
    assert loaded is not None
    apply_loaded(engine, params, loaded, what)
    return tag_dir, loaded.client_state


def _match(params: list[Param], ds: fmt.DsState) -> dict[str, str]:
    """zeropp parameter name -> the DeepSpeed name holding its values; every mismatch raises, naming it."""
    held = {**ds.params, **ds.frozen}
    out, missing = {}, []
    for p in params:
        names = [p.name, *p.aliases]
        key = next((n for n in names if n in held), None)
        if key is None:
            key = next((ds.shared[n] for n in names if ds.shared.get(n) in held), None)
        if key is None:
            missing.append(p.name)
            continue
        if tuple(held[key].shape) != tuple(p.shape):
            raise CheckpointError(f"{ds.tag_dir}: parameter {key!r} has shape {list(held[key].shape)} in the DeepSpeed "
                                  f"checkpoint, {list(p.shape)} in the model")
        out[p.name] = key
    extra = sorted(set(held) - set(out.values()))
    if missing or extra:
        raise CheckpointError(f"{ds.tag_dir}: the DeepSpeed checkpoint does not fit the model: parameters missing "
                              f"from it {missing[:10]}, parameters the model lacks {extra[:10]}")
    return out


def _chunk(full: torch.Tensor, p: Param, rank: int) -> torch.Tensor:
    out = torch.zeros(p.chunk, dtype=torch.float32)
    flat = full.reshape(-1).float()
    start = min(rank * p.chunk, p.numel)
    stop = min(start + p.chunk, p.numel)
    out[: stop - start] = flat[start:stop]
    return out


def _to_loaded(engine: ZeroEngine, params: list[Param], ds: fmt.DsState, what: What) -> Loaded:
    rank = engine.topo.rank
    names = _match(params, ds)
    held = {**ds.params, **ds.frozen}
    masters = {p.name: _chunk(held[names[p.name]], p, rank) for p in params}
    optimizer: dict = {"state": {}, "param_groups": engine.master_optimizer.state_dict()["param_groups"]}
    if what.optimizer and not what.module_only:
        optimizer = _optimizer(engine, params, names, ds, rank)
    gas = engine.policy.gradient_accumulation_steps
    counters = {"micro_steps": ds.counters["global_steps"] * gas, "global_steps": ds.counters["global_steps"]}
    scaler = None
    if engine.loss_scaler is not None:
        scaler = engine.loss_scaler.state_dict()
        if ds.loss_scale is not None:
            scaler["scale"] = float(ds.loss_scale.get("cur_scale", scaler["scale"]))
    return Loaded(masters, None, optimizer, _scheduler(engine, ds), counters, None, dict(ds.buffers),
                   ds.client_state, scaler)


def _optimizer(engine: ZeroEngine, params: list[Param], names: dict[str, str], ds: fmt.DsState,
               rank: int) -> dict:
    kind = type(engine.master_optimizer).__name__
    if kind not in _ADAM:
        raise CheckpointError(f"{ds.tag_dir}: the DeepSpeed checkpoint holds Adam's state (exp_avg, exp_avg_sq); the "
                              f"engine's optimizer is {kind}: configure Adam or AdamW to import it")
    group_of = {n: k for k, group in enumerate(ds.groups) for n in group}
    state: dict = {}
    for p in params:
        key = names[p.name]
        if p.optimizer_index is None or key not in ds.moments:
            continue
        m = ds.moments[key]
        state[p.optimizer_index] = {"step": torch.tensor(ds.steps[key], dtype=torch.float32),
                                    "exp_avg": _chunk(m["exp_avg"], p, rank),
                                    "exp_avg_sq": _chunk(m["exp_avg_sq"], p, rank)}
    groups = engine.master_optimizer.state_dict()["param_groups"]
    by_index = {p.optimizer_index: names[p.name] for p in params if p.optimizer_index is not None}
    for i, group in enumerate(groups):
        theirs = {group_of[by_index[j]] for j in group["params"] if by_index[j] in group_of}
        if len(theirs) > 1:
            raise CheckpointError(f"{ds.tag_dir}: optimizer group {i} of the engine holds parameters of DeepSpeed's "
                                  f"groups {sorted(theirs)}; build the optimizer with DeepSpeed's groups")
        if theirs:
            settings = ds.hyper[theirs.pop()]
            group.update({k: v for k, v in settings.items() if k in group and k != "initial_lr"})
    return {"state": state, "param_groups": groups}


def _scheduler(engine: ZeroEngine, ds: fmt.DsState) -> Optional[dict]:
    """DeepSpeed's ``last_batch_iteration`` as the engine's scheduler state (zeropp's DeepSpeed schedules)."""
    sched = engine.lr_scheduler
    if sched is None or ds.scheduler is None:
        return None
    if "last_batch_iteration" not in sched.state_dict() or "last_batch_iteration" not in ds.scheduler:
        raise CheckpointError(f"{ds.tag_dir}: DeepSpeed's scheduler state {sorted(ds.scheduler)} does not map onto "
                              f"the engine's {type(sched).__name__}; use one of DeepSpeed's schedules")
    return {"last_batch_iteration": int(ds.scheduler["last_batch_iteration"])}


# ---- export -----------------------------------------------------------------------------------------------------
def export_deepspeed(src: str, dst: str, world_size: int, tag: Optional[str] = None,
                     drop_unsupported: bool = False) -> str:
    """Write zeropp checkpoint ``src`` (tag ``tag``, default ``latest``) as a DeepSpeed ZeRO-3 checkpoint for a
    data-parallel world of ``world_size`` ranks into ``dst``; returns the tag directory written."""
    if world_size < 1:
        raise ValueError(f"export-deepspeed: world size must be >= 1, got {world_size}")
    full = load_full_checkpoint(src, tag, with_optimizer=True)
    _refuse_unsupported(full, drop_unsupported)
    plan = _ExportPlan(full, world_size)
    out_tag = f"global_step{plan.global_steps}"
    tmp = os.path.join(dst, f".{out_tag}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    prefix = "bf16_" if plan.bf16 else ""
    for r in range(world_size):
        fmt.save_file(plan.model_states(r), os.path.join(tmp, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        fmt.save_file(plan.optim_states(r), os.path.join(tmp, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    final = os.path.join(dst, out_tag)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(os.path.join(dst, "latest"), "w") as f:
        f.write(out_tag)
    fsync_dir(dst)
    return final


def _refuse_unsupported(full: FullCheckpoint, drop: bool) -> None:
    rank0, m = full.rank0, full.manifest.raw
    found = []
    if "loco" in ((rank0.get("reduce_state") or {}).get("state") or {}):
        found.append("LoCo's kept quantization errors (zeropp_loco_param)")
    if rank0.get("frozen_rows"):
        found.append("frozen weights kept as int8 (zero_quantized_nontrainable_weights; their dequantized values "
                     "are exported)")
    if int(m["topology"].get("hpz_partition_size", 1)) > 1:
        found.append(f"hpZ (zero_hpz_partition_size {m['topology']['hpz_partition_size']})")
    if found and not drop:
        raise CheckpointError(f"export-deepspeed: DeepSpeed's format cannot hold {'; '.join(found)}; pass "
                              "--drop-unsupported (drop_unsupported=True) to export without them")
    for item in found:
        warnings.warn(f"export-deepspeed: dropped {item}", stacklevel=3)
    engine = m["engine"]
    if engine.get("optimizer") not in _ADAM:
        raise CheckpointError(f"export-deepspeed: the checkpoint's optimizer is {engine.get('optimizer')}; "
                              "DeepSpeed's ZeRO-3 export holds Adam's state only")
    if engine.get("compute_dtype") == "float16":
        raise CheckpointError("export-deepspeed: fp16 checkpoints (a dynamic loss scaler) are not supported yet")
    if engine.get("micro_steps", 0) % max(1, engine.get("gradient_accumulation_steps", 1)):
        raise CheckpointError("export-deepspeed: the checkpoint was saved between gradient accumulation boundaries; "
                              "DeepSpeed's format holds no partly accumulated gradients")


class _ExportPlan:
    """The DeepSpeed files of a zeropp checkpoint, rank by rank (Note [reading DeepSpeed's pickles] for pickling)."""

    def __init__(self, full: FullCheckpoint, world: int) -> None:
        self.full, self.world = full, world
        m = full.manifest.raw
        self.bf16 = m["engine"]["compute_dtype"] == "bfloat16"
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.global_steps = int(m["engine"]["global_steps"])
        by_index = {p.optimizer_index: p.name for p in full.manifest.params if p.optimizer_index is not None}
        order = [e["param"] for e in full.manifest.state_dict_keys if "param" in e]
        rank = {n: i for i, n in reversed(list(enumerate(order)))}  # first occurrence: the model's order
        self.groups = [sorted((by_index[i] for i in g["params"]), key=rank.__getitem__)
                       for g in full.rank0["optimizer_param_groups"]]
        self.hyper = [{k: v for k, v in g.items() if k not in ("params", "initial_lr")}
                      for g in full.rank0["optimizer_param_groups"]]
        trained = {n for g in self.groups for n in g}
        self.frozen = [n for n in dict.fromkeys(order) if n not in trained]
        self.params = {p.name: full.state_dict[p.aliases[0] if p.aliases else p.name] for p in full.manifest.params}
        self.shapes = {p.name: torch.Size(p.shape) for p in full.manifest.params}
        cfg = m.get("config") or {}
        self.sub_group_size = int((cfg.get("zero_optimization") or {}).get("sub_group_size", 1e9) or 1e9)
        self.config = _ds_config(cfg)

    def _piece(self, t: torch.Tensor, r: int) -> torch.Tensor:
        c = -(-t.numel() // self.world)
        flat = torch.zeros(c * self.world, dtype=torch.float32)
        flat[: t.numel()] = t.reshape(-1).float()
        return flat[r * c:(r + 1) * c]

    def sub_groups(self) -> list[tuple[int, list[str]]]:
        """(group index, parameter names) per DeepSpeed sub-group (stage3.py's rule over per-rank sizes)."""
        out = []
        for k, names in enumerate(self.groups):
            sizes = [-(-self.shapes[n].numel() // self.world) for n in names]
            if sum(sizes) <= self.sub_group_size:
                out.append((k, names))
                continue
            current, acc = [], 0
            for n, c in zip(names, sizes):
                current.append(n)
                acc += c
                if acc >= self.sub_group_size or n == names[-1]:
                    out.append((k, current))
                    current, acc = [], 0
        return out

    def model_states(self, r: int) -> dict:
        full, m = self.full, self.full.manifest
        module: OrderedDict = OrderedDict()
        buffers = []
        for e in m.state_dict_keys:
            key = e["key"]
            if "param" in e:
                module[key] = torch.empty(0, dtype=self.dtype)
            elif key in full.state_dict:
                t = full.state_dict[key]
                module[key] = t.float() if t.is_floating_point() else t
                buffers.append(key)
        aliases = {a: p.name for p in m.params for a in p.aliases if a != p.name}
        state = {
            "module": module, "buffer_names": buffers, "optimizer": None,
            "param_shapes": [OrderedDict((n, self.shapes[n]) for n in g) for g in self.groups],
            "frozen_param_shapes": OrderedDict((n, self.shapes[n]) for n in self.frozen),
            "shared_params": aliases if r == 0 else {},
            "frozen_param_fragments": OrderedDict((n, self._piece(self.params[n], r).to(self.dtype))
                                                  for n in self.frozen),
            "lr_scheduler": self._scheduler(), "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
            "global_steps": self.global_steps, "global_samples": self.global_steps * self._train_batch(),
            "dp_world_size": self.world, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.config, "ds_version": fmt.DS_VERSION,
        }
        client = full.client_state
        if client is not None and not isinstance(client, dict):
            raise CheckpointError(f"export-deepspeed: the client state is a {type(client).__name__}; DeepSpeed merges "
                                  "a dict of client keys into its model-states files")
        clash = sorted(set(client or {}) & set(fmt.DS_KEYS))
        if clash:
            raise CheckpointError(f"export-deepspeed: client state keys {clash} are DeepSpeed's own")
        state.update(client or {})
        return state

    def optim_states(self, r: int) -> dict:
        moments = self.full.optimizer
        flats, state, groups = [], {}, [dict(h, params=[]) for h in self.hyper]
        for s, (k, names) in enumerate(self.sub_groups()):
            flats.append(torch.cat([self._piece(self.params[n], r) for n in names]).requires_grad_())
            steps = {float(moments[n]["step"]) for n in names if "step" in moments.get(n, {})}
            if len(steps) > 1:
                raise CheckpointError(f"export-deepspeed: parameters {names} have different Adam steps {sorted(steps)}; "
                                      "DeepSpeed keeps one per sub-group")
            if steps:
                state[s] = {"step": torch.tensor(steps.pop(), dtype=torch.float32),
                            "exp_avg": torch.cat([self._piece(moments[n]["exp_avg"], r) for n in names]),
                            "exp_avg_sq": torch.cat([self._piece(moments[n]["exp_avg_sq"], r) for n in names])}
            groups[k]["params"].append(s)
        inner = {"zero_stage": fmt.ZeroStageEnum.weights, "loss_scaler": fmt.LossScaler(1.0),
                 "dynamic_loss_scale": False, "overflow": False, "partition_count": self.world,
                 "optimizer_state_dict": {"state": state, "param_groups": groups}, "fp32_flat_groups": flats}
        return {"optimizer_state_dict": inner, "ds_config": self.config, "ds_version": fmt.DS_VERSION}

    def _scheduler(self) -> Optional[dict]:
        sched = self.full.rank0.get("scheduler")
        if sched is None:
            return None
        if "last_batch_iteration" in sched:  # zeropp's schedules keep DeepSpeed's state
            return {"last_batch_iteration": int(sched["last_batch_iteration"])}
        if "last_epoch" not in sched or "min_lrs" not in sched:  # else torch's state, as zeropp saved it before
            raise CheckpointError(f"export-deepspeed: the scheduler state {sorted(sched)[:6]} is not one of DeepSpeed's "
                                  "schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)")
        return {"last_batch_iteration": int(sched["last_epoch"]) - 1}

    def _train_batch(self) -> int:
        cfg = self.full.manifest.raw.get("config") or {}
        micro = cfg.get("train_micro_batch_size_per_gpu") or 1
        return int(micro) * int(cfg.get("gradient_accumulation_steps") or 1) * self.world


def _ds_config(cfg: dict) -> dict:
    """The DeepSpeed keys of the config a zeropp checkpoint records, for the files' ``ds_config``."""
    out: dict = {}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "optimizer",
                "scheduler"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    for key in ("bf16", "fp16"):
        if (cfg.get(key) or {}).get("enabled"):
            out[key] = {"enabled": True}
    out["zero_optimization"] = {"stage": 3}
    return out
