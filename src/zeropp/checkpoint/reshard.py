"""Re-sharding for a different world size: copy the overlap of an old chunk with a new one.

Under Note [shard layout] (``partition/spec.py``) rank ``r`` of ``W`` holds elements
``[r * chunk_W, (r + 1) * chunk_W)`` of the flattened parameter, zero-padded past ``numel``. Any contiguous
target range — a new rank's chunk, or the whole parameter when consolidating — is filled by visiting the
old shard files one at a time and copying, from each, the part of its chunk that falls inside the target
and below ``numel``. Padding in the target is left at zero, as the layout requires.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from zeropp.checkpoint.format import CheckpointError
from zeropp.checkpoint.manifest import Manifest, ParamEntry
from zeropp.checkpoint.verify import open_shard


def overlap(numel: int, src_start: int, src_len: int, dst_start: int, dst_len: int) -> Optional[tuple[int, int]]:
    """The ``[lo, hi)`` element range shared by a source and a destination range, clipped to ``numel``."""
    lo = max(src_start, dst_start)
    hi = min(src_start + src_len, dst_start + dst_len, numel)
    return (lo, hi) if lo < hi else None


def copy_overlap(dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int, numel: int) -> None:
    """Copy into 1-D ``dst`` (elements from ``dst_start``) what 1-D ``src`` (from ``src_start``) holds of it."""
    span = overlap(numel, src_start, src.numel(), dst_start, dst.numel())
    if span is not None:
        lo, hi = span
        dst[lo - dst_start : hi - dst_start].copy_(src.reshape(-1)[lo - src_start : hi - src_start])


def is_sharded_state(value: object, old_chunk: int) -> bool:
    """An optimizer state tensor laid out like the parameter's chunk (Adam's moments, SGD's momentum)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == old_chunk


# ---- streaming reads over the shard files ----------------------------------------------------------------
_BULK = ("params", "grads", "optimizer")  # per-rank tensors; everything else is taken from rank 0's file


@dataclass
class Assembled:
    """Target ranges of every parameter (and optionally its optimizer state) read from all shard files.

    ``params[name]`` and ``optimizer[name][key]`` are 1-D fp32 tensors of the requested length (zero past
    the parameter's end); per-parameter scalars (Adam's ``step``) come from rank 0. ``rank0`` is rank 0's
    file without its bulk tensors: scheduler, counters, buffers, optimizer ``param_groups``, client state.
    """

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, object]] = field(default_factory=dict)
    rank0: dict = field(default_factory=dict)


def read_ranges(manifest: Manifest, ranges: dict[str, tuple[int, int]], with_optimizer: bool) -> Assembled:
    """Fill ``[start, start + length)`` of each named parameter from the shard files, one file at a time.

    Files are visited in rank order, each verified (size, SHA-256) and then memory-mapped, so only one is
    open at once; a file that holds no part of any target range is skipped (rank 0's is always read, for
    the scalars), so a new rank of an elastic resume reads only the few old files its chunk spans.
    """
    entries = [p for p in manifest.params if p.name in ranges]
    out = Assembled(params={p.name: torch.zeros(ranges[p.name][1], dtype=torch.float32) for p in entries})
    for rank in range(manifest.world_size):
        if rank and not any(overlap(p.numel, rank * p.chunk, p.chunk, *ranges[p.name]) for p in entries):
            continue
        path = manifest.shard_path(rank)
        shard = open_shard(manifest, rank, mmap=True)
        for p in entries:
            src = shard["params"].get(p.name)
            if not isinstance(src, torch.Tensor) or src.numel() != p.chunk:
                raise CheckpointError(f"shard file {path} has no {p.chunk}-element chunk of parameter {p.name}")
            start, _ = ranges[p.name]
            copy_overlap(out.params[p.name], start, src, rank * p.chunk, p.numel)
            if with_optimizer and p.optimizer_index is not None:
                _read_optimizer(out, shard, p, ranges[p.name], rank, path)
        if rank == 0:
            out.rank0 = {k: v for k, v in shard.items() if k not in _BULK}
            out.rank0["buffers"] = {k: v.clone() for k, v in shard.get("buffers", {}).items()}
            out.rank0["optimizer_param_groups"] = shard["optimizer"]["param_groups"]
        del shard
    return out


def _read_optimizer(out: Assembled, shard: dict, p: ParamEntry, span: tuple[int, int], rank: int,
                    path: str) -> None:
    state = shard["optimizer"]["state"].get(p.optimizer_index)
    if state is None:  # this parameter was never stepped: nothing to carry
        return
    mine = out.optimizer.setdefault(p.name, {})
    start, length = span
    for key, value in state.items():
        if is_sharded_state(value, p.chunk):
            if key not in mine:
                mine[key] = torch.zeros(length, dtype=value.dtype)
            copy_overlap(mine[key], start, value, rank * p.chunk, p.numel)  # type: ignore[arg-type]
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise CheckpointError(f"{path}: optimizer state '{key}' of parameter {p.name} has shape "
                                  f"{tuple(value.shape)}, neither a scalar nor laid out like the {p.chunk}-element "
                                  "chunk, so it cannot be re-sharded")
        elif rank == 0:
            mine[key] = value.clone() if isinstance(value, torch.Tensor) else value
