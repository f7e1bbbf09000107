"""Which tag a load reads: the one asked for, or ``latest`` with a fall back to older complete tags.

An explicit tag is read as it is and any error is raised. With ``tag=None`` the candidates are, in order,
the tag ``latest`` names and then every other complete tag (a directory with a manifest), newest save
first (the manifest's ``created_unix``). A candidate that fails verification (:class:`IntegrityError`:
a damaged, missing or mixed-up file) is skipped, and the load that succeeds warns naming every tag it
skipped and why. Any other error (the model does not fit, a newer format) is raised at once: falling back
would only hide it. ``latest`` itself never names an incomplete tag (Note [checkpoint atomicity]); the fall
back covers what happens to files after the save: a corrupted shard, a deleted tag, a lost ``latest``.

The single-process readers use :func:`read_with_fallback`; the engine runs the same candidates through an
agreement of all ranks (``collective.agreed_load``), since a damaged file may be seen by one rank only.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

from zeropp.checkpoint.format import (
    MANIFEST, CheckpointError, CheckpointWarning, IntegrityError, list_tags, read_latest, resolve_tag_dir,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """A tag a ``tag=None`` load may read, with the directory to read it from."""

    tag: str
    tag_dir: str


@dataclass
class Candidates:
    """The tags to try in order, and what was passed over before reading anything (``latest`` problems)."""

    load_dir: str
    tags: list[Candidate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        """The list as text, for checking that every rank sees the same one."""
        return "\n".join(c.tag for c in self.tags)


def _created(tag_dir: str) -> float:
    """When the tag was saved: the manifest's ``created_unix``, else the manifest file's mtime."""
    path = os.path.join(tag_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8")).get("created_unix")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return float(value)
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def candidates(load_dir: str) -> Candidates:
    """The tags a ``tag=None`` load of ``load_dir`` tries, in order (empty when it holds no checkpoint)."""
    out = Candidates(load_dir)
    if not os.path.isdir(load_dir):
        return out
    latest, why = read_latest(load_dir)
    if latest is not None:
        try:
            out.tags.append(Candidate(latest, resolve_tag_dir(load_dir, latest)[1]))
        except CheckpointError as err:
            out.notes.append(f"'latest' names '{latest}', which is not there ({err})")
    else:
        out.notes.append(str(why))
    others = [t for t in list_tags(load_dir) if t != latest]
    others.sort(key=lambda t: (_created(os.path.join(load_dir, t)), t), reverse=True)
    out.tags += [Candidate(t, os.path.join(load_dir, t)) for t in others]
    return out


def no_checkpoint_reason(found: Candidates) -> str:
    """Why ``found`` holds nothing to load, in one phrase."""
    if not os.path.isdir(found.load_dir):
        return f"directory {found.load_dir} does not exist"
    notes = "; ".join(found.notes)
    return f"{found.load_dir} holds no complete tag" + (f" ({notes})" if notes else "")


def fallback_warning(load_dir: str, loaded: Candidate, skipped: list[str]) -> str:
    """The one line a load that fell back warns: what it loaded, what it passed over and why."""
    return f"checkpoint {load_dir}: fell back to tag '{loaded.tag}': " + "; ".join(skipped)


def read_with_fallback(load_dir: str, tag: Optional[str], read: Callable[[str], T]) -> tuple[Candidate, T]:
    """``read(tag_dir)`` of tag ``tag``, or with ``tag=None`` of the first candidate that passes verification.

    Raises :class:`CheckpointError` when there is nothing to read, and :class:`IntegrityError` listing every
    candidate's problem when all fail verification.
    """
    if tag is not None:
        tag, tag_dir = resolve_tag_dir(load_dir, tag)
        return Candidate(tag, tag_dir), read(tag_dir)
    found = candidates(load_dir)
    if not found.tags:
        raise CheckpointError(f"no checkpoint to load: {no_checkpoint_reason(found)}")
    skipped = list(found.notes)
    for cand in found.tags:
        try:
            result = read(cand.tag_dir)
        except IntegrityError as err:
            skipped.append(f"skipped '{cand.tag}': {err}")
            continue
        if skipped:
            warnings.warn(fallback_warning(load_dir, cand, skipped), CheckpointWarning, stacklevel=3)
        return cand, result
    raise IntegrityError(f"no loadable checkpoint in {load_dir}: " + "; ".join(skipped))
