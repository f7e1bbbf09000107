"""The on-disk checkpoint format: directory layout, the manifest, tag resolution and atomic file writes.

Pure file I/O: nothing here touches ``torch.distributed``, so consolidation can run on a laptop.

A checkpoint directory ``save_dir`` holds one directory per tag and a ``latest`` file naming the newest::

    save_dir/
      latest                      # text: the tag written last (written only once that tag is complete)
      global_step20/
        manifest.json             # rank 0: format version, config, topology, parameters and shard layout
        shard_rank00000.pt        # rank r: fp32 master chunks, optimizer/scheduler state, counters, RNG
        shard_rank00001.pt
        ...

Note [checkpoint atomicity]: a tag is written into ``save_dir/.<tag>.tmp-<nonce>`` (a hidden name, one
nonce per save shared by all ranks); each file in it is written to ``<name>.tmp-<pid>``, fsync'd and
renamed. After every rank reports success, rank 0 records every shard's size in the manifest (written the
same way), fsyncs the directory and renames it to ``save_dir/<tag>`` — one ``rename(2)``, atomic on a
POSIX file system — then fsyncs ``save_dir`` and only then replaces ``latest`` (temporary file, fsync,
rename). A crash at any point before the directory rename leaves only a hidden temporary directory;
before the ``latest`` rename, a complete new tag that ``latest`` does not name yet. Either way the previous
tag is untouched and ``latest`` still names it. Re-saving an existing tag first renames the old directory
aside to ``save_dir/.<tag>.old-<nonce>`` and deletes it after the new one is in place; should a crash fall
between those two renames, loading that tag finds the aside copy (see :func:`resolve_tag_dir`). A later
successful save of a tag deletes that tag's leftovers (aside copies, torn temporary directories).
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CRASH_ENV = "ZEROPP_CKPT_TEST_CRASH"  # test-only: "<point>:<rank>" SIGKILLs that rank at that point


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model; the message names the file or parameter."""


def shard_name(rank: int) -> str:
    return f"shard_rank{rank:05d}.pt"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain, non-hidden directory name")
    return tag


def list_tags(save_dir: str) -> list[str]:
    """The complete tags in ``save_dir`` (directories with a manifest), sorted by name."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(d for d in os.listdir(save_dir)
                  if not d.startswith(".") and os.path.isfile(os.path.join(save_dir, d, MANIFEST)))


# ---- atomic writes ---------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_replace(path: str, produce: Callable[[str], None]) -> int:
    """``produce(tmp)`` writes a temporary file beside ``path``; it is fsync'd and renamed over ``path`` (and
    the directory fsync'd), so ``path`` is either the old file or the whole new one. Returns its size."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        produce(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return os.path.getsize(path)


def atomic_write(path: str, write: Callable[[BinaryIO], None], crash_point: Optional[str] = None,
                 rank: int = 0) -> int:
    """:func:`atomic_replace` through ``write(file)``; ``crash_point`` arms the test-only mid-write kill."""
    def produce(tmp: str) -> None:
        with open(tmp, "wb") as raw:
            f = _KillMidWrite(raw) if crash_point and _crash_armed(crash_point, rank) else raw
            write(f)  # type: ignore[arg-type]

    return atomic_replace(path, produce)


def atomic_write_text(path: str, text: str) -> int:
    return atomic_write(path, lambda f: f.write(text.encode()))


# ---- test-only crash points ------------------------------------------------------------------------------
def _crash_armed(point: str, rank: int) -> bool:
    want = os.environ.get(CRASH_ENV, "")
    return bool(want) and want == f"{point}:{rank}"


def crash_point(point: str, rank: int) -> None:
    """Test hook: SIGKILL this process here when ``ZEROPP_CKPT_TEST_CRASH`` is ``<point>:<rank>``."""
    if _crash_armed(point, rank):
        os.kill(os.getpid(), signal.SIGKILL)


class _KillMidWrite:
    """A file wrapper that SIGKILLs the process once a few writes have reached the disk (a torn file)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.writes = raw, 0

    def write(self, data: Any) -> int:
        n = self.raw.write(data)
        self.writes += 1
        if self.writes == 3:
            self.raw.flush()
            os.fsync(self.raw.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


# ---- reading ---------------------------------------------------------------------------------------------
def resolve_tag_dir(load_dir: str, tag: Optional[str]) -> tuple[str, str]:
    """``(tag, directory)`` of the checkpoint to load: ``tag``, or the one ``load_dir/latest`` names."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory not found: {load_dir}")
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"no tag given and no '{LATEST}' file found: looked for {latest} "
                                  f"(tags present: {list_tags(load_dir) or 'none'})")
        with open(latest) as f:
            tag = f.read().strip()
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return tag, path
    aside = sorted(d for d in os.listdir(load_dir) if d.startswith(f".{tag}.old-"))
    if aside:  # a crash fell between the two renames of a re-save (Note [checkpoint atomicity])
        return tag, os.path.join(load_dir, aside[-1])
    raise CheckpointError(f"checkpoint tag '{tag}' not found: looked for directory {path} "
                          f"(tags present: {list_tags(load_dir) or 'none'})")


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
class Manifest:
    """The parsed ``manifest.json`` of one tag."""

    path: str
    raw: dict

    @property
    def world_size(self) -> int:
        return int(self.raw["topology"]["world_size"])

    @property
    def params(self) -> list[ParamEntry]:
        return [ParamEntry(p["name"], tuple(p["aliases"]), tuple(p["shape"]), p["numel"], p["unit"],
                           p["chunk"], p["world"], p["optimizer_index"]) for p in self.raw["params"]]

    @property
    def state_dict_keys(self) -> list[dict]:
        return self.raw["state_dict_keys"]

    def shard_path(self, rank: int) -> str:
        return os.path.join(os.path.dirname(self.path), self.raw["shards"][rank]["file"])

    def check_shards(self) -> None:
        """Every shard file exists and has the size the manifest recorded (a torn copy is named)."""
        for rank, shard in enumerate(self.raw["shards"]):
            path = self.shard_path(rank)
            if not os.path.isfile(path):
                raise CheckpointError(f"shard file missing: {path} (rank {rank} of {self.world_size})")
            size = os.path.getsize(path)
            if size != shard["bytes"]:
                raise CheckpointError(f"shard file truncated or altered: {path} is {size} bytes, the manifest "
                                      f"recorded {shard['bytes']}")


def read_manifest(tag_dir: str) -> Manifest:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint manifest missing: {path}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read checkpoint manifest {path}: {err}") from err
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"{path} is not a zeropp checkpoint manifest (no integer format_version)")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version}, newer than this zeropp reads "
            f"(up to {FORMAT_VERSION}; written by zeropp {raw.get('zeropp_version', '?')}): upgrade zeropp")
    return Manifest(path, raw)


def load_shard(path: str, mmap: bool = False) -> dict:
    """Read one shard file, naming it in the error when it cannot be read (zeropp's own pickles: trusted)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as err:  # a torn zip, a bad pickle, an I/O error: all name the file
        raise CheckpointError(f"cannot read shard file {path}: {type(err).__name__}: {err}") from err
