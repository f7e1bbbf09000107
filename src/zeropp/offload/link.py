"""The host link: how optimizer offload moves rows between the compute device and host memory.

ZeRO-Offload keeps the fp32 masters, the gradient rows and the optimizer state on the host and the 16-bit
weights on the accelerator. Two copies cross the link each step: every reduced gradient bucket goes down
(device -> host) while backward goes on, and every updated 16-bit shard goes up (host -> device) before
the next forward gathers it. The engine and the gradient buckets are handed a link and never look at the
device type:

* ``HostLink``: the host *is* the device (this CPU build). Nothing is copied; a download is the row itself.
* ``CudaLink``: page-locked host rows (``pin_memory``), one side stream per direction and events, so both
  copies run on the copy engines while the compute stream goes on.
* ``ThreadedLink``: a CPU stand-in for a separate device with an asynchronous copy engine. Copies run on a
  worker thread after a delay and destinations hold NaN until then, so a test run through it shows that
  every copy is waited for before its result is read and that no source changes while a copy reads it.

The protocol: ``download(src)`` and ``upload(src, dst)`` start a copy and return a ``Transfer``;
``Transfer.wait()`` returns the destination once the caller may read it (a download: the host may read it;
an upload: work queued on the compute stream after the call sees it). The source must stay unchanged
until then, and before the host writes a row that an upload may still be reading it calls ``wait_uploads()``.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

HOST = torch.device("cpu")


class Transfer:
    """A copy started by a link; ``wait()`` returns its destination once it may be read."""

    def __init__(self, dst: torch.Tensor, wait: Optional[Callable[[], None]] = None) -> None:
        self._dst = dst
        self._wait = wait

    @property
    def done(self) -> bool:
        """True when nothing is in flight (the destination may be read without waiting)."""
        return self._wait is None

    @property
    def destination(self) -> torch.Tensor:
        """Where the copy lands (for accounting: its contents may be read only after :meth:`wait`)."""
        return self._dst

    def wait(self) -> torch.Tensor:
        if self._wait is not None:
            self._wait()
            self._wait = None
        return self._dst


class HostLink:
    """Host and device are the same memory: nothing moves, every transfer is complete when started."""

    #: whether the device rows are memory apart from the host rows (then the 16-bit shard is staged on the
    #: host for the optimizer to write, and uploaded after the step)
    distinct = False

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host row of zeros for the offloaded states (page-locked where that speeds up copies)."""
        return torch.zeros(numel, dtype=dtype, device=HOST)

    def download(self, src: torch.Tensor) -> Transfer:
        """Start copying ``src`` (on the device) to host memory."""
        return Transfer(src)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        """Start copying the host row ``src`` into the device row ``dst``."""
        if dst is not src:
            dst.copy_(src)
        return Transfer(dst)

    def wait_uploads(self) -> None:
        """Wait until no upload still reads a host row (before the host writes those rows again)."""

    def fetch(self, src: torch.Tensor, device: torch.device) -> Transfer:
        """Start copying the host tensor ``src`` into a new tensor on ``device`` (strides kept where dense).

        Unlike :meth:`upload`, ``src`` is a host copy that nobody writes again (an activation checkpoint
        kept on the host), so :meth:`wait_uploads` does not wait for it. Here: a synchronous copy, or ``src``
        itself when it already is on ``device``."""
        return Transfer(src if src.device == device else src.to(device))


class CudaLink(HostLink):
    """Copies on one side stream per direction, ordered against the compute stream by events.

    A download waits for the work that produced its source, copies into a (pinned) host buffer and keeps
    the source's memory from reuse until the copy ran (``record_stream``); its ``wait`` blocks the host on
    the copy's event. An upload waits for the compute stream's work queued so far (earlier readers of the
    destination) and its ``wait`` makes the compute stream, not the host, wait for the copy.
    """

    distinct = True

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._down = torch.cuda.Stream(device)
        self._up = torch.cuda.Stream(device)
        self._uploads: list[torch.cuda.Event] = []

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=self.pin_memory)

    def download(self, src: torch.Tensor) -> Transfer:
        produced = torch.cuda.current_stream(self.device).record_event()
        dst = torch.empty(src.shape, dtype=src.dtype, device=HOST, pin_memory=self.pin_memory)
        with torch.cuda.stream(self._down):
            self._down.wait_event(produced)
            dst.copy_(src, non_blocking=True)
            done = self._down.record_event()
        src.record_stream(self._down)
        return Transfer(dst, done.synchronize)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        compute = torch.cuda.current_stream(self.device)
        queued = compute.record_event()
        with torch.cuda.stream(self._up):
            self._up.wait_event(queued)
            dst.copy_(src, non_blocking=True)
            done = self._up.record_event()
        self._uploads.append(done)
        return Transfer(dst, lambda: torch.cuda.current_stream(self.device).wait_event(done))

    def wait_uploads(self) -> None:
        for event in self._uploads:
            event.synchronize()
        self._uploads.clear()

    def fetch(self, src: torch.Tensor, device: torch.device) -> Transfer:
        # as upload, into a new device tensor; `wait` orders the compute stream after the copy. A pinned
        # source is kept from reuse until the copy ran by torch's host allocator (it records the stream).
        dst = torch.empty_like(src, device=device)
        queued = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._up):
            self._up.wait_event(queued)
            dst.copy_(src, non_blocking=True)
            done = self._up.record_event()
        return Transfer(dst, lambda: torch.cuda.current_stream(self.device).wait_event(done))


class ThreadedLink(HostLink):
    """A separate "device" in host memory with an asynchronous copy engine: a worker thread that copies
    ``delay`` seconds after each request, in request order. Destinations hold NaN (integers: -1) until the
    copy ran and sources are read only when it runs, so reading early or changing a source early shows."""

    distinct = True

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeropp-copy-engine")
        self._uploads: list[Future] = []
        self.copies = 0  # copies run so far, counted by the one worker (a test checks the link was used)

    def _copy_later(self, src: torch.Tensor, dst: torch.Tensor) -> Future:
        dst.fill_(float("nan") if dst.is_floating_point() else -1)

        def run() -> None:
            time.sleep(self.delay)
            dst.copy_(src)
            self.copies += 1

        return self._engine.submit(run)

    def download(self, src: torch.Tensor) -> Transfer:
        dst = torch.empty_like(src, device=HOST)
        return Transfer(dst, self._copy_later(src, dst).result)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        done = self._copy_later(src, dst)
        self._uploads.append(done)
        return Transfer(dst, done.result)

    def wait_uploads(self) -> None:
        for done in self._uploads:
            done.result()
        self._uploads.clear()

    def fetch(self, src: torch.Tensor, device: torch.device) -> Transfer:
        dst = torch.empty_like(src)  # the "device" is host memory here
        return Transfer(dst, self._copy_later(src, dst).result)


def build_link(device: torch.device, offloads: bool, pin_memory: bool) -> HostLink:
    """The link for rows offloaded from ``device``: none to cross on the host, streams on CUDA. Other
    accelerators get ``HostLink``, whose rows are then copied synchronously where they are used."""
    if offloads and device.type == "cuda":
        return CudaLink(device, pin_memory)
    return HostLink()
