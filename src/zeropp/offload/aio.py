"""``AioPool``: asynchronous file I/O for NVMe offload (ZeRO-Infinity), through a fixed pool of page-aligned
buffers.

One pool owns one file per rank under ``path_dir`` (``zeropp-<tag>-rank<r>-<pid>-<n>.bin``), created and, when a
capacity is given, preallocated with ``posix_fallocate`` at start-up, so that a full disk is a clear
``OffloadError`` then and not ``ENOSPC`` in the middle of a run. The file is removed by ``close()``, when the
pool is garbage-collected, and at interpreter exit.

Each name gets a fixed extent of the file the first time it is written (4 KiB aligned, its size fixed from
then on). ``write_async(name, tensor)`` / ``read_async(name, out)`` cut the tensor into ``buffer_size``
chunks and queue them on a small thread pool; each worker takes a buffer from the pool, copies (write) or
``preadv``s (read) through it, and gives it back, so at most ``buffer_count x buffer_size`` bytes of staging
memory exist whatever is in flight. ``os.pwrite`` / ``os.preadv`` and torch's ``copy_`` release the GIL, so
the I/O overlaps Python and compute. A chunk whose source/destination memory is itself 4 KiB aligned and
whole (tensors from ``aligned_empty``) skips the staging copy.

The file is opened with ``O_DIRECT`` when the file system accepts it (ext4, xfs on NVMe): no page-cache copy
and no cache pollution, which is what NVMe offload wants. tmpfs and some others refuse ``O_DIRECT``; the pool
then uses buffered I/O, syncs each completed write request (``fdatasync``: "written" means on the device in
both modes) and drops the written range from the page cache (``posix_fadvise(DONTNEED)``).

Requests on the same name are ordered: a new request on a name first waits for the previous one on that name.
The caller keeps a written tensor unchanged, and does not read an ``out`` tensor, until ``handle.wait()``.

L3 helper: no process groups; ``rank`` only names the file (default ``$RANK`` or 0).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["AioHandle", "AioPool", "OffloadError", "aligned_empty"]

_SERIAL = itertools.count()
ALIGN = 4096  # O_DIRECT alignment of buffer addresses, file offsets and lengths (>= logical block size)


class OffloadError(RuntimeError):
    """An offload path that cannot be used: unwritable, not enough free space, capacity exceeded."""


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D CPU tensor whose data is page-aligned (anonymous mmap), so ``AioPool`` moves it without a
    staging copy. (On CUDA hosts pinned memory from ``torch.empty(..., pin_memory=True)`` is page-aligned
    too.)"""
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    mm = mmap.mmap(-1, _round_up(nbytes), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mm, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)


class AioHandle:
    """A queued request; ``wait()`` blocks until every chunk is done and re-raises the first I/O error."""

    def __init__(self, futures: list[Future], nbytes: int, keep: object = None, on_done=None):
        self._futures, self.nbytes, self._keep, self._on_done = futures, nbytes, keep, on_done
        self._finished = False

    def done(self) -> bool:
        """True when every chunk has completed (successfully or not)."""
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        """Block until the request is complete; returns its byte count. Raises ``OSError`` on an I/O error."""
        if not self._finished:
            try:
                for f in self._futures:
                    f.result()
                if self._on_done is not None:
                    self._on_done()
            finally:
                self._finished, self._keep, self._on_done = True, None, None
        return self.nbytes


@dataclass(frozen=True)
class _Extent:
    offset: int
    nbytes: int


def _remove_file(fd_box: list[int | None], path: str) -> None:
    """Finalizer: close and unlink (never raises)."""
    fd = fd_box[0]
    fd_box[0] = None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(path)
    except OSError:
        pass


class AioPool:
    """Asynchronous reads and writes of named tensors to one per-rank file under ``path_dir``.

    Args:
        path_dir: directory for the file (created if missing).
        buffer_count: number of staging buffers (also the default number of I/O threads, at most 8).
        buffer_size: bytes per staging buffer (rounded up to 4 KiB); the chunk size of every request.
        capacity: bytes the file must hold; checked against free space and preallocated at start-up.
            None: the file grows as names are added (no start-up space check).
        rank: names the file (default ``$RANK`` or 0); tag: names the file too (e.g. "param", "optimizer").
        direct: True forces O_DIRECT (error if refused), False forces buffered I/O, None tries O_DIRECT.
        threads: I/O threads (default ``min(buffer_count, 8)``).

    Raises ``OffloadError`` (naming the path and the numbers) when the directory cannot be written or the
    file system has less free space than ``capacity``.
    """

    def __init__(self, path_dir: str | os.PathLike, buffer_count: int = 4, buffer_size: int = 1 << 24, *,
                 capacity: int | None = None, rank: int | None = None, tag: str = "offload",
                 direct: bool | None = None, threads: int | None = None):
        if buffer_count < 1 or buffer_size < 1:
            raise ValueError(f"buffer_count and buffer_size must be positive, got {buffer_count}, {buffer_size}")
        self.path_dir = os.path.abspath(os.fspath(path_dir))
        self.buffer_size = _round_up(buffer_size)
        self.buffer_count = buffer_count
        self.capacity = None if capacity is None else _round_up(capacity)
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        serial = next(_SERIAL)  # several pools (engines) in one process never share a file
        self.path = os.path.join(self.path_dir, f"zeropp-{tag}-rank{rank}-{os.getpid()}-{serial}.bin")
        self._check_dir()
        self._fd_box: list[int | None] = [None]
        self.direct = self._open(direct)
        self._finalizer = weakref.finalize(self, _remove_file, self._fd_box, self.path)
        self._preallocate()
        # Staging buffers: one anonymous mapping, page-aligned, cut into buffer_count slices.
        self._mm = mmap.mmap(-1, self.buffer_size * buffer_count, flags=mmap.MAP_PRIVATE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._buf_addr = [base + i * self.buffer_size for i in range(buffer_count)]
        self._buffers: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(buffer_count):
            self._buffers.put(i)
        self._executor = ThreadPoolExecutor(max_workers=threads or min(buffer_count, 8),
                                            thread_name_prefix="zeropp-aio")
        self._extents: dict[str, _Extent] = {}
        self._end = 0  # next free offset in the file
        self._lock = threading.Lock()
        self._pending: dict[str, AioHandle] = {}
        self._closed = False
        self.bytes_written = 0  # queued by write_async / read_async since start-up (benchmarks read them)
        self.bytes_read = 0

    # ------------------------------------------------------------------------------------------- start-up
    def _check_dir(self) -> None:
        try:
            os.makedirs(self.path_dir, exist_ok=True)
        except OSError as e:
            raise OffloadError(f"offload path {self.path_dir!r} cannot be created: {e.strerror or e}") from e
        if not os.path.isdir(self.path_dir):
            raise OffloadError(f"offload path {self.path_dir!r} is not a directory")
        if self.capacity is not None:
            st = os.statvfs(self.path_dir)
            free = st.f_bavail * st.f_frsize
            if free < self.capacity:
                raise OffloadError(
                    f"offload path {self.path_dir!r}: not enough free disk space: the offload file needs "
                    f"{self.capacity:,} bytes ({self.capacity / 2**30:.2f} GiB), the file system has "
                    f"{free:,} bytes ({free / 2**30:.2f} GiB) free")

    def _open(self, direct: bool | None) -> bool:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        o_direct = getattr(os, "O_DIRECT", 0)
        if direct is not False and o_direct:
            try:
                self._fd_box[0] = os.open(self.path, flags | o_direct, 0o600)
                return True
            except OSError as e:
                if direct:
                    raise OffloadError(f"offload path {self.path_dir!r}: O_DIRECT refused: {e.strerror}") from e
                if e.errno != 22:  # EINVAL: the file system does not do O_DIRECT; anything else is fatal
                    raise OffloadError(f"offload path {self.path_dir!r} is not writable: {e.strerror}") from e
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
        elif direct:
            raise OffloadError("O_DIRECT is not available on this platform")
        try:
            self._fd_box[0] = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise OffloadError(f"offload path {self.path_dir!r} is not writable: {e.strerror}") from e
        return False

    def _preallocate(self) -> None:
        if not self.capacity:
            return
        try:
            os.posix_fallocate(self._fd, 0, self.capacity)
        except OSError as e:
            self.close()
            raise OffloadError(f"offload path {self.path_dir!r}: cannot reserve {self.capacity:,} bytes for "
                               f"{os.path.basename(self.path)}: {e.strerror}") from e

    @property
    def _fd(self) -> int:
        fd = self._fd_box[0]
        if fd is None:
            raise OffloadError(f"AioPool on {self.path!r} is closed")
        return fd

    # ---------------------------------------------------------------------------------------------- API
    def nbytes(self, name: str) -> int | None:
        """Bytes stored under ``name``, or None if it was never written."""
        ext = self._extents.get(name)
        return None if ext is None else ext.nbytes

    def write_async(self, name: str, tensor: torch.Tensor) -> AioHandle:
        """Queue a write of ``tensor``'s bytes under ``name`` (its size is fixed by the first write)."""
        t = tensor.detach()
        if t.device.type != "cpu":
            raise ValueError("AioPool writes CPU tensors; copy device tensors to (pinned) host memory first")
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        self._order(name)
        with self._lock:
            ext = self._extents.get(name)
            if ext is None:
                ext = self._allocate(name, nbytes)
            elif ext.nbytes != nbytes:
                raise ValueError(f"AioPool: {name!r} holds {ext.nbytes} bytes; cannot write {nbytes}")
        src = t.view(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        futures = [self._executor.submit(self._write_chunk, src, ext.offset, a, min(self.buffer_size, nbytes - a))
                   for a in range(0, nbytes, self.buffer_size)]
        self.bytes_written += nbytes
        on_done = None if self.direct else (lambda: self._settle(ext))
        return self._track(name, AioHandle(futures, nbytes, keep=t, on_done=on_done))

    def read_async(self, name: str, out: torch.Tensor) -> AioHandle:
        """Queue a read of ``name`` into ``out`` (a contiguous CPU tensor of exactly the stored byte count)."""
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("AioPool reads into contiguous CPU tensors")
        nbytes = out.numel() * out.element_size()
        self._order(name)
        ext = self._extents.get(name)
        if ext is None:
            raise KeyError(f"AioPool: nothing was written under {name!r}")
        if ext.nbytes != nbytes:
            raise ValueError(f"AioPool: {name!r} holds {ext.nbytes} bytes; out has {nbytes}")
        self.bytes_read += nbytes
        dst = out.detach().view(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        futures = [self._executor.submit(self._read_chunk, dst, ext.offset, a, min(self.buffer_size, nbytes - a))
                   for a in range(0, nbytes, self.buffer_size)]
        return self._track(name, AioHandle(futures, nbytes, keep=out))

    def wait_all(self) -> None:
        """Wait for every request in flight."""
        for h in list(self._pending.values()):
            h.wait()

    def close(self) -> None:
        """Wait for requests in flight, stop the threads, close and delete the file (idempotent)."""
        if getattr(self, "_closed", True):
            if hasattr(self, "_finalizer"):
                self._finalizer()
            return
        self._closed = True
        try:
            for h in list(self._pending.values()):
                try:
                    h.wait()
                except OSError:
                    pass
            self._executor.shutdown(wait=True)
        finally:
            self._finalizer()

    def __enter__(self) -> AioPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- workers
    def _allocate(self, name: str, nbytes: int) -> _Extent:
        size = _round_up(nbytes)
        if self.capacity is not None and self._end + size > self.capacity:
            raise OffloadError(f"AioPool {self.path!r}: capacity {self.capacity:,} bytes exceeded adding "
                               f"{name!r} ({nbytes:,} bytes; {self._end:,} in use)")
        ext = _Extent(self._end, nbytes)
        self._extents[name] = ext
        self._end += size
        return ext

    def _order(self, name: str) -> None:
        if self._closed:
            raise OffloadError(f"AioPool on {self.path!r} is closed")
        prev = self._pending.get(name)
        if prev is not None:
            prev.wait()

    def _track(self, name: str, h: AioHandle) -> AioHandle:
        self._pending[name] = h
        if len(self._pending) > 4 * self.buffer_count:  # forget finished requests (their owners hold them)
            for k in [k for k, v in self._pending.items() if v is not h and v.done()]:
                del self._pending[k]
        return h

    def _no_staging(self, addr: int, n: int) -> bool:
        """The chunk can go straight from/to the tensor's memory: always in buffered mode; with O_DIRECT when
        the address and the length are 4 KiB aligned."""
        return not self.direct or (addr % ALIGN == 0 and n % ALIGN == 0)

    # Copies use ctypes.memmove: it releases the GIL and, unlike torch's copy_, starts no OpenMP team in the
    # I/O threads (which would compete with the training threads for the cores).
    def _write_chunk(self, src: torch.Tensor, base: int, a: int, n: int) -> None:
        fd, addr = self._fd, src.data_ptr() + a
        if self._no_staging(addr, n):
            _pwrite_all(fd, _mem(addr, n), base + a)
            return
        i = self._buffers.get()
        try:
            buf = self._buf_addr[i]
            ctypes.memmove(buf, addr, n)
            size = _round_up(n)
            if size > n:
                ctypes.memset(buf + n, 0, size - n)
            _pwrite_all(fd, _mem(buf, size), base + a)
        finally:
            self._buffers.put(i)

    def _read_chunk(self, dst: torch.Tensor, base: int, a: int, n: int) -> None:
        fd, addr = self._fd, dst.data_ptr() + a
        if self._no_staging(addr, n):
            _pread_all(fd, _mem(addr, n), base + a, n)
            return
        i = self._buffers.get()
        try:
            buf = self._buf_addr[i]
            _pread_all(fd, _mem(buf, _round_up(n)), base + a, n)
            ctypes.memmove(addr, buf, n)
        finally:
            self._buffers.put(i)

    def _settle(self, ext: _Extent) -> None:
        """Buffered mode: make a completed write durable and drop it from the page cache."""
        os.fdatasync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, ext.offset, _round_up(ext.nbytes), os.POSIX_FADV_DONTNEED)


def _mem(addr: int, n: int) -> memoryview:
    """A writable byte view of ``n`` bytes of memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _pwrite_all(fd: int, buf, offset: int) -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


def _pread_all(fd: int, buf, offset: int, need: int) -> None:
    """Read into ``buf`` at ``offset`` until at least ``need`` bytes arrived (a short read at end of file
    is fine past ``need``: O_DIRECT reads are padded to the alignment)."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < need:
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got == 0:
            raise OSError(f"unexpected end of offload file at offset {offset + done}")
        done += got

