"""Gradient buckets: ``add`` ready gradients -> a full bucket is reduced -> its row is copied to where the
gradient rows live -> accumulate; ``finish`` drains all three stages.

A bucket is laid out rank-major (row ``r`` holds chunk ``r`` of every parameter in it, see Note [shard
layout] in ``partition/spec.py``), so the reduce strategy's result row is directly this rank's gradient
shard of those parameters. One bucket's reduction stays in flight while backward fills the next, and under
optimizer offload one reduced row's download to the host (``offload/link.py``) stays in flight while the
next bucket reduces: it is added into the host rows when the next one completes.

Buckets are filled into reused buffers, and the reduce strategy's result row is handed back
(``recycle``) once it has been added, so a step allocates no bucket-sized tensor (Note [buffer pool] in
``comm/buffers.py``). While backward hands in gradients, ``add`` lets the bucket in flight progress
(qgZ starts its second hop as soon as the first has arrived: Note [overlapped second hop] in
``plus/qgz.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional
from itertools import groupby

import torch

from zeropp.comm.buffers import BufferPool
from zeropp.comm.strategy import PendingReduce, ReduceStrategy
from zeropp.offload.link import HostLink, Transfer
from zeropp.offload.residency import Resident
from zeropp.partition.unit import Unit


@dataclass(eq=False)
class _Entry:
    unit: Unit
    slot: int
    grad: Optional[torch.Tensor]  # the full gradient of the parameter (compute dtype); dropped once bucketed


@dataclass
class _InFlight:
    pending: PendingReduce
    entries: list[_Entry]
    bucket: torch.Tensor
    pooled: bool  # the bucket is a buffer of GradBuckets.pool not yet given back (not a gradient used as it is)


@dataclass
class _Download:
    transfer: Transfer
    job: _InFlight
    row: torch.Tensor  # the reduced row on the device, held until its copy is added


@dataclass
class _DirectCopy:
    transfer: Transfer
    unit: Unit
    slot: int
    grad: torch.Tensor  # the gradient on the device, held until its copy is added


@dataclass
class GradBuckets:
    """Collects full gradients up to ``capacity`` padded elements, then reduces them as one bucket.

    A bucket is flushed before a gradient would take it past ``capacity``, so it never holds more than
    ``capacity`` elements or one larger parameter (Note [bucket size] in ``config/policy.py``). ``direct``
    (a world of one rank: nothing to reduce) adds each gradient into its row as it arrives, with no bucket.
    """

    reduce: ReduceStrategy
    world: int
    capacity: int
    residency: Resident = field(default_factory=Resident)  # NVMe: a unit's gradient row is read back to add
    link: HostLink = field(default_factory=HostLink)  # how reduced rows reach the gradient rows (offload: host)
    direct: bool = False
    _ready: list[_Entry] = field(default_factory=list)
    _size: int = 0
    _inflight: list[_InFlight] = field(default_factory=list)
    _downloads: list[_Download] = field(default_factory=list)
    pool: BufferPool = field(default_factory=BufferPool)  # bucket buffers, reused every step
    _direct_row: Optional[tuple[Unit, contextlib.ExitStack]] = None  # direct: the gradient row held in memory
    _direct_copies: list[_DirectCopy] = field(default_factory=list)  # direct, offloaded: Note [direct downloads]
    _direct_copying: int = 0  # their elements

    def add(self, unit: Unit, slot: int, grad: torch.Tensor) -> None:
        if self.direct:
            self._add_direct(unit, slot, grad)
            return
        for job in self._inflight:  # e.g. qgZ: start hop 2 of the bucket in flight if hop 1 has arrived
            job.pending.progress()
        size = unit.slots[slot].spec.padded
        if self._ready and self._size + size > self.capacity:
            self.flush()
        self._ready.append(_Entry(unit, slot, grad))
        self._size += size
        if self._size >= self.capacity:
            self.flush()

    def _add_direct(self, unit: Unit, slot: int, grad: torch.Tensor) -> None:
        """One rank: the mean over ranks is the gradient itself, added into its row as a reduced row would be.

        The unit's row stays in memory while its gradients keep arriving (a block's come one after another)
        and goes back when another unit's arrives or backward ends: under NVMe offload it is written once per
        backward, not once per parameter (a Llama layer's nine rewrote it nine times)."""
        flat = grad.reshape(-1)
        if self.link.distinct:
            # Note [direct downloads]: rows on the host of a separate device. The gradient goes down through the
            # link (page-locked, on its copy stream) in the row's dtype, and is added once backward is a bucket's
            # capacity further on. A synchronous `.to(host)` here copied into pageable memory with the host
            # waiting: 1.7 s of a 1.24B model's 3.9 s step on an H200 (`bench_device.py --offload --profile`).
            flat = flat.to(unit.compute_dtype)
            self._direct_copies.append(_DirectCopy(self.link.download(flat), unit, slot, flat))
            self._direct_copying += flat.numel()
            while self._direct_copying > self.capacity:
                self._land_direct()
            return
        self._hold_direct(unit)
        view = unit.grad_views()[slot]
        view[: flat.numel()].add_(flat.to(view.device, view.dtype))

    def _land_direct(self) -> None:
        """Add the oldest direct download into its row (waiting for its copy)."""
        copy = self._direct_copies.pop(0)
        self._direct_copying -= copy.grad.numel()
        row = copy.transfer.wait()
        self._hold_direct(copy.unit)
        view = copy.unit.grad_views()[copy.slot]
        view[: row.numel()].add_(row.to(view.dtype))

    def _hold_direct(self, unit: Unit) -> None:
        """Keep ``unit``'s gradient row in memory (NVMe: read in) until another unit's is needed."""
        if self._direct_row is None or self._direct_row[0] is not unit:
            self._release_direct()
            held = contextlib.ExitStack()
            held.enter_context(self.residency.grads(unit))
            self._direct_row = (unit, held)

    def _release_direct(self) -> None:
        if self._direct_row is not None:
            held, self._direct_row = self._direct_row[1], None
            held.close()

    def flush(self) -> None:
        """Start reducing what is ready; complete the previously started bucket (one stays in flight)."""
        if not self._ready:
            return
        entries, self._ready, self._size = self._ready, [], 0
        segments = [e.unit.slots[e.slot].spec.chunk for e in entries]
        bucket, pooled = self._fill(entries, segments)
        pending = self.reduce.start(bucket, segments, [e.unit.slots[e.slot].name for e in entries])
        for e in entries:
            e.grad = None  # the bucket holds them now
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._inflight.append(_InFlight(pending, entries, bucket, pooled))

    def _fill(self, entries: list[_Entry], segments: list[int]) -> tuple[torch.Tensor, bool]:
        """The ``[W, sum(segments)]`` bucket: each gradient, zero-padded, as ``W`` rows of its chunk. A lone
        unpadded gradient is its own bucket; otherwise the bucket is a pool buffer (True)."""
        first = entries[0].grad
        assert first is not None
        spec = entries[0].unit.slots[entries[0].slot].spec
        if len(entries) == 1 and spec.padded == spec.numel:
            return first.reshape(self.world, spec.chunk), False
        length = sum(segments)
        bucket = self.pool.take(self.world * length, first.dtype, first.device).view(self.world, length)
        off = 0
        for e, c in zip(entries, segments):
            assert e.grad is not None
            _copy_padded(bucket[:, off : off + c], e.grad.reshape(-1))
            off += c
        return bucket, True

    def finish(self) -> None:
        """Reduce everything still pending and accumulate it into the owning gradient shards."""
        while self._direct_copies:
            self._land_direct()
        self._release_direct()
        self.flush()
        while self._inflight:
            self._complete(self._inflight.pop(0))
        while self._downloads:
            self._accumulate(self._downloads.pop(0))

    def _complete(self, job: _InFlight) -> None:
        """The reduction finished: start its row's copy out and add the copies before it (and this one too
        when nothing is in flight: the host is the device)."""
        row = job.pending.finish()
        if job.pooled and row.untyped_storage().data_ptr() != job.bucket.untyped_storage().data_ptr():
            self.pool.give(job.bucket)  # the reduction has read it; only stage 0's in-place row lives on in it
            job.pooled = False
        if self.link.distinct:  # cast before the copy, not after: half the bytes, the same rounding
            row = row.to(job.entries[0].unit.compute_dtype)
        transfer = self.link.download(row)
        self._downloads.append(_Download(transfer, job, row))
        keep = 0 if transfer.done else 1
        while len(self._downloads) > keep:
            self._accumulate(self._downloads.pop(0))

    def _accumulate(self, job: _Download) -> None:
        row = job.transfer.wait()
        off = 0
        for unit, entries in groupby(job.job.entries, key=lambda e: e.unit):  # one row in memory at a time
            with self.residency.grads(unit):
                views = unit.grad_views()  # on the host under optimizer offload: copied out per bucket
                for e in entries:
                    c = unit.slots[e.slot].spec.chunk
                    views[e.slot].add_(row[off : off + c].to(views[e.slot].device, views[e.slot].dtype))
                    off += c
        # Only now is the result row dead (and the bucket, when stage 0 reduced in place in it).
        job.job.pending.recycle()
        if job.job.pooled:
            self.pool.give(job.job.bucket)

    def held_bytes(self) -> int:
        """Bytes of gradients waiting in buckets: full ones (ready, or in a reduction still in flight) and
        reduced rows still being copied to the host."""
        ready = sum(e.grad.numel() * e.grad.element_size() for e in self._ready if e.grad is not None)
        copying = sum(job.row.numel() * job.row.element_size() for job in self._downloads)
        copying += sum(c.grad.numel() * c.grad.element_size() for c in self._direct_copies)
        return ready + copying + sum(job.bucket.numel() * job.bucket.element_size() for job in self._inflight)


def _copy_padded(dest: torch.Tensor, flat: torch.Tensor) -> None:
    """Write ``flat`` zero-padded into the ``[W, c]`` view ``dest`` in row-major order (as ``pad`` then
    ``view(W, c)`` would), without a padded temporary."""
    c = dest.shape[1]
    if c == 0:
        return
    q, r = divmod(flat.numel(), c)
    if q:
        dest[:q].copy_(flat[: q * c].view(q, c))
    if r:
        dest[q, :r].copy_(flat[q * c :])
        dest[q, r:].zero_()
        q += 1
    if q < dest.shape[0]:  # (a call on an empty slice still costs a dispatch, for every gradient)
        dest[q:].zero_()
