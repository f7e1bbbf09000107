"""NVMe-offload I/O bandwidth: AioPool writes and reads of a 1 GiB tensor against plain sequential file I/O
on the same disk, in one run.

Per round (round-robin, so all see the same background load; medians over rounds):
  plain_write   open(path, "wb").write(<the tensor's memory>) + fsync   (no copy into bytes first)
  plain_read    readinto(<preallocated tensor>) of that file, cold (evicted from the page cache first)
  copyfile      shutil.copyfile of a cold 1 GiB file + fsync of the copy (reads and writes every byte)
  aio_write     AioPool.write_async(name, tensor).wait()                 (O_DIRECT when the fs takes it)
  aio_read      AioPool.read_async(name, out).wait()
for an ordinary tensor (torch.empty: staged through the pool's aligned buffers) and a page-aligned one
(zeropp.offload.aio.aligned_empty: straight from/to the tensor's memory). Before every read the file's pages
are dropped from the page cache (fsync + posix_fadvise DONTNEED), so reads come from the disk in both cases.

Usage: python bench/bench_aio.py [--dir /tmp] [--gib 1] [--reps 3] [--buffer-count 8] [--buffer-mib 16]
                                 [--out bench/results/aio.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from zeropp.offload import AioPool
from zeropp.offload.aio import aligned_empty
from results_io import write_results

GiB = 1 << 30


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path: str, t: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(t.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: str, out: torch.Tensor) -> None:
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(out.view(torch.uint8).numpy())
        got = 0
        while got < len(mv):
            n = f.readinto(mv[got:])
            if not n:
                raise OSError("short read")
            got += n


def copyfile(src: str, dst: str) -> None:
    shutil.copyfile(src, dst)
    evict(dst)  # fsync: the copy is on the disk, as the other writes are


def disk_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10, check=False).stdout.splitlines()
        dev, fstype = out[-1].split()[:2]
        return f"{dev} ({fstype})"
    except Exception:  # noqa: BLE001
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buffer-count", type=int, default=8)
    ap.add_argument("--buffer-mib", type=int, default=16)
    ap.add_argument("--out", default="bench/results/aio.json")
    args = ap.parse_args()
    nbytes = int(args.gib * GiB) // 4 * 4
    work = tempfile.mkdtemp(prefix="zeropp-bench-aio-", dir=args.dir)
    src_plain, dst_copy = os.path.join(work, "plain.bin"), os.path.join(work, "copy.bin")
    gen = torch.Generator().manual_seed(0)
    plain_t = torch.randn(nbytes // 4, generator=gen)
    aligned_t = aligned_empty(nbytes // 4)
    aligned_t.copy_(plain_t)
    out_plain, out_aligned = torch.zeros_like(plain_t), aligned_empty(nbytes // 4)
    out_aligned.zero_()  # touch the pages now: first-touch faults are not I/O
    pool = AioPool(os.path.join(work, "pool"), args.buffer_count, args.buffer_mib << 20, capacity=2 * nbytes + GiB)
    try:
        plain_write(src_plain, plain_t)
        ops = {
            "plain_write": (lambda: None, lambda: plain_write(src_plain, plain_t)),
            "plain_read": (lambda: evict(src_plain), lambda: plain_read(src_plain, out_plain)),
            "copyfile": (lambda: evict(src_plain), lambda: copyfile(src_plain, dst_copy)),
            "aio_write": (lambda: None, lambda: pool.write_async("t", plain_t).wait()),
            "aio_read": (lambda: evict(pool.path), lambda: pool.read_async("t", out_plain).wait()),
            "aio_write_aligned": (lambda: None, lambda: pool.write_async("ta", aligned_t).wait()),
            "aio_read_aligned": (lambda: evict(pool.path), lambda: pool.read_async("ta", out_aligned).wait()),
        }
        times: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(args.reps):
            for name, (prep, fn) in ops.items():
                prep()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        assert torch.equal(out_plain, plain_t) and torch.equal(out_aligned, aligned_t)
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}

        def ratio(a: str, b: str) -> float:  # median of per-round bandwidth ratios a/b
            return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

        result = {
            "meta": {"date": datetime.date.today().isoformat(), "dir": args.dir, "disk": disk_of(args.dir),
                     "bytes": nbytes, "reps": args.reps, "buffer_count": args.buffer_count,
                     "buffer_size": args.buffer_mib << 20, "o_direct": pool.direct, "torch": torch.__version__,
                     "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()[0],
                     "command": f"python bench/bench_aio.py --dir {args.dir} --gib {args.gib:g} "
                                f"--reps {args.reps} --buffer-count {args.buffer_count} "
                                f"--buffer-mib {args.buffer_mib}"},
            "GB_per_s": gbs, "seconds": times,
            "ratios": {
                "aio_write / plain_write": ratio("aio_write", "plain_write"),
                "aio_read / plain_read": ratio("aio_read", "plain_read"),
                "aio_write_aligned / plain_write": ratio("aio_write_aligned", "plain_write"),
                "aio_read_aligned / plain_read": ratio("aio_read_aligned", "plain_read"),
                "aio_write / copyfile": ratio("aio_write", "copyfile"),
                "aio_read / copyfile": ratio("aio_read", "copyfile"),
            },
        }
        result["meta"]["load_average_at_end"] = os.getloadavg()[0]
    finally:
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("meta", "GB_per_s", "ratios")}, indent=1))
    write_results(args.out, result)


if __name__ == "__main__":
    main()
