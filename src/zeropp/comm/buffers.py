"""Temporary buffers the gather and reduce strategies reuse every step instead of allocating per unit.

Note [buffer pool]: a strategy's wire rows, receive rows, dequantized rows and fp32 partial sums live
from the moment a collective is issued until its result has been consumed. Allocating them per unit per
step costs more than the quantizers themselves: fresh memory is page-faulted in on first touch, which
took the quantize + dequantize round trip from 0.6-0.8x of a memcpy to 0.1-0.16x (docs/benchmarks.md,
"Quantizer kernels"). So each strategy owns a few ``BufferPool``s, one per role, and takes a buffer when a
collective starts and gives it back when its contents are dead:

* the pool is sized by what is in flight, not by the model: a buffer is a *slab* that serves any request
  of its dtype and device up to its size; the slabs of a role have the size of its largest request and
  their number is the most leases that role ever held at once (prefetch keeps two or three units in
  flight). A model with three times the units reuses the same few slabs
  (tests/dist/test_hot_path_buffers.py);
* a slab is reused only after an explicit ``give``: a buffer nobody gives back (a caller that keeps a
  result, an exception between start and finish) is simply never reused, so the failure mode of a
  forgotten give is a leak of one slab, never a buffer overwritten while someone still reads it;
* buffers handed to the engine (the rows ``PendingGather.finish`` returns, the row
  ``PendingReduce.finish`` returns) go back when the engine calls the pending's ``recycle()``: after
  ``Unit.materialize`` copied the rows into the parameters, and after the reduced row was added into the
  gradient shards (``zero/buckets.py``).

The strategies take and give on the training thread (gathers and reductions are issued there); a lock
keeps the pool consistent should another thread ever give a buffer back.
"""
from __future__ import annotations

import threading

import torch


class BufferPool:
    """Flat slabs of one role (e.g. qwZ's receive rows), handed out as 1-D views and reused once given back.

    All slabs of a dtype and device have the size of the largest request seen for them, so any free slab
    serves any request: which request meets which slab (the order of takes and gives can change with the
    timing of collectives) never makes the pool allocate again once it has seen the largest request and
    the most leases held at once. A slab smaller than that size is dropped when it comes back.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, torch.Tensor] = {}  # slab data_ptr -> slab
        self._size: dict[tuple[torch.dtype, torch.device], int] = {}  # slab size of each kind
        self._lock = threading.Lock()
        self.allocations = 0  # slabs created so far: flat once the pool is warm (tests read it)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined) that is this caller's until :meth:`give`."""
        kind = (dtype, torch.device(device))
        with self._lock:
            size = max(self._size.get(kind, 1), numel)  # >= 1: every slab has a distinct data_ptr
            if size > self._size.get(kind, 0):  # a larger request: the free slabs of this kind are too small
                self._size[kind] = size
                self._free = [s for s in self._free if (s.dtype, s.device) != kind]
            slab = next((s for s in self._free if (s.dtype, s.device) == kind), None)
            if slab is None:
                slab = torch.empty(size, dtype=dtype, device=kind[1])
                self.allocations += 1
            else:
                self._free = [s for s in self._free if s is not slab]
            self._leased[slab.data_ptr()] = slab
        return slab[:numel]

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor from :meth:`take` (or any view of it that starts at its first element)."""
        with self._lock:
            slab = self._leased.pop(t.data_ptr(), None)
            if slab is None:
                raise ValueError("BufferPool.give: this tensor was not taken from this pool, or was given back "
                                 "already")
            if slab.numel() == self._size[(slab.dtype, slab.device)]:
                self._free.append(slab)

    def trim(self, keep: int) -> None:
        """Drop free slabs until the pool owns at most ``keep`` (leased ones stay): after a step that held more
        than its usual number at once, so that a one-off peak is not kept for the rest of the run."""
        with self._lock:
            drop = max(0, len(self._free) + len(self._leased) - keep)
            self._free = self._free[drop:]

    def nbytes(self) -> int:
        """Bytes of every slab the pool owns, free or leased."""
        with self._lock:
            slabs = self._free + list(self._leased.values())
        return sum(s.numel() * s.element_size() for s in slabs)

    def leased(self) -> int:
        """Number of slabs currently handed out."""
        return len(self._leased)


class BufferPools:
    """The pools of one strategy, one per role, reported by ``buffer_bytes()`` as ``{prefix}_{role}``."""

    def __init__(self, prefix: str, *roles: str) -> None:
        self.prefix = prefix
        self._pools = {role: BufferPool() for role in roles}

    def __getitem__(self, role: str) -> BufferPool:
        return self._pools[role]

    def buffer_bytes(self) -> dict[str, int]:
        return {f"{self.prefix}_{role}": pool.nbytes() for role, pool in self._pools.items()}

    def allocations(self) -> int:
        """Slabs created by all roles so far."""
        return sum(pool.allocations for pool in self._pools.values())

    def leased(self) -> int:
        """Slabs of all roles handed out now."""
        return sum(pool.leased() for pool in self._pools.values())
