"""Turn a sharded checkpoint into one full fp32 state dict, without ``torch.distributed``.

``consolidate(ckpt_dir, "model.safetensors")`` (or ``zeropp consolidate CKPT_DIR OUT``) reads the manifest,
then the shard files one at a time (memory-mapped), copying each rank's chunk of every parameter into the
full tensors (``reshard.read_ranges``), and writes ``model.state_dict()``'s keys — a tied weight under each
of its names, buffers as rank 0 held them — so ``model.load_state_dict`` takes the file as it is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from zeropp.checkpoint.format import atomic_replace
from zeropp.checkpoint.manifest import Manifest, read_manifest
from zeropp.checkpoint.reshard import read_ranges
from zeropp.checkpoint.resolve import read_with_fallback
from zeropp.checkpoint.verify import check_files

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"


@dataclass
class FullCheckpoint:
    """A checkpoint read back whole: the fp32 state dict and, if asked, each parameter's optimizer state.

    ``optimizer[name]`` maps a state key to a tensor shaped like the parameter (``exp_avg``, ``exp_avg_sq``)
    or to a scalar (``step``). ``manifest`` is the tag's parsed manifest; ``rank0`` rank 0's shard without its
    bulk tensors (scheduler, counters, buffers, the optimizer's ``param_groups``, reduce and frozen state).
    """

    state_dict: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, object]]
    manifest: Manifest
    client_state: object = None
    rank0: dict = field(default_factory=dict)  # rank 0's shard without its bulk tensors (scheduler, counters...)


def load_full_checkpoint(ckpt_dir: str, tag: Optional[str] = None, with_optimizer: bool = False) -> FullCheckpoint:
    """Read tag ``tag`` (default: ``latest``) of ``ckpt_dir`` into full fp32 tensors, one shard file at a time.

    Every file is verified before it is read; with ``tag=None`` a tag that fails verification is skipped
    for the newest one that passes, with a :class:`~zeropp.checkpoint.CheckpointWarning` (``resolve.py``).
    """
    return read_with_fallback(ckpt_dir, tag, lambda tag_dir: _read_full(tag_dir, with_optimizer))[1]


def _read_full(tag_dir: str, with_optimizer: bool) -> FullCheckpoint:
    manifest = read_manifest(tag_dir)
    check_files(manifest)
    got = read_ranges(manifest, {p.name: (0, p.numel) for p in manifest.params}, with_optimizer)
    shapes = {p.name: p.shape for p in manifest.params}
    full = {name: t.view(shapes[name]) for name, t in got.params.items()}
    buffers = got.rank0.get("buffers", {})
    state: dict[str, torch.Tensor] = {}
    for entry in manifest.state_dict_keys:
        key = entry["key"]
        if "param" in entry:
            state[key] = full[entry["param"]]  # tied names share one tensor, as in the engine's state dict
        elif key in buffers:
            t = buffers[key]
            state[key] = t.float() if t.is_floating_point() else t
    optimizer = {
        name: {k: (v.view(shapes[name]) if isinstance(v, torch.Tensor) and v.dim() == 1 else v)
               for k, v in st.items()}
        for name, st in got.optimizer.items()
    }
    return FullCheckpoint(state, optimizer, manifest, got.rank0.get("client_state"), got.rank0)


def write_state_dict(state: dict[str, torch.Tensor], out_path: str) -> str:
    """Write ``state`` atomically (temporary file, fsync, rename): safetensors or a torch file by extension."""
    out_path = os.path.abspath(out_path)
    if out_path.endswith(SAFETENSORS_SUFFIX):
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise RuntimeError(f"writing {out_path} needs the 'safetensors' package (pip install safetensors);"
                               f" or choose a {'/'.join(TORCH_SUFFIXES)} file") from err
        seen: set[int] = set()
        plain = {}
        for key, t in state.items():  # safetensors refuses shared storage: tied names get copies
            plain[key] = t.contiguous() if id(t) not in seen else t.clone().contiguous()
            seen.add(id(t))
        atomic_replace(out_path, lambda tmp: save_file(plain, tmp, metadata={"format": "pt"}))
    elif out_path.endswith(TORCH_SUFFIXES):
        atomic_replace(out_path, lambda tmp: torch.save(state, tmp))
    else:
        raise ValueError(f"{out_path}: unknown extension; use {SAFETENSORS_SUFFIX} or one of "
                         f"{', '.join(TORCH_SUFFIXES)}")
    return out_path


def consolidate(ckpt_dir: str, out_path: str, tag: Optional[str] = None) -> str:
    """Write the full fp32 model state dict of ``ckpt_dir`` (tag ``tag``, default ``latest``) to ``out_path``.

    ``.safetensors`` writes safetensors; ``.pt``, ``.pth`` or ``.bin`` a ``torch.save`` file. Returns the path.
    Needs no process group: shard files are read one at a time.
    """
    state = load_full_checkpoint(ckpt_dir, tag).state_dict
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    return write_state_dict(state, out_path)
