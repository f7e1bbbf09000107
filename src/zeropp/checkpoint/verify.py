"""A tag's files checked against its manifest (Note [checkpoint verification] in ``format.py``).

- :func:`file_problems` / :func:`check_files`: every recorded shard file is present with its recorded
  size, and no other ``shard_*`` file sits in the tag directory (one ``stat`` per file and a ``listdir``).
  The engine's load runs it on rank 0 only, and the agreement tells the others (Note [one outcome for all
  ranks]); every rank checks what it opens anyway, so the world's ranks make O(world) stats, not O(world²);
- :func:`verify_shard`: one file's size and SHA-256, what a rank checks of each file it is about to read;
- :func:`open_shard`: verify, read (as data: Note [data, not code] in ``safe_io.py``), then check that the payload belongs where the manifest puts it
  (the save's nonce, the rank, the world size);
- :func:`verify_checkpoint` / :func:`verify_report`: all of it for a whole tag plus the ``latest`` pointer,
  without a process group (``zeropp verify-checkpoint``).
"""
from __future__ import annotations

import os
import stat
import warnings
from dataclasses import dataclass, field
from typing import Optional

from zeropp.checkpoint.format import (
    LATEST, SHARD_PREFIX, CheckpointError, CheckpointWarning, IntegrityError, list_tags, load_shard,
    resolve_tag_dir, sha256_file,
)
from zeropp.checkpoint.manifest import Manifest, read_manifest
from zeropp.checkpoint.resolve import follow_latest


def _size_problem(manifest: Manifest, rank: int) -> Optional[IntegrityError]:
    rec = manifest.shards[rank]
    path = manifest.shard_path(rank)
    try:
        st = os.stat(path)  # one stat: a shared file system pays a round trip for each
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        return IntegrityError(f"shard file missing: {path} (rank {rank} of {manifest.world_size})",
                              file=rec.file, problem="missing")
    size = st.st_size
    if size != rec.bytes:
        kind = "truncated" if size < rec.bytes else "longer than recorded"
        return IntegrityError(f"shard file {kind}: {path} is {size} bytes, the manifest {manifest.path} "
                              f"recorded {rec.bytes}", file=rec.file, problem=kind)
    return None


def file_problems(manifest: Manifest) -> list[IntegrityError]:
    """Missing or resized shard files, and unexpected ones (a ``shard_*`` name the manifest does not record)."""
    out = [p for p in (_size_problem(manifest, r) for r in range(manifest.world_size)) if p is not None]
    expected = {rec.file for rec in manifest.shards}
    world = manifest.world_size
    for name in sorted(os.listdir(manifest.tag_dir)):
        if name.startswith(SHARD_PREFIX) and name not in expected:
            out.append(IntegrityError(
                f"unexpected shard file {os.path.join(manifest.tag_dir, name)}: {manifest.path} records {world} "
                f"shard file(s), {manifest.shards[0].file} to {manifest.shards[-1].file}", file=name,
                problem="unexpected"))
    return out


def check_files(manifest: Manifest) -> None:
    """Raise the first of :func:`file_problems`, if any."""
    problems = file_problems(manifest)
    if problems:
        raise problems[0]


def verify_shard(manifest: Manifest, rank: int) -> None:
    """Check the size and (from format version 2) the SHA-256 of rank ``rank``'s shard file."""
    problem = _size_problem(manifest, rank)
    if problem is not None:
        raise problem
    rec, path = manifest.shards[rank], manifest.shard_path(rank)
    if rec.sha256 is None:  # version 1: sizes only (read_manifest warned)
        return
    try:
        digest = sha256_file(path)
    except OSError as err:
        raise IntegrityError(f"cannot read shard file {path}: {err}", file=rec.file, problem="unreadable") from err
    if digest != rec.sha256:
        raise IntegrityError(
            f"shard file corrupted: {path} has SHA-256 {digest[:16]}..., the manifest {manifest.path} recorded "
            f"{rec.sha256[:16]}... (changed after the save, or copied from another checkpoint)",
            file=rec.file, problem="checksum mismatch")


def open_shard(manifest: Manifest, rank: int, mmap: bool = False) -> dict:
    """Rank ``rank``'s shard, read only after :func:`verify_shard`, and checked to belong to this save."""
    verify_shard(manifest, rank)
    path = manifest.shard_path(rank)
    shard = load_shard(path, mmap=mmap)
    name = os.path.basename(path)
    if manifest.nonce is not None and shard.get("nonce") != manifest.nonce:
        raise IntegrityError(f"shard file {path} was written by another save (nonce {shard.get('nonce')!r}) than "
                             f"{manifest.path} (nonce {manifest.nonce!r})", file=name, problem="from another save")
    if shard.get("rank") != rank or shard.get("world_size") != manifest.world_size:
        raise IntegrityError(f"shard file {path} holds rank {shard.get('rank')!r} of {shard.get('world_size')!r}, "
                             f"but {manifest.path} places it as rank {rank} of {manifest.world_size}",
                             file=name, problem="from another save")
    for key in ("params", "optimizer", "counters"):
        if not isinstance(shard.get(key), dict):
            raise IntegrityError(f"shard file {path} has no '{key}' dictionary", file=name, problem="unreadable")
    # what every reader indexes without asking, checked here so that a forged shard fails before any reader
    # (a KeyError after the agreement would leave the engine half loaded)
    for part, key, kind in (("optimizer", "state", dict), ("optimizer", "param_groups", list),
                            ("counters", "micro_steps", int), ("counters", "global_steps", int)):
        if not isinstance(shard[part].get(key), kind):
            raise IntegrityError(f"shard file {path} has no {kind.__name__} '{part}.{key}'", file=name,
                                 problem="unreadable")
    if not isinstance(shard.get("buffers", {}), dict):
        raise IntegrityError(f"shard file {path} has no 'buffers' dictionary", file=name, problem="unreadable")
    return shard


# ---- the offline check -----------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    """What :func:`verify_report` found: ``problems`` (the checkpoint is not valid) and ``notes`` (it is, but
    the reader should know), with the tag checked and how many shard files and bytes were hashed."""

    load_dir: str
    tag: Optional[str] = None
    version: Optional[int] = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        where = f"{self.load_dir} tag '{self.tag}'" if self.tag else self.load_dir
        if not self.ok:
            return f"INVALID: {where}: {len(self.problems)} problem(s)"
        checked = "sizes (format version 1 has no checksums)" if self.version == 1 else "sizes and SHA-256"
        return f"OK: {where}: manifest valid, {self.files} shard file(s), {self.bytes} bytes, {checked} match"


def verify_checkpoint(load_dir: str, tag: Optional[str] = None) -> list[str]:
    """The problems of tag ``tag`` (default: the one ``latest`` names) of ``load_dir``; empty when valid."""
    return verify_report(load_dir, tag).problems


def verify_report(load_dir: str, tag: Optional[str] = None) -> VerifyReport:
    """Check a checkpoint without a process group: the ``latest`` pointer, the manifest (schema and its own
    SHA-256), every shard file's presence, size and SHA-256, and no unexpected shard file. Reads every byte
    of the tag once; never unpickles anything."""
    rep = VerifyReport(load_dir, tag)
    if not os.path.isdir(load_dir):
        rep.problems.append(f"checkpoint directory not found: {load_dir}")
        return rep
    latest = follow_latest(load_dir)  # what a tag=None load starts from (resolve.candidates)
    latest_bad = latest.tag is not None and latest.tag_dir is None
    if latest_bad:
        rep.problems.append(f"'{LATEST}' names tag '{latest.tag}', which is not there: {latest.problem}")
    elif latest.tag is None and (tag is None or os.path.exists(os.path.join(load_dir, LATEST))):
        rep.problems.append(f"{latest.problem} (tags present: {list_tags(load_dir) or 'none'})")
    rep.tag = tag if tag is not None else latest.tag
    if rep.tag is not None and not (latest_bad and rep.tag == latest.tag):
        try:
            _verify_tag(rep, resolve_tag_dir(load_dir, rep.tag)[1])
        except CheckpointError as err:  # a tag that is not there, or not a tag name
            rep.problems.append(str(err))
    rep.notes += [_leftover_note(load_dir, d) for d in sorted(os.listdir(load_dir))
                  if d.startswith(".") and (".tmp-" in d or ".old-" in d)]
    return rep


def _leftover_note(load_dir: str, name: str) -> str:
    path = os.path.join(load_dir, name)
    if ".tmp-" in name:
        return f"leftover of an interrupted save (ignored by loads): {path}"
    tag = name[1:].rsplit(".old-", 1)[0]
    return (f"leftover of an interrupted re-save of tag '{tag}' (a load of tag '{tag}' reads it while "
            f"{os.path.join(load_dir, tag)} is missing; the next save of '{tag}' deletes it): {path}")


def _verify_tag(rep: VerifyReport, tag_dir: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            manifest = read_manifest(tag_dir)
        except CheckpointError as err:
            rep.problems.append(str(err))
            return
    rep.notes += [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    rep.version = manifest.version
    problems = file_problems(manifest)
    rep.problems += [str(p) for p in problems]
    skip = {p.file for p in problems}
    for rec in manifest.shards:
        if rec.file in skip:
            continue
        try:
            verify_shard(manifest, rec.rank)
        except IntegrityError as err:
            rep.problems.append(str(err))
            continue
        rep.files += 1
        rep.bytes += rec.bytes
