"""``manifest.json``: its schema, its own checksum, and the parsed :class:`Manifest` the readers use.

The manifest is the one file a load trusts to describe every other, so it is checked before anything is
read through it (Note [checkpoint verification] in ``format.py``):

1. it parses as JSON and its ``format_version`` is one this zeropp reads (a newer one asks for an upgrade);
2. :func:`validate_manifest` checks every key a reader uses — types, ranges, the shard layout
   (``chunk * world >= numel``, chunks that fit in their shard file) and cross-references — and names the
   key at fault, so a manifest edited into nonsense fails here and never as a ``KeyError`` or an
   allocation of a nonsense size later on;
3. from version 2 on, ``manifest_sha256`` must equal the SHA-256 of the manifest's canonical JSON without
   that key (:func:`manifest_digest`), so an edit that still makes sense (a shape, a recorded checksum) is
   caught as well.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NoReturn, Optional

from zeropp.checkpoint.format import (
    FORMAT_VERSION, MANIFEST, CheckpointError, CheckpointWarning, IntegrityError, shard_name,
)

DIGEST_KEY = "manifest_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{1,32}")
_V2_KEYS = (DIGEST_KEY, "nonce")  # keys a version-1 manifest cannot hold (a downgraded version number)


@dataclass(frozen=True)
class ParamEntry:
    """One model parameter as the manifest records it (``chunk`` elements per rank over ``world`` ranks)."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    unit: int
    chunk: int
    world: int
    optimizer_index: Optional[int]


@dataclass(frozen=True)
class ShardRecord:
    """One shard file as the manifest records it; ``sha256`` is None in a version-1 manifest."""

    rank: int
    file: str
    bytes: int
    sha256: Optional[str]


@dataclass(frozen=True)
class Manifest:
    """The parsed, validated ``manifest.json`` of one tag.

    ``params`` and ``shards`` are parsed from ``raw`` once, on first use (readers index them per rank and per
    parameter, so rebuilding them on every access would cost O(world) each time); treat ``raw`` as read-only.
    """

    path: str
    raw: dict

    @property
    def version(self) -> int:
        return int(self.raw["format_version"])

    @property
    def tag_dir(self) -> str:
        return os.path.dirname(self.path)

    @property
    def nonce(self) -> Optional[str]:
        """The save's nonce, also stored in each of its shards (None before version 2)."""
        return self.raw.get("nonce")

    @property
    def world_size(self) -> int:
        return int(self.raw["topology"]["world_size"])

    @property
    def sharded(self) -> bool:
        """Whether the shard files cut the state over the ranks (stages 1-3); False for stage 0, where every
        file holds all of it (Note [stage 0 checkpoints] in ``engine_io.py``)."""
        return self.raw["engine"].get("stage", 3) != 0

    @cached_property
    def params(self) -> tuple[ParamEntry, ...]:
        return tuple(ParamEntry(p["name"], tuple(p["aliases"]), tuple(p["shape"]), p["numel"], p["unit"],
                                p["chunk"], p["world"], p["optimizer_index"]) for p in self.raw["params"])

    @property
    def state_dict_keys(self) -> list[dict]:
        return self.raw["state_dict_keys"]

    @property
    def excluded_frozen(self) -> frozenset[str]:
        """Frozen parameters the save left out (``exclude_frozen_parameters``): a load keeps the model's own."""
        return frozenset(self.raw.get("excluded_frozen", ()))

    @cached_property
    def shards(self) -> tuple[ShardRecord, ...]:
        return tuple(ShardRecord(s["rank"], s["file"], s["bytes"], s.get("sha256")) for s in self.raw["shards"])

    def shard_path(self, rank: int) -> str:
        return os.path.join(self.tag_dir, self.shards[rank].file)


def manifest_digest(raw: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces), leaving out its own digest key."""
    body = {k: v for k, v in raw.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(raw: dict) -> dict:
    """``raw`` with ``manifest_sha256`` set: what the writer stores."""
    return {**raw, DIGEST_KEY: manifest_digest(raw)}


def read_manifest(tag_dir: str) -> Manifest:
    """Parse and check ``tag_dir/manifest.json`` (steps 1-3 of the module docstring).

    Raises :class:`IntegrityError` for a missing, unparsable, invalid or altered manifest, and a plain
    :class:`CheckpointError` for one written by a newer zeropp. Warns (:class:`CheckpointWarning`) for a
    version-1 manifest, whose shards carry no checksums.
    """
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        raise IntegrityError(f"checkpoint manifest missing: {path}", file=MANIFEST, problem="missing")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise IntegrityError(f"cannot read checkpoint manifest {path}: {err}", file=MANIFEST,
                             problem="invalid manifest") from err
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise IntegrityError(f"{path} is not a zeropp checkpoint manifest (no integer format_version)",
                             file=MANIFEST, problem="invalid manifest")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}, newer than this zeropp reads "
            f"(up to {FORMAT_VERSION}; written by zeropp {raw.get('zeropp_version', '?')}): upgrade zeropp")
    validate_manifest(raw, path)
    if version >= 2 and raw[DIGEST_KEY] != manifest_digest(raw):
        raise IntegrityError(f"{path} was altered after the save: its content does not match its recorded "
                             f"'{DIGEST_KEY}'", file=MANIFEST, problem="invalid manifest")
    if version < 2:
        warnings.warn(f"checkpoint {path} has format version {version}: its shard files carry no checksums, so "
                      "only their sizes can be verified (save it again to upgrade)", CheckpointWarning, stacklevel=2)
    return Manifest(path, raw)


# ---- schema ----------------------------------------------------------------------------------------------
class _Schema:
    """Typed reads of a JSON value that raise :class:`IntegrityError` naming the file and the key."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> NoReturn:
        raise IntegrityError(f"{self.path}: invalid manifest: key '{key}' {problem}", file=MANIFEST,
                             problem="invalid manifest")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            self.fail(where + key, "is missing")
        return obj[key]

    def dict(self, obj: dict, key: str, where: str = "") -> dict:
        value = self.get(obj, key, where)
        if not isinstance(value, dict):
            self.fail(where + key, f"must be an object, got {_short(value)}")
        return value

    def list(self, obj: dict, key: str, where: str = "") -> list:
        value = self.get(obj, key, where)
        if not isinstance(value, list):
            self.fail(where + key, f"must be a list, got {_short(value)}")
        return value

    def int(self, obj: dict, key: str, where: str = "", low: int = 0, optional: bool = False) -> Optional[int]:
        value = self.get(obj, key, where)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            self.fail(where + key, f"must be an integer >= {low}, got {_short(value)}")
        return value

    def str(self, obj: dict, key: str, where: str = "", pattern: Optional[re.Pattern] = None,
            optional: bool = False) -> Optional[str]:
        value = self.get(obj, key, where)
        if value is None and optional:
            return None
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            self.fail(where + key, f"must be a {'matching ' if pattern else ''}string, got {_short(value)}")
        return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate_manifest(raw: Any, path: str) -> None:
    """Check every key a reader of ``raw`` (the manifest at ``path``) uses; raise naming the first bad one."""
    s = _Schema(path)
    if not isinstance(raw, dict):
        s.fail("(top level)", f"must be an object, got {_short(raw)}")
    version = s.int(raw, "format_version", low=1)
    s.str(raw, "tag")
    created = s.get(raw, "created_unix", "")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        s.fail("created_unix", f"must be a finite number, got {_short(created)}")
    engine = s.dict(raw, "engine")
    s.int(engine, "micro_steps", "engine.")
    s.int(engine, "global_steps", "engine.")
    s.int(engine, "gradient_accumulation_steps", "engine.", low=1)
    s.str(engine, "optimizer", "engine.", optional=True)
    topo = s.dict(raw, "topology")
    world = s.int(topo, "world_size", "topology.", low=1)
    for key in ("ranks_per_node", "num_nodes", "hpz_partition_size"):
        s.int(topo, key, "topology.", low=1)
    assert version is not None and world is not None
    if version >= 2:
        s.str(raw, "nonce", pattern=_NONCE)
        s.str(raw, DIGEST_KEY, pattern=_HEX64)
    else:
        for key in _V2_KEYS:
            if key in raw:
                s.fail(key, "belongs to format version 2, but format_version is 1")
    sizes = _validate_shards(s, raw, world, version)
    names = _validate_params(s, raw, world, min(sizes))
    for i, name in enumerate(raw.get("excluded_frozen", [])):
        if not isinstance(name, str) or name in names:
            s.fail(f"excluded_frozen[{i}]", f"must name a parameter the checkpoint does not hold, got {_short(name)}")
    for i, entry in enumerate(s.list(raw, "state_dict_keys")):
        where = f"state_dict_keys[{i}]."
        if not isinstance(entry, dict):
            s.fail(where[:-1], f"must be an object, got {_short(entry)}")
        s.str(entry, "key", where)
        if "param" in entry and s.str(entry, "param", where) not in names:
            s.fail(where + "param", f"names no recorded parameter: {_short(entry['param'])}")


def _validate_shards(s: _Schema, raw: dict, world: int, version: int) -> list[int]:
    """One shard per rank, named as the writer names them (no path can point outside the tag)."""
    shards = s.list(raw, "shards")
    if len(shards) != world:
        s.fail("shards", f"has {len(shards)} entries, but topology.world_size is {world}")
    sizes = []
    for rank, entry in enumerate(shards):
        where = f"shards[{rank}]."
        if not isinstance(entry, dict):
            s.fail(where[:-1], f"must be an object, got {_short(entry)}")
        if s.int(entry, "rank", where) != rank:
            s.fail(where + "rank", f"must be {rank}, got {_short(entry['rank'])}")
        if s.str(entry, "file", where) != shard_name(rank, version):
            s.fail(where + "file", f"must be {shard_name(rank, version)!r}, got {_short(entry['file'])}")
        sizes.append(s.int(entry, "bytes", where))
        if version >= 2:
            s.str(entry, "sha256", where, pattern=_HEX64)
    return sizes


def _validate_params(s: _Schema, raw: dict, world: int, smallest_shard: int) -> set[str]:
    """Each parameter's layout (Note [shard layout]) is consistent and its chunks fit in a shard file."""
    names: set[str] = set()
    positions: set[int] = set()
    chunks = 0
    for i, p in enumerate(s.list(raw, "params")):
        where = f"params[{i}]."
        if not isinstance(p, dict):
            s.fail(where[:-1], f"must be an object, got {_short(p)}")
        name = s.str(p, "name", where)
        if not name or name in names:
            s.fail(where + "name", f"must be a new, non-empty parameter name, got {_short(name)}")
        names.add(name)  # type: ignore[arg-type]
        aliases = s.list(p, "aliases", where)
        if not all(isinstance(a, str) for a in aliases):
            s.fail(where + "aliases", "must be a list of strings")
        shape = s.list(p, "shape", where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            s.fail(where + "shape", f"must be a list of integers >= 0, got {_short(shape)}")
        numel = s.int(p, "numel", where)
        if numel != math.prod(shape):
            s.fail(where + "numel", f"is {numel}, but shape {shape} holds {math.prod(shape)} elements")
        s.int(p, "unit", where)
        chunk = s.int(p, "chunk", where)
        if s.int(p, "world", where) != world:
            s.fail(where + "world", f"is {p['world']}, but topology.world_size is {world}")
        assert chunk is not None and numel is not None
        if chunk * world < numel:
            s.fail(where + "chunk", f"is {chunk}: {world} chunks cannot hold the {numel} elements")
        chunks += chunk
        index = s.int(p, "optimizer_index", where, optional=True)
        if index is not None and index in positions:
            s.fail(where + "optimizer_index", f"{index} is used by an earlier parameter too")
        if index is not None:
            positions.add(index)
    if chunks * 4 > smallest_shard:  # fp32 masters: every shard file holds at least its chunks' bytes
        s.fail("params", f"chunks need {chunks * 4} bytes of fp32 per shard, more than a recorded shard size "
                         f"({smallest_shard} bytes)")
    return names
