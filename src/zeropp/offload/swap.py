"""``SwapStore``: named host tensors whose bytes live in an offload file and occupy memory only while used.

A tensor handed to the store keeps its identity (the optimizer keys its state by tensor, views stay valid);
only its storage comes and goes, as the parameters' full buffers do (``untyped_storage().resize_``):

    put(name, t)        the store takes ``t`` over: its bytes are written, then its storage is freed
    fetch(name)         storage back, read started (a prefetch); ``get(name)`` waits for it and returns ``t``
    release(name)       storage freed; written first when ``dirty`` (its bytes changed since the read)
    forget_contents(name)  storage freed, contents remembered as zeros (no I/O; a gradient after the step)

The bytes resident at once (tensors fetched, being read, or written but not yet freed) never exceed
``budget``: a fetch beyond it first waits for writes in flight, then either gives up (``optional=True``,
a prefetch) or raises an ``OffloadError`` that names the config keys that size the budget. ``peak_bytes``
records the most that was resident.

Touching a tensor while it is out of memory is a crash, not garbage: the engine only does so between
``get`` and ``release``. Not thread-safe: one training thread drives it.

L3 helper over ``AioPool``: no process groups.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from zeropp.offload.aio import AioHandle, AioPool, OffloadError

__all__ = ["SwapStore"]


class _Where(enum.Enum):
    OUT = "out"  # only in the file (or known to be zeros)
    READING = "reading"  # storage allocated, read in flight
    RESIDENT = "resident"
    WRITING = "writing"  # write in flight; storage freed when it completes


@dataclass(eq=False)
class _Entry:
    tensor: torch.Tensor
    nbytes: int  # the storage's size when resident (a view's base may be larger than the view)
    where: _Where = _Where.RESIDENT
    zeros: bool = False  # contents are zeros and not in the file
    handle: Optional[AioHandle] = None


class SwapStore:
    """Tensors swapped between memory and ``pool``'s file under a resident-bytes ``budget``.

    Args:
        pool: the per-rank offload file.
        budget: the most bytes of tensor storage resident at once.
        sized_by: the config keys that set ``budget``, named when it is too small.
    """

    def __init__(self, pool: AioPool, budget: int, sized_by: str) -> None:
        self.pool = pool
        self.budget = budget
        self.sized_by = sized_by
        self._entries: dict[str, _Entry] = {}
        self._writing: dict[str, _Entry] = {}  # writes in flight, oldest first
        self.resident_bytes = 0
        self.peak_bytes = 0
        self._reserved = 0  # counted for tensors the caller is creating; put() takes them over
        self._unbounded = False

    # ---- taking tensors over --------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, zeros: bool = False) -> None:
        """Take ``tensor`` over under ``name`` (replacing what was there) and move it out of memory.

        ``zeros=True``: its contents are zeros; nothing is written. The tensor must be resident, contiguous
        and own its storage alone (views of it are fine; other tensors in the same storage are not).
        """
        if not self.can_take(tensor):
            raise ValueError(f"SwapStore: {name!r} must be a contiguous host tensor owning its resizable storage")
        old = self._entries.get(name)
        if old is not None:
            if old.tensor is tensor:
                self.release(name, dirty=not zeros, zeros=zeros)
                return
            self._drop(old)
        entry = _Entry(tensor, tensor.untyped_storage().nbytes())
        self._entries[name] = entry
        taken = min(self._reserved, entry.nbytes)
        self._reserved -= taken
        self._add_resident(entry.nbytes - taken)
        self.release(name, dirty=not zeros, zeros=zeros)
        if self.resident_bytes > self.budget:  # start-up puts one tensor after another: do not pile up writes
            self._drain_writes()

    def reset_peak(self) -> None:
        """Start measuring the peak afresh (training begins)."""
        self.peak_bytes = self.resident_bytes

    @staticmethod
    def can_take(tensor: torch.Tensor) -> bool:
        """Whether ``put`` can swap ``tensor``: a contiguous host tensor whose storage is resizable and is not
        shared with much else (a page of slack is fine: CpuAdam places moments that way)."""
        st = tensor.untyped_storage()
        own = tensor.numel() * tensor.element_size()
        return (tensor.device.type == "cpu" and tensor.is_contiguous() and st.resizable()
                and st.nbytes() <= own + 4096)

    def _drop(self, entry: _Entry) -> None:
        """Forget an entry whose tensor was replaced (its memory goes with the old tensor)."""
        if entry.handle is not None:
            entry.handle.wait()
        self._writing = {k: v for k, v in self._writing.items() if v is not entry}
        if entry.where is not _Where.OUT:
            self.resident_bytes -= entry.nbytes

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` of tensors the caller is about to create outside the store (an optimizer's lazily
        made state) so that they fit the budget too; ``put`` takes them over, ``unreserve`` drops the rest."""
        if not self._room_for(nbytes):
            raise OffloadError(f"offload buffers full: {nbytes:,} bytes of new state with {self.resident_bytes:,} "
                               f"of {self.budget:,} in use; raise {self.sized_by}")
        self._add_resident(nbytes)
        self._reserved += nbytes

    def unreserve(self) -> None:
        self.resident_bytes -= self._reserved
        self._reserved = 0

    def discard(self, name: str) -> None:
        """Forget ``name`` (its tensor is no longer in use: e.g. state a loaded state dict did not have)."""
        e = self._entries.pop(name, None)
        if e is not None:
            self._writing.pop(name, None)
            self._drop(e)

    def resident_names(self) -> list[str]:
        """Names whose bytes are in memory (or being read into it)."""
        return [n for n, e in self._entries.items() if e.where in (_Where.RESIDENT, _Where.READING)]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def stored_bytes(self) -> int:
        """Bytes of every tensor in the store, wherever it is."""
        return sum(e.tensor.numel() * e.tensor.element_size() for e in self._entries.values())

    # ---- in and out --------------------------------------------------------------------------------------
    def fetch(self, name: str, optional: bool = False, read: bool = True) -> bool:
        """Start bringing ``name`` into memory; False when ``optional`` and the budget has no room.

        ``read=False``: the caller overwrites every element, so nothing is read.
        """
        e = self._entries[name]
        if e.where is _Where.WRITING:  # still in memory: keep it (its contents are current)
            self._finish(e)
            del self._writing[name]
            e.where = _Where.RESIDENT
            return True
        if e.where is not _Where.OUT:
            return True
        if not self._room_for(e.nbytes):
            if optional:
                return False
            raise OffloadError(
                f"offload buffers full: {name!r} needs {e.nbytes:,} bytes with {self.resident_bytes:,} of "
                f"{self.budget:,} in use; raise {self.sized_by}")
        e.tensor.untyped_storage().resize_(e.nbytes)
        self._add_resident(e.nbytes)
        if e.zeros or not read:
            if e.zeros:
                e.tensor.zero_()
            e.where = _Where.RESIDENT
        else:
            e.handle = self.pool.read_async(name, e.tensor)
            e.where = _Where.READING
        return True

    def get(self, name: str, read: bool = True) -> torch.Tensor:
        """``name``'s tensor, in memory and current (waits for its read)."""
        self.fetch(name, read=read)
        e = self._entries[name]
        if e.where is _Where.READING:
            self._finish(e)
            e.where = _Where.RESIDENT
        return e.tensor

    def release(self, name: str, dirty: bool = True, zeros: bool = False) -> None:
        """Move ``name`` out of memory; its bytes are written first when ``dirty`` (and not ``zeros``)."""
        e = self._entries[name]
        if e.where is _Where.READING:
            self._finish(e)
            e.where = _Where.RESIDENT
        if e.where is _Where.WRITING and zeros:  # the bytes being written are obsolete: wait, then free
            self._finish(e)
            del self._writing[name]
            self._free(e)
        if e.where is not _Where.RESIDENT:
            e.zeros = e.zeros or zeros
            return
        if zeros or not dirty:
            e.zeros = zeros or e.zeros
            self._free(e)
            return
        e.zeros = False
        e.handle = self.pool.write_async(name, e.tensor)
        e.where = _Where.WRITING
        self._writing[name] = e
        self._reap()

    def forget_contents(self, name: str) -> None:
        """Out of memory, contents zeros from now on (no I/O)."""
        self.release(name, zeros=True)

    def is_resident(self, name: str) -> bool:
        return self._entries[name].where in (_Where.RESIDENT, _Where.READING)

    def flush(self) -> None:
        """Wait for every write in flight (and free what it held)."""
        self._drain_writes()

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """Allow fetches beyond the budget (checkpoints bring a rank's whole state in at once)."""
        before, self._unbounded = self._unbounded, True
        try:
            yield
        finally:
            self._unbounded = before

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def _room_for(self, nbytes: int) -> bool:
        if self._unbounded or self.resident_bytes + nbytes <= self.budget:
            return True
        self._drain_writes()
        return self.resident_bytes + nbytes <= self.budget

    def _finish(self, e: _Entry) -> None:
        handle, e.handle = e.handle, None
        if handle is not None:
            handle.wait()

    def _free(self, e: _Entry) -> None:
        e.tensor.untyped_storage().resize_(0)
        e.where = _Where.OUT
        self.resident_bytes -= e.nbytes

    def _reap(self) -> None:
        """Free the memory of writes that completed (non-blocking)."""
        for name, e in list(self._writing.items()):
            if e.handle is None or e.handle.done():
                self._finish(e)
                self._free(e)
                del self._writing[name]

    def _drain_writes(self) -> None:
        while self._writing:
            name, e = next(iter(self._writing.items()))
            self._finish(e)
            self._free(e)
            del self._writing[name]
