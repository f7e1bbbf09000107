"""Does an intact checkpoint fit this engine? The model's parameters, the optimizer (class, positions and
parameter groups), what a shard holds (tensor sizes, buffer shapes), and whether a different world size can
re-shard it. All of it runs inside the agreed read, before anything of the engine is changed.

These run after verification (``verify.py``), so a mismatch here is not damage: it raises a plain
:class:`CheckpointError`, and loading ``latest`` does not fall back past it to an older tag, which would not
fit either. Only a shard that lacks what every shard holds (a tensor of a recorded parameter, the buffers,
the parameter groups: possible in an unsealed version-1 tag) is an :class:`IntegrityError`.
"""
from __future__ import annotations

import os
from typing import Optional, Protocol, Sequence

import torch

from zeropp.checkpoint.format import CheckpointError, IntegrityError, shard_name
from zeropp.checkpoint.manifest import Manifest

# Optimizers whose state dicts share one layout (torch's Adam family; CpuAdam keeps it on purpose), so a run
# saved with AdamW resumes with optimizer offload (CpuAdam) and back.
_SAME_STATE = {"Adam": "adam", "AdamW": "adam", "CpuAdam": "adam"}


class ModelParam(Protocol):
    """What these checks read of a parameter as the engine holds it (``engine_state.Param``)."""

    name: str
    shape: tuple[int, ...]
    optimizer_index: Optional[int]
    master: torch.Tensor


def _family(optimizer_name: str) -> str:
    return _SAME_STATE.get(optimizer_name, optimizer_name)


def check_model(manifest: Manifest, params: Sequence[ModelParam], optimizer_name: Optional[str] = None) -> None:
    """Raise naming the first parameter (name and shape) where the model and the checkpoint differ.

    With ``optimizer_name`` (the optimizer state will be loaded) the optimizer class and the position of
    each parameter in it must match too.
    """
    saved = manifest.params
    for i in range(max(len(saved), len(params))):
        if i >= len(saved):
            raise CheckpointError(f"model does not match checkpoint {manifest.path}: model parameter "
                                  f"{params[i].name} {list(params[i].shape)} is not in the checkpoint")
        if i >= len(params):
            raise CheckpointError(f"model does not match checkpoint {manifest.path}: checkpoint parameter "
                                  f"{saved[i].name} {list(saved[i].shape)} is not in the model")
        s, p = saved[i], params[i]
        if s.name != p.name or tuple(s.shape) != tuple(p.shape):
            raise CheckpointError(
                f"model does not match checkpoint {manifest.path}: first mismatching parameter is "
                f"{p.name} with shape {list(p.shape)} in the model, {s.name} with shape {list(s.shape)} "
                "in the checkpoint")
        if optimizer_name is not None and s.optimizer_index != p.optimizer_index:
            raise CheckpointError(f"parameter {p.name} is optimizer parameter {p.optimizer_index} in the model "
                                  f"but {s.optimizer_index} in checkpoint {manifest.path} (different trainable set?)")
    saved_opt = manifest.raw["engine"].get("optimizer")
    if optimizer_name and saved_opt and _family(saved_opt) != _family(optimizer_name):
        raise CheckpointError(f"checkpoint {manifest.path} holds {saved_opt} state, the engine uses {optimizer_name}")


def check_reshardable(manifest: Manifest, with_optimizer: bool) -> None:
    """A checkpoint saved between accumulation boundaries resumes on its own world size only."""
    saved = manifest.raw["engine"]
    if with_optimizer and saved["micro_steps"] % saved["gradient_accumulation_steps"]:
        raise CheckpointError(f"checkpoint {manifest.path} was saved between gradient accumulation boundaries; "
                              "its partly accumulated gradients only resume on the same world size "
                              f"({manifest.world_size} ranks), so it cannot be re-sharded")


def check_shard_fits(shard: dict, path: str, rank: int, params: Sequence[ModelParam]) -> None:
    """Every parameter tensor a same-world load copies into the engine has the engine's size, checked before
    any is copied (a version-1 manifest is not sealed, so its shards are only as good as their sizes)."""
    parts = ("params", "grads") if shard.get("grads") is not None else ("params",)
    for p in params:
        for part in parts:
            got = shard[part].get(p.name) if isinstance(shard[part], dict) else None
            if not isinstance(got, torch.Tensor) or got.numel() != p.master.numel():
                raise IntegrityError(f"shard file {path} has no {p.master.numel()}-element '{part}' entry for "
                                     f"parameter {p.name}", file=shard_name(rank), problem="unreadable")


def check_buffers(saved: object, path: str, buffers: dict[str, torch.Tensor]) -> None:
    """The saved buffers (same world: this rank's file; re-sharded: rank 0's) that the model has are tensors of
    the model's shape, so that copying them in after the agreement cannot fail."""
    if not isinstance(saved, dict):
        raise IntegrityError(f"shard file {path} has no 'buffers' dictionary", file=os.path.basename(path),
                             problem="unreadable")
    for key, value in saved.items():
        if key in buffers and (not isinstance(value, torch.Tensor) or value.shape != buffers[key].shape):
            raise CheckpointError(f"buffer {key} in shard file {path} does not have the model's shape "
                                  f"{list(buffers[key].shape)}")


def check_param_groups(saved: object, groups: Sequence[dict], path: str) -> None:
    """The optimizer's parameter groups in the shard at ``path`` match the engine's optimizer ``groups`` in
    number and in the parameters each holds.

    ``check_model`` compares the flat optimizer positions only; ``Optimizer.load_state_dict`` also needs the
    same grouping, and would raise a ValueError only after the agreement, with the masters already loaded.
    """
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                              for g in saved):
        raise IntegrityError(f"shard file {path} has no list of optimizer parameter groups",
                             file=os.path.basename(path), problem="unreadable")
    got, want = [len(g["params"]) for g in saved], [len(g["params"]) for g in groups]
    if got != want:
        raise CheckpointError(f"optimizer parameter groups differ: checkpoint shard {path} holds {len(got)} "
                              f"group(s) of {got} parameter(s), the engine's optimizer {len(want)} of {want}")
