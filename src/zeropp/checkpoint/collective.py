"""What the ranks of a save or load agree on, in one small all-reduce each time.

Note [one outcome for all ranks]: a checkpoint call either succeeds on every rank or fails on every rank;
one rank raising while the others enter the next collective would hang them. So after each step that can
fail (writing the shards, publishing, reading a tag) every rank contributes one row of integers —
failed?, an :class:`IntegrityError`?, the problem, the file, the errno — to an all-reduce over the world
(each rank fills only its own row of a zero table, so the sum is an all-gather). A rank that failed raises
its own error — as a :class:`CheckpointError` whatever it was (an ``OSError``, a ``KeyError``), chained from
it — and every other rank raises one built from the first failing rank's row, so it too names the file and
the problem ("rank 1: .../shard_rank00001.pt: no space left on device"). The same row carries extra
integers where a step has more to share: a shard's size and SHA-256 after writing it.

:func:`agreed_load` runs the candidates of ``resolve.py`` through this agreement, so every rank falls back
past the same tag, even when only one of them read the damaged file.
"""
from __future__ import annotations

import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from zeropp.checkpoint.format import (
    LATEST, MANIFEST, CheckpointError, CheckpointWarning, IntegrityError, Written, describe_errno, shard_name,
    shard_rank_of,
)
from zeropp.checkpoint.resolve import Candidate, Outcome, candidates, no_checkpoint_reason, read_first_good, read_tag
from zeropp.comm.ledger import Phase

T = TypeVar("T")
#: the problems a row can name (CheckpointError.problem); index 0 is anything else
PROBLEMS = ("failed", "missing", "truncated", "longer than recorded", "unexpected", "checksum mismatch",
            "from another save", "unreadable", "invalid manifest", "write failed")
_HEAD = 5  # failed, integrity, problem index, file code, errno
_MANIFEST_CODE, _LATEST_CODE, _OTHER_CODE = -1, -2, -3


def exchange(engine: Any, row: Sequence[int]) -> list[list[int]]:
    """Every rank's ``row`` (same length on all ranks), in rank order: one int64 all-reduce."""
    table = torch.zeros(engine.state.topo.world_size, len(row), dtype=torch.int64)
    table[engine.state.topo.rank] = torch.tensor(list(row), dtype=torch.int64)
    engine.state.comm.all_reduce(table, engine.state.topo.world, Phase.OTHER)
    return table.tolist()


def shared_nonce(engine: Any) -> str:
    """A per-save id that rank 0 draws and every rank receives (recorded in the manifest and every shard)."""
    # os.urandom, not torch: drawing from torch's generator would change the RNG state being saved
    value = torch.tensor([int.from_bytes(os.urandom(6), "little") if engine.state.topo.rank == 0 else 0],
                         dtype=torch.int64)
    engine.state.comm.broadcast(value, 0, engine.state.topo.world, Phase.OTHER)
    return f"{int(value.item()):012x}"


def _file_code(name: Optional[str]) -> int:
    if name == MANIFEST:
        return _MANIFEST_CODE
    if name == LATEST:
        return _LATEST_CODE
    rank = shard_rank_of(name or "")
    return _OTHER_CODE if rank is None else rank


def _file_name(code: int) -> Optional[str]:
    return {_MANIFEST_CODE: MANIFEST, _LATEST_CODE: LATEST}.get(code) if code < 0 else shard_name(code)


def _row(error: Optional[BaseException]) -> list[int]:
    if error is None:
        return [0, 0, 0, _OTHER_CODE, 0]
    problem = getattr(error, "problem", None)
    code = getattr(error, "errno", 0) or 0
    return [1, int(isinstance(error, IntegrityError)), PROBLEMS.index(problem) if problem in PROBLEMS else 0,
            _file_code(getattr(error, "file", None)), int(code) if isinstance(code, int) else 0]


@dataclass(frozen=True)
class Failure:
    """An agreed failure: the failing ranks, whether all of them saw only damaged files, and the error this
    rank raises (its own, or one that names the first failing rank's file and problem)."""

    ranks: list[int]
    integrity: bool
    error: BaseException


def _as_checkpoint_error(error: BaseException, what: str, rank: int) -> CheckpointError:
    """``error`` as the :class:`CheckpointError` a failing rank raises (the others raise one anyway), chained."""
    if isinstance(error, CheckpointError):  # IntegrityError too: it keeps its class, file and problem
        return error
    code = getattr(error, "errno", 0)
    wrapped = CheckpointError(f"{what} failed on rank {rank}: {type(error).__name__}: {error}",
                              errno=code if isinstance(code, int) else 0)
    wrapped.__cause__ = error
    return wrapped


def agree_outcome(engine: Any, error: Optional[BaseException], what: str, locate: Callable[[str], str],
           extra: Sequence[int] = ()) -> tuple[Optional[Failure], list[list[int]]]:
    """Share this rank's outcome (and ``extra``); the agreed :class:`Failure`, or None, and every rank's extra."""
    rows = exchange(engine, _row(error) + list(extra))
    bad = [r for r, row in enumerate(rows) if row[0]]
    extras = [row[_HEAD:] for row in rows]
    if not bad:
        return None, extras
    integrity = all(rows[r][1] for r in bad)
    if error is not None:
        error = _as_checkpoint_error(error, what, engine.state.topo.rank)
    else:
        first = rows[bad[0]]
        name = _file_name(first[3])
        problem = describe_errno(first[4]) if first[4] else PROBLEMS[first[2]]
        detail = f"{locate(name)}: {problem}" if name else f"{problem} (its error names the cause)"
        kind = IntegrityError if integrity else CheckpointError
        error = kind(f"{what} failed on rank(s) {bad}; rank {bad[0]}: {detail}", file=name,
                     problem=PROBLEMS[first[2]], errno=first[4])
    return Failure(bad, integrity, error), extras


def agree(engine: Any, error: Optional[BaseException], what: str,
          locate: Callable[[str], str] = lambda name: name, extra: Sequence[int] = ()) -> list[list[int]]:
    """Raise on every rank if any rank failed (Note [one outcome for all ranks]); else every rank's extra."""
    failure, extras = agree_outcome(engine, error, what, locate, extra)
    if failure is not None:
        raise failure.error
    return extras


# ---- a shard's size and digest, travelling in the agreement row ------------------------------------------
def written_row(written: Optional[Written]) -> list[int]:
    """``[size, d0, d1, d2, d3]``: the SHA-256 as four int64 (zeros when nothing was written)."""
    if written is None:
        return [0] * 5
    return [written.size, *struct.unpack("<4q", bytes.fromhex(written.sha256))]


def written_of(row: Sequence[int]) -> Written:
    return Written(int(row[0]), struct.pack("<4q", *(int(v) for v in row[1:5])).hex())


# ---- the load every rank agrees on -----------------------------------------------------------------------
def _outcome_on_every_rank(engine: Any, what: str, falls_back: bool = True) -> Outcome:
    """``resolve``'s :data:`Outcome` through the agreement: every rank acts on the same outcome of the same tag
    (``falls_back``: a ``tag=None`` load, where an :class:`IntegrityError` means "skip this tag")."""

    def outcome_of(error: Optional[BaseException], cand: Candidate) -> Optional[BaseException]:
        failure, extras = agree_outcome(engine, error, what, lambda name: os.path.join(cand.tag_dir, name),
                                 [zlib.crc32(cand.tag.encode())])
        if any(e != extras[0] for e in extras):  # the fall back's order comes from each rank's own reads
            raise CheckpointError(f"{what}: the ranks tried different tags at once in {os.path.dirname(cand.tag_dir)}: "
                                  "it must be one file system that every rank sees")
        if failure is None:
            return None
        if falls_back and isinstance(failure.error, IntegrityError) and not failure.integrity:
            # this rank saw damage, another a problem no fall back may hide: raise here too, never skip alone
            plain = CheckpointError(str(failure.error), file=failure.error.file, problem=failure.error.problem,
                                    errno=failure.error.errno)
            plain.__cause__ = failure.error
            return plain
        return failure.error

    return outcome_of


def agreed_load(engine: Any, load_dir: str, tag: Optional[str], read: Callable[[str], T],
                what: str = "loading the checkpoint") -> Optional[tuple[str, T]]:
    """``(tag_dir, read(tag_dir))`` on every rank, for tag ``tag`` or the first ``tag=None`` candidate that
    every rank reads without an :class:`IntegrityError` (``resolve.py``); None, with a warning, when
    ``load_dir`` is missing or holds no complete tag (DeepSpeed's resume idiom). Raises on every rank."""
    if tag is not None:
        cand, result = read_tag(load_dir, tag, read, _outcome_on_every_rank(engine, what, falls_back=False))
        return cand.tag_dir, result
    found = candidates(load_dir)
    view = found.fingerprint().encode()
    seen = exchange(engine, [len(found), zlib.crc32(view)])
    if any(row != seen[0] for row in seen):
        raise CheckpointError(f"{what}: the ranks see different tags in {load_dir} ({[r[0] for r in seen]} tags): "
                              "it must be one file system that every rank sees")
    if not found:
        warnings.warn(f"zeropp: no checkpoint to resume from: {no_checkpoint_reason(found)}; load_checkpoint "
                      "returns (None, None)", CheckpointWarning, stacklevel=3)
        return None
    cand, result = read_first_good(found, read, _outcome_on_every_rank(engine, what))
    return cand.tag_dir, result
