"""Which tag a load reads: the one asked for, or ``latest`` with a fall back to older complete tags.

An explicit tag is read as it is and any error is raised. With ``tag=None`` the candidates are, in order,
the tag ``latest`` names and then every other complete tag (a directory with a manifest), newest save
first (the manifest's ``created_unix``). A candidate that fails verification (:class:`IntegrityError`:
a damaged, missing or mixed-up file) is skipped, and the load that succeeds warns naming every tag it
skipped and why. Any other error (the model does not fit, a newer format) is raised at once: falling back
would only hide it. ``latest`` itself never names an incomplete tag (Note [checkpoint atomicity]); the fall
back covers what happens to files after the save: a corrupted shard, a deleted tag, a lost ``latest``.

One loop serves both kinds of reader: :func:`read_with_fallback` (and :func:`read_first_good`) take a
``outcome(error, candidate)`` callback that turns this process's outcome of reading a candidate into the
outcome to act on. A single process acts on its own (:func:`alone`); the engine's ranks agree first
(``collective.agreed_load``), since a damaged file may be seen by one rank only.

The other complete tags are sorted by save time only when ``latest`` fails, since that reads every
tag's manifest.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Optional, TypeVar

from zeropp.checkpoint.format import (
    LATEST, MANIFEST, CheckpointError, CheckpointWarning, IntegrityError, list_tags, read_latest, resolve_tag_dir,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """A tag a ``tag=None`` load may read, with the directory to read it from."""

    tag: str
    tag_dir: str


class Latest(NamedTuple):
    """What ``load_dir/latest`` leads to: the tag it names (None if it names none), that tag's directory
    (None if it is not there) and why it leads to nothing (None when it leads to ``tag_dir``)."""

    tag: Optional[str]
    tag_dir: Optional[str]
    problem: Optional[str]


def follow_latest(load_dir: str) -> Latest:
    """Where ``load_dir/latest`` leads (the directory may be a copy a re-save set aside: ``resolve_tag_dir``)."""
    tag, why = read_latest(load_dir)
    if tag is None:
        return Latest(None, None, why)
    try:
        return Latest(tag, resolve_tag_dir(load_dir, tag)[1], None)
    except CheckpointError as err:
        return Latest(tag, None, str(err))


@dataclass
class Candidates:
    """The tags to try in order (iterate), and what was passed over before reading anything (``latest``
    problems). ``latest`` comes first; the ``others`` are kept by name and sorted newest save first only
    when the iteration gets past ``latest``."""

    load_dir: str
    latest: Optional[Candidate] = None
    others: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.others) + (self.latest is not None)

    def __iter__(self) -> Iterator[Candidate]:
        if self.latest is not None:
            yield self.latest
        # reads every other tag's manifest: done only once `latest` failed
        newest_first = sorted(self.others, key=lambda t: (_created(os.path.join(self.load_dir, t)), t), reverse=True)
        for tag in newest_first:
            yield Candidate(tag, os.path.join(self.load_dir, tag))

    def fingerprint(self) -> str:
        """The tags as text, for checking that every rank sees the same ones (the order of the others follows
        from their manifests, which every rank reads the same; ``collective`` checks each tag tried too)."""
        return "\n".join(([self.latest.tag] if self.latest is not None else [""]) + self.others)


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
    latest = follow_latest(load_dir)
    if latest.tag_dir is not None:
        out.latest = Candidate(latest.tag, latest.tag_dir)  # type: ignore[arg-type]
    elif latest.tag is not None:
        out.notes.append(f"'{LATEST}' names '{latest.tag}', which is not there ({latest.problem})")
    else:
        out.notes.append(str(latest.problem))
    out.others = [t for t in list_tags(load_dir) if t != latest.tag]
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


# ---- reading: one loop, settled alone or by every rank together -----------------------------------------
#: ``outcome(error, candidate)``: this process's outcome of reading ``candidate`` (its exception, or None) ->
#: the error to act on (None: it was read). An :class:`IntegrityError` falls back past the candidate; any
#: other error is raised. The engine's ranks pass ``collective``'s agreement here, so that they all act alike.
Outcome = Callable[[Optional[BaseException], Candidate], Optional[BaseException]]


def alone(error: Optional[BaseException], candidate: Candidate) -> Optional[BaseException]:
    """The :data:`Outcome` of a single process: its own outcome is the outcome."""
    return error


def read_tag(load_dir: str, tag: str, read: Callable[[str], T], outcome: Outcome = alone) -> tuple[Candidate, T]:
    """``read(tag_dir)`` of tag ``tag`` (or the copy a re-save set aside); any error is raised, never skipped."""
    cand = Candidate(str(tag), os.path.join(load_dir, str(tag)))  # named in errors if it cannot be resolved
    result, error = None, None
    try:
        cand = Candidate(*resolve_tag_dir(load_dir, tag))
        result = read(cand.tag_dir)
    except Exception as err:  # noqa: BLE001 - settled (with the other ranks) below
        error = err
    error = outcome(error, cand)
    if error is not None:
        raise error
    return cand, result  # type: ignore[return-value]


def read_first_good(found: Candidates, read: Callable[[str], T], outcome: Outcome = alone) -> tuple[Candidate, T]:
    """``read(tag_dir)`` of the first of ``found`` whose settled outcome is not an :class:`IntegrityError`;
    warns naming each tag skipped (and the ``latest`` notes) once one is read. Raises any other error at
    once, and an :class:`IntegrityError` listing every candidate's problem when all fail verification."""
    skipped = list(found.notes)
    for cand in found:
        result, error = None, None
        try:
            result = read(cand.tag_dir)
        except Exception as err:  # noqa: BLE001 - settled (with the other ranks) below
            error = err
        error = outcome(error, cand)
        if error is None:
            if skipped:
                warnings.warn(fallback_warning(found.load_dir, cand, skipped), CheckpointWarning, stacklevel=4)
            return cand, result  # type: ignore[return-value]
        if not isinstance(error, IntegrityError):
            raise error
        skipped.append(f"skipped '{cand.tag}': {error}")
    raise IntegrityError(f"no loadable checkpoint in {found.load_dir}: " + "; ".join(skipped))


def read_with_fallback(load_dir: str, tag: Optional[str], read: Callable[[str], T],
                       outcome: Outcome = alone) -> tuple[Candidate, T]:
    """``read(tag_dir)`` of tag ``tag``, or with ``tag=None`` of the first candidate that passes verification.

    Raises :class:`CheckpointError` when there is nothing to read, and :class:`IntegrityError` listing every
    candidate's problem when all fail verification.
    """
    if tag is not None:
        return read_tag(load_dir, tag, read, outcome)
    found = candidates(load_dir)
    if not found:
        raise CheckpointError(f"no checkpoint to load: {no_checkpoint_reason(found)}")
    return read_first_good(found, read, outcome)
