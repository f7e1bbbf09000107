"""zeropp's own files for a universal checkpoint (Note [universal checkpoints] in ``universal.py``): data, never code.

One directory, any name::

    OUT/
      universal.json              the metadata (JSON), sealed by its own SHA-256
      params/<name>.safetensors   one per parameter: tensors "fp32" and its optimizer states ("exp_avg", "exp_avg_sq",
                                  "step" as a 0-dim tensor), the parameter's name in the file's metadata
      extra.safetensors           the buffers, the client state and a client schedule's state dict (a safe_io tree)

``universal.json`` holds ``format`` ("zeropp-universal"), ``format_version`` (1), the zeropp and torch versions, and
what :class:`~zeropp.checkpoint.universal.Universal` holds beside the tensors: one entry per parameter (name, shape,
optimizer group or null, state keys, trimmed rows, file, size, SHA-256), the groups' settings, the optimizer's state
layout, the schedule's position, the global step, the loss scale, tied aliases, the state-dict keys, the compute
dtype, the saving run's config and world size; the extra file's size and SHA-256; and ``universal_sha256``, the
SHA-256 of its own canonical JSON without that key. A parameter file whose name would not be a plain file name
(``[A-Za-z0-9_.-]``) is called ``params/_<index>.safetensors``.

Reading checks the metadata (its format, version, every key a reader uses, its own digest) when it opens the
directory, and each file's size and SHA-256 right before that file is parsed (Note [data, not code] in
``safe_io.py``): a missing, truncated or altered file is an :class:`IntegrityError` naming it. Any safetensors
reader opens the parameter files (``safetensors.torch.load_file``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Optional

import torch

from zeropp._version import __version__
from zeropp.checkpoint.format import (
    CheckpointError, IntegrityError, Written, atomic_write, atomic_write_text, fsync_dir, rename_into_place,
    sha256_file,
)
from zeropp.checkpoint.safe_io import decode, encode, read_tree, write_tree
from zeropp.checkpoint.engine_state import What
from zeropp.checkpoint.universal import (
    ParamValues, Universal, UniversalParam, from_checkpoint, load_universal,
)
from zeropp.zero.state import EngineHandle

UNIVERSAL_FILE = "universal.json"
FORMAT_NAME = "zeropp-universal"
UNIVERSAL_VERSION = 1
_DIGEST = "universal_sha256"
_EXTRA = "extra.safetensors"
_PLAIN = re.compile(r"[A-Za-z0-9_.-]+")


def is_universal_dir(folder: str) -> bool:
    """Whether ``folder`` holds zeropp's universal files."""
    return os.path.isfile(os.path.join(folder, UNIVERSAL_FILE))


def _digest(raw: dict) -> str:
    body = {k: v for k, v in raw.items() if k != _DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_of(index: int, name: str) -> str:
    plain = _PLAIN.fullmatch(name) is not None and name not in (".", "..") and not name.startswith("_")
    return f"params/{name if plain else f'_{index}'}.safetensors"


def _plain(value: Any, where: str) -> Any:
    """``value`` (plain data, no tensors) as JSON through safe_io's encoding, so tuples stay tuples."""
    data, tensors = encode(value, where)
    if tensors:
        raise CheckpointError(f"{where} holds tensors ({sorted(tensors)[:3]}); it must be plain data")
    return data


# ---- writing ------------------------------------------------------------------------------------------------------
def write_universal(uc: Universal, out_dir: str) -> str:
    """Write ``uc`` as zeropp's universal files into ``out_dir`` (replaced whole if it exists); returns its path.

    Files go to a hidden directory beside ``out_dir``, renamed into place once all are written, so ``out_dir`` is
    either the old checkpoint or the whole new one.
    """
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    nonce = os.urandom(6).hex()
    tmp = os.path.join(parent, f".{name}.tmp-{nonce}")
    os.makedirs(os.path.join(tmp, "params"))
    try:
        entries = []
        for i, p in enumerate(uc.params):
            values = uc.read(p, True)
            tree = {"name": p.name, "fp32": values.fp32.detach().float().contiguous(),
                    **{k: v.detach().contiguous() for k, v in values.state.items() if k != "fp32"}}
            rel = _file_of(i, p.name)
            w = atomic_write(os.path.join(tmp, rel), lambda f, t=tree: write_tree(f, t, f"parameter {p.name}"))
            entries.append({"name": p.name, "shape": list(p.shape), "group": p.group, "state_keys": list(p.state_keys),
                            "rows_trimmed": p.rows_trimmed, "file": rel, "bytes": w.size, "sha256": w.sha256})
        extra_tree = {"buffers": dict(uc.buffers), "client_state": uc.client_state,
                      "scheduler_state": uc.scheduler_state}
        extra = atomic_write(os.path.join(tmp, _EXTRA), lambda f: write_tree(f, extra_tree, "universal checkpoint"))
        raw = _metadata(uc, entries, extra)
        atomic_write_text(os.path.join(tmp, UNIVERSAL_FILE), json.dumps({**raw, _DIGEST: _digest(raw)}, indent=1))
        fsync_dir(tmp)
        rename_into_place(tmp, out_dir, os.path.join(parent, f".{name}.old-{nonce}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(os.path.join(parent, f".{name}.old-{nonce}"), ignore_errors=True)
    fsync_dir(parent)
    return out_dir


def _metadata(uc: Universal, entries: list[dict], extra: Written) -> dict:
    return {
        "format": FORMAT_NAME, "format_version": UNIVERSAL_VERSION, "zeropp_version": __version__,
        "torch_version": torch.__version__, "created_unix": time.time(),
        "params": entries, "groups": _plain(uc.groups, "optimizer groups"), "optimizer": uc.optimizer,
        "scheduler_steps": uc.scheduler_steps, "global_steps": int(uc.global_steps), "loss_scale": uc.loss_scale,
        "aliases": dict(uc.aliases), "state_dict_keys": list(uc.state_dict_keys), "compute_dtype": uc.compute_dtype,
        "config": _plain(uc.config, "config"), "world_size": uc.world_size,
        "extra": {"file": _EXTRA, "bytes": extra.size, "sha256": extra.sha256},
    }


# ---- reading ------------------------------------------------------------------------------------------------------
def _bad(path: str, what: str) -> IntegrityError:
    return IntegrityError(f"universal checkpoint {path}: {what}", file=UNIVERSAL_FILE, problem="invalid manifest")


def _metadata_of(folder: str) -> dict:
    path = os.path.join(folder, UNIVERSAL_FILE)
    if not os.path.isfile(path):
        raise IntegrityError(f"universal checkpoint {folder}: no {UNIVERSAL_FILE}", file=UNIVERSAL_FILE,
                             problem="missing")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as err:
        raise _bad(path, f"not JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise _bad(path, f"'format' is not {FORMAT_NAME!r}")
    version = raw.get("format_version")
    if not isinstance(version, int) or version > UNIVERSAL_VERSION:
        raise CheckpointError(f"universal checkpoint {path}: format_version {version!r}; this zeropp reads up to "
                              f"{UNIVERSAL_VERSION}: upgrade zeropp")
    if raw.get(_DIGEST) != _digest(raw):
        raise _bad(path, f"its {_DIGEST} does not match its content (edited or damaged)")
    _check_schema(raw, path)
    return raw


def _check_schema(raw: dict, path: str) -> None:
    """Every key a reader uses has the type it needs, so a bad entry is named here and never fails later."""
    def need(ok: bool, key: str, want: str) -> None:
        if not ok:
            raise _bad(path, f"key {key!r} must be {want}")

    need(isinstance(raw.get("params"), list), "params", "a list")
    need(isinstance(raw.get("groups"), list), "groups", "a list")
    need(isinstance(raw.get("global_steps"), int), "global_steps", "an integer")
    need(isinstance(raw.get("extra"), dict), "extra", "an object")
    for i, e in enumerate(raw["params"]):
        where = f"params[{i}]"
        need(isinstance(e, dict) and isinstance(e.get("name"), str), f"{where}.name", "a string")
        need(isinstance(e.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in e["shape"]),
             f"{where}.shape", "a list of integers >= 0")
        need(e.get("group") is None or (isinstance(e["group"], int) and 0 <= e["group"] < len(raw["groups"])),
             f"{where}.group", f"null or an index below {len(raw['groups'])}")
        need(isinstance(e.get("state_keys"), list) and all(isinstance(k, str) for k in e["state_keys"]),
             f"{where}.state_keys", "a list of strings")
        _check_file(e, where, need)
    _check_file(raw["extra"], "extra", need)


def _check_file(e: dict, where: str, need: Any) -> None:
    rel = e.get("file")
    need(isinstance(rel, str) and not os.path.isabs(rel) and ".." not in rel.split("/"), f"{where}.file",
         "a relative file name inside the checkpoint")
    need(isinstance(e.get("bytes"), int) and e["bytes"] >= 0, f"{where}.bytes", "an integer >= 0")
    need(isinstance(e.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", e["sha256"]) is not None,
         f"{where}.sha256", "a SHA-256 in hex")


def _open_checked(folder: str, e: dict) -> Any:
    """The tree in file ``e`` once its size and SHA-256 are the recorded ones (Note [data, not code])."""
    path = os.path.join(folder, e["file"])
    name = e["file"]
    if not os.path.isfile(path):
        raise IntegrityError(f"universal checkpoint file missing: {path}", file=name, problem="missing")
    size = os.path.getsize(path)
    if size != e["bytes"]:
        raise IntegrityError(f"universal checkpoint file {path} has {size} bytes, {e['bytes']} recorded",
                             file=name, problem="truncated" if size < e["bytes"] else "longer than recorded")
    digest = sha256_file(path)
    if digest != e["sha256"]:
        raise IntegrityError(f"universal checkpoint file corrupted: {path} has SHA-256 {digest}, {e['sha256']} "
                             "recorded", file=name, problem="checksum mismatch")
    return read_tree(path, fail=lambda why: IntegrityError(f"cannot read {path}: {why}", file=name,
                                                           problem="unreadable"))


def read_universal(folder: str) -> Universal:
    """Open zeropp's universal files in ``folder``: the metadata and the extra file now, each parameter's file when
    :attr:`Universal.read` asks for it."""
    folder = os.path.abspath(folder)
    raw = _metadata_of(folder)
    extra = _open_checked(folder, raw["extra"])
    if not isinstance(extra, dict):
        raise IntegrityError(f"universal checkpoint {folder}: {_EXTRA} holds no tree", file=_EXTRA,
                             problem="unreadable")
    params = [UniversalParam(e["name"], tuple(e["shape"]), e["group"], tuple(e["state_keys"]),
                             bool(e.get("rows_trimmed", False))) for e in raw["params"]]
    files = {e["name"]: e for e in raw["params"]}

    def read(p: UniversalParam, with_state: bool) -> ParamValues:
        tree = _open_checked(folder, files[p.name])
        if not isinstance(tree, dict) or not isinstance(tree.get("fp32"), torch.Tensor) or tree.get("name") != p.name:
            raise IntegrityError(f"universal checkpoint file {os.path.join(folder, files[p.name]['file'])} does not "
                                 f"hold parameter {p.name}'s fp32 value", file=files[p.name]["file"],
                                 problem="unreadable")
        state = {k: v for k, v in tree.items() if k not in ("name", "fp32") and isinstance(v, torch.Tensor)}
        return ParamValues(tree["fp32"], state if with_state else {})

    return Universal(
        path=folder, params=params, read=read, groups=decode(raw["groups"], {}), optimizer=raw.get("optimizer"),
        scheduler_steps=raw.get("scheduler_steps"), scheduler_state=extra.get("scheduler_state"),
        global_steps=raw["global_steps"], loss_scale=raw.get("loss_scale"), buffers=dict(extra.get("buffers") or {}),
        client_state=extra.get("client_state"), aliases=dict(raw.get("aliases") or {}),
        state_dict_keys=list(raw.get("state_dict_keys") or []), compute_dtype=raw.get("compute_dtype"),
        config=decode(raw.get("config"), {}), world_size=raw.get("world_size"))


def to_universal(ckpt_dir: str, out_dir: str, tag: Optional[str] = None, drop_unsupported: bool = False) -> str:
    """Write zeropp checkpoint ``ckpt_dir`` (tag ``tag``, default ``latest``) as zeropp's universal files in
    ``out_dir``; returns ``out_dir``. Needs no process group."""
    return write_universal(from_checkpoint(ckpt_dir, tag, drop_unsupported), out_dir)


def load_universal_dir(engine: EngineHandle, folder: str, what: What = What()) -> tuple[str, Any]:
    """Restore ``engine`` from zeropp's universal files in ``folder`` (every rank calls; any world size and stage)."""
    return load_universal(engine, lambda: read_universal(folder), what)
