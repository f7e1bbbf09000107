"""``zeropp.hf.from_pretrained``: a ``transformers`` model whose weights go from its safetensors checkpoint
straight into each rank's chunks, for models no rank could hold whole.

    model = zeropp.hf.from_pretrained("checkpoints/llama-7b")          # every rank
    engine, *_ = zeropp.initialize(model=model, config="ds_config.json")

The model is built on the meta device (no memory, no random init), and every parameter is partitioned as
``zero.Init`` partitions it (Note [partitioned at construction] in ``zero/construction.py``), except that
each rank reads its own chunk from the file: one seek and one read per parameter
(``partition/safetensors_chunks.py``), no collective, nothing unpickled. Peak host memory per rank is its chunks
plus the one being read. Tied weights are read once. Then, as ``transformers.from_pretrained`` does:

* a parameter the checkpoint lacks (a new head) is initialized by the model's ``_init_weights``, from rank 0's
  values, with a warning listing them;
* buffers come from the checkpoint where it has them, else are recomputed by a real construction of their
  module (rotary frequencies, position ids: Note [nothing uninitialized] in ``partition/meta.py``), else are
  refused by name;
* checkpoint tensors the model does not use are listed in a warning.

The model is returned in eval mode, as ``transformers`` returns it.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Optional, Union

import torch
import transformers
from torch import nn

from zeropp.zero.construction import PARAMS, local_device
from zeropp.partition.meta import UninitializedError, rebuild_module
from zeropp.partition.safetensors_chunks import SafetensorsChunks
from zeropp.partition.spec import ShardSpec
from zeropp.topology import ensure_process_group

log = logging.getLogger("zeropp")


def from_pretrained(name_or_path: Union[str, "os.PathLike[str]"], model_class: Any = None, *,
                    dtype: Optional[torch.dtype] = None, config: Any = None,
                    device: Union[torch.device, str, None] = None, **config_kwargs: Any) -> nn.Module:
    """Build ``model_class`` from the checkpoint at ``name_or_path`` with its weights partitioned over the ranks.

    Call on every rank. ``name_or_path``: a directory with ``config.json`` and ``model.safetensors`` (or a
    sharded ``model.safetensors.index.json``), or a Hub id (its safetensors and JSON files are fetched with
    ``huggingface_hub``). ``model_class``: a ``transformers`` class or auto class (default: the
    ``architectures`` entry of the config). ``dtype``: cast floating-point weights to it (default: as stored).
    ``config``: a ``PretrainedConfig`` to use instead of the checkpoint's; ``config_kwargs`` override its fields.
    ``device``: where the chunks and buffers live, and so where ``initialize`` trains the model (default: this
    rank's CUDA device when there is one, else the CPU, as under ``zero.Init``).
    """
    ensure_process_group()
    where = torch.device(device) if device is not None else local_device()
    path = _local(name_or_path)
    hf_config = config if config is not None else transformers.AutoConfig.from_pretrained(path, **config_kwargs)
    cls = model_class or _architecture(hf_config)
    with torch.device("meta"):
        model = cls.from_config(hf_config) if hasattr(cls, "from_config") else cls(hf_config)
    ckpt = SafetensorsChunks(path)
    used: set[str] = set()
    missing = _load_parameters(model, ckpt, dtype, used, where)
    if missing:
        _initialize_missing(model, missing, where)
    _fill_meta_buffers(model, ckpt, used, where)
    unexpected = sorted(set(ckpt.keys()) - used)
    if missing:
        warnings.warn(f"from_pretrained: {len(missing)} parameters are not in the checkpoint and were initialized "
                      f"by the model's _init_weights: {[n for n, _ in missing][:20]}", stacklevel=2)
    if unexpected:
        warnings.warn(f"from_pretrained: {len(unexpected)} checkpoint tensors are not used by "
                      f"{type(model).__name__}: {unexpected[:20]}", stacklevel=2)
    return model.eval()


def _local(name_or_path: Union[str, "os.PathLike[str]"]) -> str:
    if os.path.exists(name_or_path):
        return str(name_or_path)
    from huggingface_hub import snapshot_download
    return snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"])


def _architecture(hf_config: Any) -> Any:
    for name in getattr(hf_config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, attr))
    return out


def _key(names: list[str], prefix: str, ckpt: SafetensorsChunks) -> Optional[str]:
    """The checkpoint's name for a parameter: any of its (tied) names, with or without the base model's prefix."""
    for name in names:
        for candidate in (name, f"{prefix}.{name}" if prefix else name,
                          name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name):
            if candidate in ckpt:
                return candidate
    return None


def _load_parameters(model: nn.Module, ckpt: SafetensorsChunks, dtype: Optional[torch.dtype],
                     used: set[str], device: torch.device) -> list[tuple[str, nn.Parameter]]:
    """Place this rank's chunk of every parameter the checkpoint holds; return the others (still on meta)."""
    world, rank = PARAMS.comm.topo.world_size, PARAMS.comm.topo.rank
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    holders = _holders(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    missing = []
    for pid, p in params.items():
        key = _key(names[pid], prefix, ckpt)
        if key is None:
            missing.append((names[pid][0], p))
            continue
        used.add(key)
        spec = ShardSpec(p.numel(), p.shape, world)
        chunk = ckpt.read_chunk(key, spec, rank)
        if dtype is not None and chunk.is_floating_point():
            chunk = chunk.to(dtype)
        chunk = chunk.to(device)
        new = nn.Parameter(torch.empty(0, dtype=chunk.dtype, device=device), requires_grad=p.requires_grad)
        PARAMS.place(new, names[pid][0], chunk, spec)
        for module, attr in holders[pid]:
            module._parameters[attr] = new
    return missing


def _initialize_missing(model: nn.Module, missing: list[tuple[str, nn.Parameter]], device: torch.device) -> None:
    """Initialize parameters the checkpoint lacks with the model's ``_init_weights``, one holder module at a
    time, and partition them from rank 0's values."""
    init = getattr(model, "_init_weights", None)
    holders = _holders(model)
    for name, p in missing:
        new = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype, device=device) if p.is_floating_point()
                           else torch.zeros(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for module, attr in holders[id(p)]:
            module._parameters[attr] = new
        if callable(init):
            with torch.no_grad():
                for module, _ in holders[id(p)]:
                    init(module)
        if new.is_floating_point() and bool(torch.isnan(new).any()):
            raise UninitializedError(f"parameter {name!r} is not in the checkpoint and the model's _init_weights "
                                     "does not initialize it; load a checkpoint that has it")
        PARAMS.partition([(name, new)])


def _fill_meta_buffers(model: nn.Module, ckpt: SafetensorsChunks, used: set[str], device: torch.device) -> None:
    """Buffers left on meta: from the checkpoint, else recomputed by constructing their module again; every
    buffer ends on ``device``."""
    names = {id(m): n for n, m in model.named_modules()}
    limit = max((p.numel() for p in model.parameters()), default=0)
    for module in model.modules():
        rebuilt: Any = None
        for attr, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if not buf.is_meta:  # built on a device named in the model's code: onto the model's
                module._buffers[attr] = buf.to(device)
                continue
            name = f"{names[id(module)]}.{attr}" if names[id(module)] else attr
            if name in ckpt:
                used.add(name)
                module._buffers[attr] = ckpt.read(name).to(device=device, dtype=buf.dtype)
                continue
            if rebuilt is None:
                rebuilt = rebuild_module(module, limit)
            theirs = rebuilt._buffers.get(attr) if isinstance(rebuilt, nn.Module) else None
            if theirs is None or theirs.shape != buf.shape:
                why = rebuilt if isinstance(rebuilt, str) else "constructed again, it has no such buffer"
                raise UninitializedError(f"buffer {name!r} is not in the checkpoint and cannot be recomputed from a "
                                         f"real construction of {type(module).__name__}: {why}")
            module._buffers[attr] = theirs.to(device=device, dtype=buf.dtype).clone()
