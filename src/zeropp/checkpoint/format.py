"""The on-disk checkpoint format: directory layout, tag names and directories, atomic file writes, errors.

Pure file I/O: nothing here touches ``torch.distributed``, so consolidation can run on a laptop. The manifest's
schema and checksum are in ``manifest.py``; which tag a ``tag=None`` load reads is in ``resolve.py``.

A checkpoint directory ``save_dir`` holds one directory per tag and a ``latest`` file naming the newest::

    save_dir/
      latest                      # text: the tag written last (written only once that tag is complete)
      global_step20/
        manifest.json             # rank 0: format version, config, topology, parameters and shard layout,
                                  #   every shard's size and SHA-256, the save's nonce, its own SHA-256
        shard_rank00000.safetensors   # rank r: fp32 master chunks, optimizer/scheduler state, counters, RNG:
        shard_rank00001.safetensors   #   tensors as safetensors, the rest as JSON (Note [data, not code])
        ...

Note [checkpoint atomicity]: a tag is written into ``save_dir/.<tag>.tmp-<nonce>`` (a hidden name, one nonce
per save shared by all ranks); each file in it is written to ``<name>.tmp-<pid>``, fsync'd and renamed; the
SHA-256 of its bytes is computed as they are written (:func:`atomic_write`). After every rank reports success
(and its shard's size and digest, in the same all-reduce), rank 0 records them in the manifest (written the
same way), fsyncs the directory and renames it to ``save_dir/<tag>`` — one ``rename(2)``, atomic on a POSIX
file system — then fsyncs ``save_dir`` and only then replaces ``latest`` (temporary file, fsync, rename). A
crash at any point before the directory rename leaves only a hidden temporary directory; before the ``latest``
rename, a complete new tag that ``latest`` does not name yet. Either way the previous tag is untouched and
``latest`` still names it. Re-saving an existing tag first renames the old directory aside to
``save_dir/.<tag>.old-<nonce>`` and deletes it after the new one is in place; should a crash fall between
those two renames, loading that tag finds the aside copy (see :func:`resolve_tag_dir`), and should the second
rename fail, the aside copy is renamed back (:func:`rename_into_place`). A later successful
save of a tag deletes that tag's leftovers (aside copies, torn temporary directories). A write that fails
(``ENOSPC`` or any ``OSError``) removes its temporary file and raises :class:`CheckpointError` naming the
file; the save then fails on every rank and rank 0 removes the temporary directory, so the previous tag and
``latest`` stay as they were.

Note [checkpoint verification]: format version 2 makes a tag self-checking. Each shard's size and SHA-256
are in the manifest, so a truncated, bit-flipped or swapped-in shard is caught before its bytes are read; the save's nonce is in the manifest and in every shard, so files of two saves never mix
unnoticed; the manifest carries the SHA-256 of its own canonical JSON (``manifest.py``), so an edit to it
is caught too. What fails these checks raises :class:`IntegrityError`, and only that kind of error makes
loading ``latest`` fall back to an older tag (``resolve.py``); a checkpoint that is intact but does not fit
the model raises a plain :class:`CheckpointError` and never falls back. Version-1 tags (sizes only) still
load, with a :class:`CheckpointWarning` that they cannot be verified.

Format version 3 holds no pickle: a digest cannot make one safe (whoever can write the directory can
recompute it), so shards are data only (Note [data, not code] in ``safe_io.py``). Tags of versions 1 and 2
(``shard_rankNNNNN.pt``, pickles) are read with ``torch.load(weights_only=True)``, which runs no code and
refuses anything beyond tensors and plain data; what it refuses (zeropp's shards hold NumPy's RNG state) is a
:class:`LegacyPickleError` naming the file and the explicit conversion, ``zeropp convert-checkpoint
--trust-pickle DIR``, for checkpoints whose origin the user trusts.
"""
from __future__ import annotations

import errno
import hashlib
import os
import signal
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional

# 3: shards are safetensors + JSON, no pickle; 2: shard sizes + SHA-256, the save's nonce and the manifest's own
# SHA-256 (1: sizes only); 1 and 2 are pickles (read with weights_only=True, or converted)
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
LATEST = "latest"
SHARD_PREFIX = "shard_"  # every file in a tag directory that starts with this must be a recorded shard
CRASH_ENV = "ZEROPP_CKPT_TEST_CRASH"  # test-only: "<point>:<rank>" SIGKILLs that rank at that point
FAULT_ENV = "ZEROPP_CKPT_TEST_FAULT"  # test-only: "<file>:<rank>" (shard, manifest, latest): ENOSPC mid-write
_HASH_BLOCK = 1 << 22  # bytes read per step when hashing a file


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model; the message names the file or parameter.

    ``file`` (a base name such as ``shard_rank00001.pt``), ``problem`` (a short phrase) and ``errno`` let
    the ranks that did not see the error name it too (``collective.agree``).
    """

    def __init__(self, message: str, *, file: Optional[str] = None, problem: Optional[str] = None,
                 errno: int = 0) -> None:
        super().__init__(message)
        self.file, self.problem, self.errno = file, problem, errno


class IntegrityError(CheckpointError):
    """The checkpoint's files are damaged, incomplete or mixed with another save's (Note [checkpoint
    verification]); loading ``latest`` falls back past such a tag, never past any other error."""


class LegacyPickleError(CheckpointError):
    """A shard of format version 1 or 2 (a pickle) that ``torch.load(weights_only=True)`` refuses; the message
    names the file and the command that converts the checkpoint once its origin is trusted."""


class CheckpointWarning(UserWarning):
    """A checkpoint was loaded in a way the caller should know about: an older tag than ``latest``, an
    unverifiable version-1 tag, or nothing at all (a first launch)."""


def shard_name(rank: int, version: int = FORMAT_VERSION) -> str:
    """Rank ``rank``'s shard file name in a tag of format ``version`` (``.pt`` pickles before version 3)."""
    return f"shard_rank{rank:05d}{'.safetensors' if version >= 3 else '.pt'}"


def shard_rank_of(name: str) -> Optional[int]:
    """The rank whose shard file is called ``name`` (any format version), or None for any other name."""
    digits = name.removeprefix("shard_rank").removesuffix(".pt").removesuffix(".safetensors")
    if len(digits) == 5 and digits.isdigit() and name in (shard_name(int(digits)), shard_name(int(digits), 2)):
        return int(digits)
    return None


def check_tag(tag: str) -> str:
    """``tag`` as a string, if it can name a tag directory; else :class:`CheckpointError`.

    A CheckpointError, not a ValueError: a bad tag is a checkpoint problem, so every rank's agreement and
    every caller that handles checkpoint errors (``zeropp consolidate``, the job runner) treats it as one.
    """
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag:
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain, non-hidden directory name")
    return tag


def list_tags(save_dir: str) -> list[str]:
    """The complete tags in ``save_dir`` (directories with a manifest), sorted by name."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(d for d in os.listdir(save_dir)
                  if not d.startswith(".") and os.path.isfile(os.path.join(save_dir, d, MANIFEST)))


# ---- atomic writes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """A file as :func:`atomic_write` left it: its size and the SHA-256 of its bytes (hex)."""

    size: int
    sha256: str


def sha256_file(path: str) -> str:
    """The SHA-256 (hex) of a file, read in blocks (never whole into memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def describe_errno(code: int) -> str:
    """``no space left on device`` and the like: the phrase an error message should carry."""
    if code == errno.ENOSPC:
        return "no space left on device"
    if code == errno.EDQUOT:
        return "disk quota exceeded"
    return os.strerror(code).lower() if code else "failed"


def write_error(path: str, err: OSError) -> CheckpointError:
    """The error a failed write raises: the file, and ``no space left on device`` for ENOSPC."""
    code = err.errno or 0
    name = errno.errorcode.get(code, str(code))
    return CheckpointError(f"cannot write {path}: {describe_errno(code)} ({name}: {err})",
                           file=os.path.basename(path), problem="write failed", errno=code)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_replace(path: str, produce: Callable[[str], None]) -> int:
    """``produce(tmp)`` writes a temporary file beside ``path``; it is fsync'd and renamed over ``path`` (and
    the directory fsync'd), so ``path`` is either the old file or the whole new one. Returns its size.

    An ``OSError`` on the way (``ENOSPC`` above all) removes the temporary file and raises
    :class:`CheckpointError` naming ``path`` (:func:`write_error`); ``path`` is then untouched.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        produce(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # delayed allocation can report ENOSPC only here
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        return os.path.getsize(path)
    except OSError as err:
        _remove_quietly(tmp)
        raise write_error(path, err) from err
    except BaseException:
        _remove_quietly(tmp)
        raise


def rename_into_place(tmp_dir: str, final: str, aside: str) -> None:
    """Rename directory ``tmp_dir`` to ``final``; an existing ``final`` is first renamed to ``aside`` (never
    deleted before it is replaced: Note [checkpoint atomicity]).

    Should the second rename fail, the old directory is renamed back to ``final`` before the error goes on,
    so the tag stays where ``latest`` and the ``tag=None`` fall back look for it (they never list ``aside``).
    """
    moved = os.path.exists(final)
    if moved:
        os.rename(final, aside)
    try:
        os.rename(tmp_dir, final)
    except BaseException:
        if moved:
            try:
                os.rename(aside, final)
            except OSError:  # the original error says more; a load of the tag still finds `aside`
                pass
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def atomic_write(path: str, write: Callable[[BinaryIO], None], point: Optional[str] = None,
                 rank: int = 0) -> Written:
    """:func:`atomic_replace` through ``write(file)``, hashing the bytes on their way to the disk.

    Hashing as they are written saves reading the file back (torch.save streams a zip without seeking;
    should a writer ever seek, the file is hashed again from disk). ``point`` (``shard``, ``manifest``,
    ``latest``) names the file for the test-only hooks: a SIGKILL mid-write (``CRASH_ENV``
    ``shard_write:<rank>``) or ENOSPC mid-write (``FAULT_ENV`` ``<point>:<rank>``).
    """
    hashing: list[_HashingWriter] = []

    def produce(tmp: str) -> None:
        with open(tmp, "wb") as raw:
            f: Any = _HashingWriter(raw)
            hashing[:] = [f]
            if point and _armed(CRASH_ENV, f"{point}_write", rank):
                f = _KillMidWrite(f)
            if point and _armed(FAULT_ENV, point, rank):
                f = _FailMidWrite(f)
            write(f)

    size = atomic_replace(path, produce)
    h = hashing[0]
    return Written(size, sha256_file(path) if h.seeked or h.size != size else h.digest.hexdigest())


def atomic_write_text(path: str, text: str, point: Optional[str] = None, rank: int = 0) -> Written:
    return atomic_write(path, lambda f: f.write(text.encode()), point, rank)


class _HashingWriter:
    """A binary file wrapper that feeds every byte written to a SHA-256 and counts them."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.digest, self.size, self.seeked = raw, hashlib.sha256(), 0, False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)  # hashlib releases the GIL on large buffers
        self.size += view.nbytes
        return self.raw.write(view)

    def seek(self, *args: Any) -> int:
        self.seeked = True  # the stream hash no longer describes the file: hash it from disk after
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


# ---- test-only crash points ------------------------------------------------------------------------------
def _armed(env: str, point: str, rank: int) -> bool:
    """Whether the test hook in environment variable ``env`` (``CRASH_ENV``, ``FAULT_ENV``) names this point."""
    return os.environ.get(env, "") == f"{point}:{rank}"


def crash_point(point: str, rank: int) -> None:
    """Test hook: SIGKILL this process here when ``ZEROPP_CKPT_TEST_CRASH`` is ``<point>:<rank>``."""
    if _armed(CRASH_ENV, point, rank):
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


class _FailMidWrite:
    """A file wrapper that writes half of the first buffer and then fails as a full disk does (ENOSPC)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view[: view.nbytes // 2])
        self.raw.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


# ---- reading ---------------------------------------------------------------------------------------------
def read_latest(load_dir: str) -> tuple[Optional[str], Optional[str]]:
    """``(tag, None)`` for the tag ``load_dir/latest`` names, or ``(None, why not)``: no file, or no tag in it."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None, f"no '{LATEST}' file found: looked for {path}"
    try:
        with open(path, "rb") as f:
            text = f.read(4096).decode("utf-8").strip()
        return check_tag(text), None
    except (OSError, UnicodeDecodeError, CheckpointError) as err:
        return None, f"'{LATEST}' file {path} does not name a tag: {err}"


def resolve_tag_dir(load_dir: str, tag: str) -> tuple[str, str]:
    """``(tag, directory)`` of tag ``tag`` in ``load_dir``, or the copy a re-save set aside (see below)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory not found: {load_dir}")
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return tag, path
    aside = sorted(d for d in os.listdir(load_dir) if d.startswith(f".{tag}.old-"))
    if aside:  # a crash fell between the two renames of a re-save (Note [checkpoint atomicity])
        return tag, os.path.join(load_dir, aside[-1])
    raise CheckpointError(f"checkpoint tag '{tag}' not found: looked for directory {path} "
                          f"(tags present: {list_tags(load_dir) or 'none'})")


def load_shard(path: str, mmap: bool = False) -> dict:
    """Read one shard file, naming it in the error when it cannot be read; never runs code from it.

    A version-3 shard is parsed as data (``safe_io.read_tree``); an older one (a pickle) goes through
    ``torch.load(weights_only=True)``, and what that refuses is a :class:`LegacyPickleError`. Callers verify the
    file's size and SHA-256 first (``verify.open_shard``), so a damaged file is caught before it is parsed.
    """
    from zeropp.checkpoint.safe_io import read_tree

    name = os.path.basename(path)
    if path.endswith(".safetensors"):
        shard = read_tree(path, use_mmap=mmap, fail=lambda why: IntegrityError(
            f"cannot read shard file {path}: {why}", file=name, problem="unreadable"))
    else:
        shard = _load_legacy(path, mmap)
    if not isinstance(shard, dict):
        raise IntegrityError(f"shard file {path} holds a {type(shard).__name__}, not a zeropp shard",
                             file=name, problem="unreadable")
    return shard


def _load_legacy(path: str, mmap: bool) -> Any:
    import pickle

    import torch

    name = os.path.basename(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # weights_only refused something: no code ran
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LegacyPickleError(
            f"shard file {path} is a pickle (checkpoint format version 1 or 2) holding more than tensors and plain "
            f"data, so zeropp will not load it: unpickling runs code, and anyone who could write the checkpoint "
            f"directory could have put code there [{first}]. If you trust where this checkpoint comes from, "
            f"convert it once: zeropp convert-checkpoint --trust-pickle {os.path.dirname(os.path.dirname(path))}",
            file=name, problem="legacy pickle") from err
    except Exception as err:  # a torn zip, an I/O error: name the file
        raise IntegrityError(f"cannot read shard file {path}: {type(err).__name__}: {err}",
                             file=name, problem="unreadable") from err
