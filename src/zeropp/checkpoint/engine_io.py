"""Save and load an engine's training state (stages 0-3): one shard file per rank plus rank 0's manifest.

Functions over an engine (the engine's ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` call
them); every rank must call them together.
The dependency runs one way: this module reads the engine's state (``EngineHandle``), and ``zeropp.zero`` never
imports ``zeropp.checkpoint`` (tests/unit/test_layers.py). The directory layout and the atomicity argument
are in ``format.py`` (Note [checkpoint atomicity]).

What a shard file holds, and why it is enough to continue bit for bit: the fp32 master chunk of every
parameter (the 16-bit shard is recast from it, as every optimizer step does), the optimizer's
``state_dict()`` over the master views, the scheduler's ``state_dict()``, the engine's micro/global step
counters, the torch (CPU and CUDA), Python and NumPy RNG states, the model's buffers, the caller's
``client_state``, the reduce strategy's state with the topology it was kept on (LoCo's errors: restored as
saved on the same topology, mapped on another by ``plus/loco.map_states``) and — only when saved between
accumulation boundaries — the partly accumulated gradient shards. hpZ secondary copies and gathered weights
are derived state: loading bumps every unit's version (Note [secondary staleness]) so they are rebuilt from
the loaded masters.

Elastic resume: on a different world size each rank rebuilds its new chunk of every master and of every
optimizer state laid out like the chunk (Adam's ``exp_avg``/``exp_avg_sq``) by streaming the old shard
files one at a time (``reshard.read_ranges``); scalars (Adam's ``step``), the scheduler and the counters
come from rank 0's file. RNG states are per rank and are only restored on the same world size.

Every file is verified before it is read, and nothing read is unpickled: a shard is tensors and JSON (Note
[data, not code] in ``safe_io.py``; Note [checkpoint verification] in ``format.py``), and every
step that can fail ends in an agreement of all ranks (Note [one outcome for all ranks] in
``collective.py``); loading ``latest`` falls back past a damaged tag (``resolve.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from typing import Any, Optional

import torch

from zeropp._version import __version__
from zeropp.checkpoint.collective import agree, agreed_load, shared_nonce, written_of, written_row
from zeropp.checkpoint.fit import (
    check_buffers, check_model, check_param_groups, check_reshardable, check_shard_fits,
)
from zeropp.checkpoint.format import (
    FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, Written, atomic_write, atomic_write_text, check_tag,
    crash_point, fsync_dir, rename_into_place, shard_name, write_error,
)
from zeropp.checkpoint.engine_state import (Loaded, Param, What, apply_loaded, engine_buffers, engine_params,
                                            rng_state)
from zeropp.checkpoint.manifest import Manifest, read_manifest, seal
from zeropp.checkpoint.reshard import read_ranges
from zeropp.checkpoint.safe_io import encode, write_tree
from zeropp.checkpoint.verify import check_files, open_shard
from zeropp.plus.loco import Shape, map_states
from zeropp.zero.consolidated import consolidated_state_dict
from zeropp.zero.state import EngineHandle




# Note [stage 0 checkpoints]
# Stage 0 cuts nothing: every rank holds every master and the whole optimizer state, i.e. a chunk as large as the
# (padded) parameter. Each rank still writes its own shard file (its RNG and client state are its own), so a
# same-world resume is the usual one, file per rank. Read as a sharded layout, such a file's chunk starts at
# rank * chunk >= numel for every rank but 0, so rank 0's file alone covers every element: re-sharding into
# stages 1-3, or consolidating, reads the right values with no special case. The other way, a stage-0 engine
# takes the whole parameter, range (0, chunk), from any checkpoint; a layout change always goes through the
# re-sharding path, even on the same world size, since the shard files' chunks differ from the engine's.
def _sharded(engine: EngineHandle) -> bool:
    """Whether the engine cuts its masters and optimizer state over the ranks (stages 1-3, not stage 0)."""
    return bool(engine.state.plan.shards_optimizer)


# ---- save ------------------------------------------------------------------------------------------------
def _shard_payload(engine: EngineHandle, params: list[Param], client_state: Any, nonce: str) -> dict:
    saved = {p.name for p in params}
    mid_accumulation = engine.micro_steps % engine.state.policy.gradient_accumulation_steps != 0
    sched = engine.lr_scheduler
    return {
        "format_version": FORMAT_VERSION,
        "nonce": nonce,  # the manifest's too: a shard of another save is named as such (verify.open_shard)
        "rank": engine.state.topo.rank,
        "world_size": engine.state.topo.world_size,
        "params": {p.name: p.master for p in params},  # views: torch.save writes each unit's row once
        "grads": {p.name: p.grad for p in params} if mid_accumulation else None,
        "optimizer": engine.master_optimizer.state_dict(),
        "scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "counters": {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps},
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "reduce_state": {"shape": [engine.state.topo.num_nodes, engine.state.topo.ranks_per_node],
                         "state": engine.state.strategies.reduce.state_dict()},
        # frozen units kept as int8: their exact rows (the fp32 "params" above are their dequantized values)
        "frozen_rows": {str(u.index): u.quantized_state() for u in engine.state.units
                        if u.quantized_state() is not None and any(s.name in saved for s in u.slots)},
        "rng": rng_state(),
        "buffers": {k: t.detach() for k, t in engine_buffers(engine).items()},
        "client_state": client_state,
    }


def _config_json(engine: EngineHandle) -> Any:
    cfg = engine.state.config  # None when the engine was built without initialize
    if cfg is None:
        return None
    if hasattr(cfg, "model_dump"):
        return cfg.model_dump(mode="json")
    try:
        return json.loads(json.dumps(cfg, default=str))
    except (TypeError, ValueError):
        return repr(cfg)


def _manifest(engine: EngineHandle, tag: str, params: list[Param], shards: list[Written], nonce: str) -> dict:
    topo, policy, sched = engine.state.topo, engine.state.policy, engine.lr_scheduler
    excluded = {s.name for u in engine.state.units for s in u.slots} - {p.name for p in params}
    keys = []
    names_by_alias = {a: p.name for p in params for a in p.aliases}
    for key in engine.module.state_dict(keep_vars=True):
        keys.append({"key": key, "param": names_by_alias[key]} if key in names_by_alias else {"key": key})
    return {
        "format_version": FORMAT_VERSION,
        "zeropp_version": __version__,
        "torch_version": torch.__version__,
        "tag": tag,
        "nonce": nonce,
        "created_unix": time.time(),
        "config": _config_json(engine),
        "engine": {
            "stage": 3 if _sharded(engine) else 0,  # 0: whole state per file (Note [stage 0 checkpoints])
            "compute_dtype": str(policy.compute_dtype).removeprefix("torch."),
            "gradient_accumulation_steps": policy.gradient_accumulation_steps,
            "gradient_clipping": policy.gradient_clipping,
            "strategies": {k: type(getattr(engine.state.strategies, k)).__name__
                           for k in ("forward_gather", "backward_gather", "reduce")},
            "optimizer": type(engine.master_optimizer).__name__,
            "scheduler": type(sched).__name__ if sched is not None else None,
            "micro_steps": engine.micro_steps,
            "global_steps": engine.global_steps,
        },
        "topology": {"world_size": topo.world_size, "ranks_per_node": topo.ranks_per_node,
                     "num_nodes": topo.num_nodes, "hpz_partition_size": topo.hpz.size},
        "params": [{"name": p.name, "aliases": p.aliases, "shape": list(p.shape), "numel": p.numel,
                    "unit": p.unit, "chunk": p.chunk, "world": topo.world_size,
                    "optimizer_index": p.optimizer_index} for p in params],
        "state_dict_keys": keys,
        "shards": [{"rank": r, "file": shard_name(r), "bytes": w.size, "sha256": w.sha256}
                   for r, w in enumerate(shards)],
        **({"excluded_frozen": sorted(excluded)} if excluded else {}),
    }


def save_checkpoint(engine: EngineHandle, save_dir: str, tag: Optional[str] = None,
                    client_state: Any = None, save_latest: bool = True, exclude_frozen: bool = False) -> str:
    """Write this rank's shard (and, on rank 0, the manifest and ``latest``); returns the tag directory.

    See Note [checkpoint atomicity] in ``format.py`` for why a crash never damages an earlier tag, and why a
    failed write (a full disk) fails the save on every rank and leaves the earlier tags and ``latest`` as
    they were. Every rank calls it. ``exclude_frozen`` leaves out the parameters that do not require grad (a
    LoRA run's base weights, loaded again from the pretrained model): the manifest names them, and a load
    keeps the values the model holds for them.
    """
    engine.join_update()
    with engine.state.residency.resident(engine.state.units, dirty=False):  # NVMe: the rank's whole state, read back
        return _save(engine, save_dir, tag, client_state, save_latest, exclude_frozen)


def _save(engine: EngineHandle, save_dir: str, tag: Optional[str], client_state: Any, save_latest: bool,
          exclude_frozen: bool) -> str:
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    rank, save_dir = engine.state.topo.rank, os.path.abspath(save_dir)
    nonce = shared_nonce(engine)
    tmp_dir, final = os.path.join(save_dir, f".{tag}.tmp-{nonce}"), os.path.join(save_dir, tag)
    params = engine_params(engine, writing=False)
    if exclude_frozen:
        frozen = {s.name for u in engine.state.units for s in u.slots if not s.param.requires_grad}
        params = [p for p in params if p.name not in frozen]
    error: Optional[BaseException] = None
    written: Optional[Written] = None
    path = os.path.join(tmp_dir, shard_name(rank))
    try:
        os.makedirs(tmp_dir, exist_ok=True)
        payload = _shard_payload(engine, params, client_state, nonce)
        encode(client_state, "client_state")  # refused by name before a byte is written (UnstorableError)
        written = atomic_write(path, lambda f: write_tree(f, payload, "shard"), point="shard", rank=rank)
        crash_point("shard_written", rank)
    except CheckpointError as err:  # a failed write: names the file and the cause (ENOSPC ...)
        error = err
    except OSError as err:  # creating the directory
        error = write_error(err.filename or path, err)
    except Exception as err:  # noqa: BLE001 - reported to every rank by agree
        error = CheckpointError(f"rank {rank} could not write its shard {path}: {err}", file=shard_name(rank),
                                problem="write failed")
    try:
        rows = agree(engine, error, "writing checkpoint shards", lambda name: os.path.join(tmp_dir, name),
                     written_row(written))
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    error = None
    if rank == 0:
        try:
            _publish(engine, tag, params, [written_of(r) for r in rows], tmp_dir, final, nonce, save_latest)
        except Exception as err:  # noqa: BLE001
            error = err
    agree(engine, error, "publishing the checkpoint",
          lambda name: os.path.join(save_dir if name == LATEST else tmp_dir, name))
    return final


def _publish(engine: EngineHandle, tag: str, params: list[Param], shards: list[Written], tmp_dir: str, final: str,
             nonce: str, save_latest: bool) -> None:
    """Rank 0, once every shard is on disk: manifest, then one directory rename, then ``latest``."""
    save_dir = os.path.dirname(final)
    try:
        manifest = seal(_manifest(engine, tag, params, shards, nonce))
        atomic_write_text(os.path.join(tmp_dir, MANIFEST), json.dumps(manifest, indent=1), point="manifest")
        fsync_dir(tmp_dir)
        crash_point("before_publish", 0)
        # re-saving a tag moves the old one aside, and back should the new one not come in
        rename_into_place(tmp_dir, final, os.path.join(save_dir, f".{tag}.old-{nonce}"))
    except BaseException:  # nothing is published yet: leave no torn directory behind
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    fsync_dir(save_dir)
    crash_point("before_latest", 0)
    if save_latest:  # a failure here leaves `latest` on the previous tag, the new one complete beside it
        atomic_write_text(os.path.join(save_dir, LATEST), tag, point="latest")
    for name in os.listdir(save_dir):  # this tag's leftovers: the aside copy, torn saves of earlier crashes
        if name.startswith((f".{tag}.old-", f".{tag}.tmp-")):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------------------
def _reduce_state(engine: EngineHandle, manifest: Manifest, rank: int, params: list[Param],
                  own: Optional[dict]) -> Optional[dict]:
    """The reduce strategy's state for this rank, or None when it keeps none. LoCo's kept errors are taken
    as saved on the same topology (``own``: this rank's saved entry, read with its shard), mapped from every
    old rank's on another (Note [mapping kept errors] in ``plus/loco.py``), and start from zero, with a
    warning, when the checkpoint has none."""
    current = engine.state.strategies.reduce.state_dict()
    if not current:
        return None
    topo = engine.state.topo
    shape = Shape(topo.num_nodes, topo.ranks_per_node)
    if own is not None and own.get("shape") == [shape.nodes, shape.per_node] and "loco" in own.get("state", {}):
        return own["state"]
    saved = [(open_shard(manifest, r, mmap=True).get("reduce_state") or {}) for r in range(manifest.world_size)]
    if not all("loco" in s.get("state", {}) for s in saved):
        warnings.warn(f"{manifest.path}: the checkpoint keeps no LoCo errors (saved without zeropp_loco_param); "
                      "error feedback starts from zero", stacklevel=3)
        return {"loco": {**current["loco"], "steps": 0, "first": {}, "second": {}}}
    states = [s["state"]["loco"] for s in saved]
    sizes = {p.name: (p.numel, p.chunk) for p in params}
    return {"loco": map_states(states, Shape(*saved[0]["shape"]), shape, rank, sizes, int(states[0]["block"]))}


def _read_same_world(manifest: Manifest, rank: int, params: list[Param]) -> Loaded:
    shard = open_shard(manifest, rank)
    check_shard_fits(shard, manifest.shard_path(rank), rank, params)
    return Loaded(shard["params"], shard.get("grads"), shard["optimizer"], shard.get("scheduler"),
                   shard["counters"], shard.get("rng"), shard.get("buffers", {}), shard.get("client_state"),
                   shard.get("loss_scaler"), shard.get("reduce_state"), shard.get("frozen_rows"))


def _read_resharded(manifest: Manifest, params: list[Param], rank: int, with_optimizer: bool) -> Loaded:
    """``rank``: the engine's rank among the ranks that cut the state (0 in stage 0's group of one)."""
    check_reshardable(manifest, with_optimizer)
    ranges = {p.name: (rank * p.chunk, p.chunk) for p in params}
    got = read_ranges(manifest, ranges, with_optimizer)
    head = got.rank0
    state = {p.optimizer_index: got.optimizer[p.name] for p in params
             if p.optimizer_index is not None and p.name in got.optimizer}
    optimizer = {"state": state, "param_groups": head["optimizer_param_groups"]}
    return Loaded(got.params, None, optimizer, head.get("scheduler"), head["counters"], None,
                   head.get("buffers", {}), head.get("client_state"), head.get("loss_scaler"))


def load_checkpoint(engine: EngineHandle, load_dir: str, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, strict: bool = True) -> tuple[Optional[str], Any]:
    """Restore the engine from ``load_dir/tag``; ``(path, client_state)``, or ``(None, None)`` (see below).

    ``tag=None`` reads the tag ``latest`` names, falling back with a warning to the newest older complete
    tag that passes verification (``resolve.py``); a ``load_dir`` that does not exist or holds no complete
    tag gives ``(None, None)`` and a warning, so a restarted job can always call this (DeepSpeed's resume
    idiom). An explicit tag never falls back. Everything is read and verified before the engine is
    touched: on any error, on any rank, every rank raises and the engine is unchanged. Client state: each
    rank gets its own on the same world size, rank 0's otherwise. ``load_module_only`` restores the
    weights (and buffers) alone; the optimizer, scheduler, counters and RNG stay as they are. A checkpoint
    saved with ``exclude_frozen`` loads only with ``strict=False``, keeping the model's own frozen values.
    """
    what = What(load_optimizer_states, load_lr_scheduler_states, load_module_only, strict)
    engine.join_update()
    with engine.state.residency.resident(engine.state.units):  # NVMe: in memory while loading, written back after
        return _load(engine, load_dir, tag, what)


def _load(engine: EngineHandle, load_dir: str, tag: Optional[str], what: What) -> tuple[Optional[str], Any]:
    every = engine_params(engine)
    rank = engine.state.topo.rank
    with_optimizer = what.optimizer and not what.module_only
    loading: list[list[Param]] = [every]  # those the checkpoint holds (a save may leave frozen ones out)

    def read(tag_dir: str) -> Loaded:
        """Everything ``apply_loaded`` will write, read and checked; runs inside the agreement (``agreed_load``)."""
        manifest = read_manifest(tag_dir)
        if rank == 0:  # the listing and every file's size, once; each rank checks what it opens itself
            check_files(manifest)
        params = loading[0] = _held_by(manifest, engine, every, what.strict)
        check_model(manifest, params, type(engine.master_optimizer).__name__ if with_optimizer else None)
        if manifest.world_size == engine.state.topo.world_size and manifest.sharded == _sharded(engine):
            loaded, source = _read_same_world(manifest, rank, params), manifest.shard_path(rank)
        else:  # buffers, param groups and scalars come from rank 0's file (Note [stage 0 checkpoints])
            shard_rank = rank if _sharded(engine) else 0
            loaded, source = _read_resharded(manifest, params, shard_rank, with_optimizer), manifest.shard_path(0)
        check_buffers(loaded.buffers, source, engine_buffers(engine))
        if not what.module_only:
            loaded.reduce_state = _reduce_state(engine, manifest, rank, params, loaded.reduce_state)
        else:
            loaded.reduce_state = None
        if with_optimizer:
            check_param_groups(loaded.optimizer["param_groups"], engine.master_optimizer.param_groups, source)
        return loaded

    got = agreed_load(engine, load_dir, tag, read)
    if got is None:
        return None, None
    path, loaded = got
    apply_loaded(engine, loading[0], loaded, what)
    return path, loaded.client_state


def _held_by(manifest: Manifest, engine: EngineHandle, params: list[Param], strict: bool) -> list[Param]:
    """``params`` less those the save left out as frozen, which must be frozen here too (their values stay)."""
    excluded = manifest.excluded_frozen
    if not excluded:
        return params
    if strict:
        raise CheckpointError(f"checkpoint {manifest.path} was saved without the frozen parameters "
                              f"{sorted(excluded)[:3]}{' ...' if len(excluded) > 3 else ''}: load it non-strict "
                              "(load_module_strict=False), which keeps the model's own values for them")
    trains = {s.name for u in engine.state.units for s in u.slots if s.param.requires_grad} & excluded
    if trains:
        raise CheckpointError(f"checkpoint {manifest.path} was saved without the frozen parameters "
                              f"{sorted(trains)[:3]}, which this model trains: load a checkpoint that holds them")
    return [p for p in params if p.name not in excluded]


# ---- 16-bit weights --------------------------------------------------------------------------------------
def in_compute_dtype(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors cast to ``dtype``; tied keys keep sharing one tensor."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for key, t in state.items():
        if id(t) not in cast:
            cast[id(t)] = t.to(dtype) if t.is_floating_point() else t
        out[key] = cast[id(t)]
    return out


def save_16bit_model(engine: EngineHandle, save_dir: str, save_filename: str = "pytorch_model.bin") -> str:
    """Gather the full weights (every rank must call) and write them in the compute dtype from rank 0."""
    from zeropp.checkpoint.consolidate import write_state_dict

    state = consolidated_state_dict(engine)
    out = os.path.join(os.path.abspath(save_dir), save_filename)
    error: Optional[BaseException] = None
    if engine.state.topo.rank == 0:
        try:
            state = in_compute_dtype(state, engine.state.policy.compute_dtype)
            os.makedirs(save_dir, exist_ok=True)
            write_state_dict(state, out)
        except Exception as err:  # noqa: BLE001
            error = err
    agree(engine, error, "saving the 16-bit model", lambda name: out)
    return out
