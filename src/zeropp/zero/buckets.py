"""Gradient buckets: ``add`` ready gradients into their place in a bucket -> a bucket whose gradients are all in
is reduced -> its row is copied to where the gradient rows live -> accumulate; ``finish`` drains all three stages.

A bucket is laid out rank-major (row ``r`` holds chunk ``r`` of every parameter in it, see Note [shard
layout] in ``partition/spec.py``), so the reduce strategy's result row is directly this rank's gradient
shard of those parameters. One bucket's reduction stays in flight while backward fills the next, and under
optimizer offload one reduced row's download to the host (``offload/link.py``) stays in flight while the
next bucket reduces: it is added into the host rows when the next one completes.

Note [positional buckets]. Which gradient goes into which bucket, and where, is fixed by a layout every rank
holds alike (:class:`BucketLayout`), not by the order gradients arrive in on this rank. Buckets are reduced in
layout order, each once its places are filled, and ``finish`` reduces the rest with zeros in the places no
gradient reached. So every rank issues the same reductions of the same sizes whatever its backward ran: a rank
whose forward skipped a module (an MoE expert that got no tokens there, a layer dropped at random, a branch
taken on some ranks only) contributes zeros for its parameters, the mean over ranks that plain data
parallelism with unused parameters gives. Before, buckets were filled in arrival order, and such a rank's
buckets held other parameters, or had other sizes: gloo aborted the process (SIGABRT in its size check), or
the step was refused.

The layout starts from the parameters' order reversed (the order a backward usually produces gradients in; stages
0-1 reduce in unit order) and, at each optimizer step whose ranks all produced the same arrival order
(checked with the step's collectives, Note [collective order]), follows the last backward's order, repeats
included (a module run twice, a shared layer under reentrant checkpointing, is reduced once per run), with the
most runs any backward of the window had. While
gradients arrive out of layout order, a bucket waits for its places and the buckets after it are held (at most
the whole gradient, what stage 1 holds). A gradient the layout has no place for (one more run of a module than
the layout knows) is not bucketed: ``add`` says so and the caller keeps it for the step (Note [extra
gradients] in ``zero/grad_intake.py``).

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
from zeropp.comm.strategy import PendingReduce
from zeropp.offload.link import HostLink, Transfer
from zeropp.partition.unit import Unit
from zeropp.zero.state import EngineState


Key = tuple[int, int]  # (unit index, slot index)


@dataclass(frozen=True)
class _Place:
    unit: Unit
    slot: int
    offset: int  # its first column in the bucket
    chunk: int


@dataclass(frozen=True)
class _Plan:
    places: tuple[_Place, ...]
    length: int  # columns: the sum of the places' chunks

    @property
    def lone(self) -> bool:
        """One unpadded gradient: the gradient itself is the bucket, no copy."""
        spec = self.places[0].unit.slots[self.places[0].slot].spec
        return len(self.places) == 1 and spec.padded == spec.numel


class BucketLayout:
    """Where each gradient of a backward goes (Note [positional buckets]): ``keys`` (unit, slot) in the order
    buckets are filled, a key once per gradient it gets in a backward, cut into buckets of at most ``capacity``
    padded elements (a bucket is closed before a gradient would take it past ``capacity``, so it holds at most
    ``capacity`` elements or one larger parameter: Note [bucket size] in ``config/policy.py``)."""

    def __init__(self, keys: list[tuple[Unit, int]], capacity: int, dtype: Optional[torch.dtype] = None) -> None:
        self.keys: tuple[Key, ...] = tuple((u.index, s) for u, s in keys)
        self.dtype = dtype  # the buckets' dtype; None: the units' compute dtype
        self.plans: list[_Plan] = []
        self.index: dict[Key, list[tuple[int, int]]] = {}  # each run of the key: (bucket, place)
        current: list[tuple[Unit, int]] = []
        size = 0
        for unit, slot in keys:
            padded = unit.slots[slot].spec.padded
            if current and size + padded > capacity:
                self._close(current)
                current, size = [], 0
            current.append((unit, slot))
            size += padded
            if size >= capacity:
                self._close(current)
                current, size = [], 0
        if current:
            self._close(current)

    def _close(self, keys: list[tuple[Unit, int]]) -> None:
        places, off = [], 0
        for unit, slot in keys:
            chunk = unit.slots[slot].spec.chunk
            self.index.setdefault((unit.index, slot), []).append((len(self.plans), len(places)))
            places.append(_Place(unit, slot, off, chunk))
            off += chunk
        self.plans.append(_Plan(tuple(places), off))


@dataclass
class _Fill:
    """A bucket being filled: its buffer and which places got their gradient."""
    bucket: torch.Tensor
    pooled: bool  # a buffer of GradBuckets.pool (not a gradient used as it is)
    filled: list[bool]
    count: int = 0


@dataclass
class _InFlight:
    pending: PendingReduce
    places: tuple[_Place, ...]
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
    """Gradients into the buckets of a layout, each reduced once its gradients are in, in layout order (see the
    module docstring), by the state's reduce strategy. The layout is the caller's, handed to every :meth:`add` and
    :meth:`finish` of a backward (None: buckets filled in arrival order, stage 3). ``direct`` (a world of one rank:
    nothing to reduce) adds each gradient into its row as it arrives, with no bucket."""

    state: EngineState  # its reduce strategy and residency (NVMe: a unit's gradient row is read back to add)
    world: int
    capacity: int
    link: HostLink = field(default_factory=HostLink)  # how reduced rows reach the gradient rows (offload: host)
    direct: bool = False
    # arrival order (stage 3): the open bucket
    _ready: list[tuple[Unit, int, torch.Tensor]] = field(default_factory=list, init=False)
    _size: int = field(default=0, init=False)  # its padded elements
    _fills: dict[int, _Fill] = field(default_factory=dict, init=False)  # buckets of this backward not reduced yet
    _next: int = field(default=0, init=False)  # the next bucket to reduce
    _runs: dict[Key, int] = field(default_factory=dict, init=False)  # gradients of each key placed in this backward
    _inflight: list[_InFlight] = field(default_factory=list, init=False)
    _downloads: list[_Download] = field(default_factory=list, init=False)
    pool: BufferPool = field(default_factory=BufferPool, init=False)  # bucket buffers, reused every step
    # direct: the gradient row held in memory; offloaded, the copies on their way (Note [direct downloads])
    _direct_row: Optional[tuple[Unit, contextlib.ExitStack]] = field(default=None, init=False)
    _direct_copies: list[_DirectCopy] = field(default_factory=list, init=False)
    _direct_copying: int = field(default=0, init=False)  # their elements

    def add(self, layout: Optional[BucketLayout], unit: Unit, slot: int, grad: torch.Tensor) -> bool:
        """Place a gradient by ``layout``; False when it has no place left for it (it is not taken)."""
        if self.direct:
            self._add_direct(unit, slot, grad)
            return True
        if layout is None:
            self._add_in_arrival_order(unit, slot, grad)
            return True
        key = (unit.index, slot)
        runs = self._runs.get(key, 0)
        where = layout.index.get(key)
        if where is None or runs >= len(where):
            return False
        self._runs[key] = runs + 1
        for job in self._inflight:  # e.g. qgZ: start hop 2 of the bucket in flight if hop 1 has arrived
            job.pending.progress()
        b, p = where[runs]
        plan = layout.plans[b]
        fill = self._fills.get(b)
        if fill is None:
            fill = self._fills[b] = self._open(plan, grad, layout)
        if fill.pooled:
            place = plan.places[p]
            _copy_padded(fill.bucket[:, place.offset : place.offset + place.chunk], grad.reshape(-1))
        fill.filled[p] = True
        fill.count += 1
        while self._next < len(layout.plans):  # reduce, in layout order, every bucket now complete
            done = self._fills.get(self._next)
            if done is None or done.count < len(done.filled):
                break
            self._flush(layout, self._next)
        return True

    def _add_in_arrival_order(self, unit: Unit, slot: int, grad: torch.Tensor) -> None:
        """Stage 3 (Note [arrival order at stage 3] in ``zero/grad_intake.py``): a bucket holds the gradients
        in the order they arrive, reduced once ``capacity`` is reached or the next would pass it."""
        for job in self._inflight:
            job.pending.progress()
        size = unit.slots[slot].spec.padded
        if self._ready and self._size + size > self.capacity:
            self._flush_ready()
        self._ready.append((unit, slot, grad))
        self._size += size
        if self._size >= self.capacity:
            self._flush_ready()

    def _flush_ready(self) -> None:
        if not self._ready:
            return
        ready, self._ready, self._size = self._ready, [], 0
        places, off = [], 0
        for unit, slot, _ in ready:
            places.append(_Place(unit, slot, off, unit.slots[slot].spec.chunk))
            off += places[-1].chunk
        plan = _Plan(tuple(places), off)
        fill = self._open(plan, ready[0][2], None)
        if fill.pooled:
            for place, (_, _, grad) in zip(places, ready):
                _copy_padded(fill.bucket[:, place.offset : place.offset + place.chunk], grad.reshape(-1))
        del ready
        self._start(plan, fill)

    def _open(self, plan: _Plan, grad: Optional[torch.Tensor], layout: Optional[BucketLayout]) -> _Fill:
        """A bucket's buffer: a lone unpadded gradient as it is; otherwise a pool buffer of the layout's dtype."""
        unit = plan.places[0].unit
        dtype = layout.dtype if layout is not None and layout.dtype is not None else unit.compute_dtype
        filled = [False] * len(plan.places)
        if grad is not None and plan.lone and grad.dtype == dtype:
            return _Fill(grad.reshape(self.world, plan.length), False, filled)
        bucket = self.pool.take(self.world * plan.length, dtype, unit.device).view(self.world, plan.length)
        return _Fill(bucket, True, filled)

    def _flush(self, layout: BucketLayout, b: int) -> None:
        """Start reducing bucket ``b`` (zeros where no gradient came); complete the previously started one (one
        stays in flight)."""
        assert b == self._next
        plan = layout.plans[b]
        fill = self._fills.pop(b, None)
        if fill is None:  # no gradient of this bucket reached this rank
            fill = self._open(plan, None, layout)
        for place, filled in zip(plan.places, fill.filled):
            if not filled:
                fill.bucket[:, place.offset : place.offset + place.chunk].zero_()
        self._next = b + 1
        self._start(plan, fill)

    def _start(self, plan: _Plan, fill: _Fill) -> None:
        segments = [place.chunk for place in plan.places]
        names = [place.unit.slots[place.slot].name for place in plan.places]
        pending = self.state.strategies.reduce.start(fill.bucket, segments, names)
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._inflight.append(_InFlight(pending, plan.places, fill.bucket, fill.pooled))

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
            held.enter_context(self.state.residency.grads(unit))
            self._direct_row = (unit, held)

    def _release_direct(self) -> None:
        if self._direct_row is not None:
            held, self._direct_row = self._direct_row[1], None
            held.close()

    def finish(self, layout: Optional[BucketLayout]) -> None:
        """Reduce every bucket of ``layout`` not reduced yet, in layout order (zeros where no gradient came), and
        accumulate them all into the owning gradient shards; the next backward fills a layout anew."""
        while self._direct_copies:
            self._land_direct()
        self._release_direct()
        try:
            if layout is not None and not self.direct:
                while self._next < len(layout.plans):
                    self._flush(layout, self._next)
            self._flush_ready()
            while self._inflight:
                self._complete(self._inflight.pop(0))
            while self._downloads:
                self._accumulate(self._downloads.pop(0))
        finally:  # the next backward fills a layout from its start, even after a reduction raised
            self._fills, self._next, self._runs = {}, 0, {}

    def _complete(self, job: _InFlight) -> None:
        """The reduction finished: start its row's copy out and add the copies before it (and this one too
        when nothing is in flight: the host is the device)."""
        row = job.pending.finish()
        if job.pooled and row.untyped_storage().data_ptr() != job.bucket.untyped_storage().data_ptr():
            self.pool.give(job.bucket)  # the reduction has read it; only stage 0's in-place row lives on in it
            job.pooled = False
        if self.link.distinct:  # cast before the copy, not after: half the bytes, the same rounding
            row = row.to(job.places[0].unit.compute_dtype)
        transfer = self.link.download(row)
        self._downloads.append(_Download(transfer, job, row))
        keep = 0 if transfer.done else 1
        while len(self._downloads) > keep:
            self._accumulate(self._downloads.pop(0))

    def _accumulate(self, job: _Download) -> None:
        row = job.transfer.wait()
        off = 0
        for unit, places in groupby(job.job.places, key=lambda p: p.unit):  # one row in memory at a time
            with self.state.residency.grads(unit):
                views = unit.grad_views()  # on the host under optimizer offload: copied out per bucket
                for place in places:
                    c = place.chunk
                    views[place.slot].add_(row[off : off + c].to(views[place.slot].device, views[place.slot].dtype))
                    off += c
        # Only now is the result row dead (and the bucket, when stage 0 reduced in place in it).
        job.job.pending.recycle()
        if job.job.pooled:
            self.pool.give(job.job.bucket)

    def held_bytes(self) -> int:
        """Bytes of gradients waiting in buckets: full ones (ready, or in a reduction still in flight) and
        reduced rows still being copied to the host."""
        ready = sum(f.bucket.numel() * f.bucket.element_size() for f in self._fills.values())
        ready += sum(g.numel() * g.element_size() for _, _, g in self._ready)
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
