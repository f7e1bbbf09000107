"""What the checkpoint's SHA-256 costs on one shard file of a realistic size (Note [checkpoint verification]).

A shard holds the rank's fp32 master chunk and two Adam moments: 12 bytes per parameter it owns. The
default, 512 MiB, is a 1.4B-parameter model on 32 ranks (or 350M on 8). Measured, alternating, ``--repeat``
times each (medians):

- serialize: torch.save into a sink that drops the bytes, through the hashing writer and without it:
  the CPU cost of the hash alone, free of disk noise;
- save: ``atomic_write`` (torch.save through the hashing writer, fsync, rename) against the same write
  without hashing (``atomic_replace`` with torch.save to the path): end to end, disk included (noisy on a
  shared disk);
- load: ``sha256_file`` (what ``verify_shard`` adds before a rank reads its file) against ``torch.load``;
- raw throughput of SHA-256, BLAKE2b and CRC-32 on the same bytes, for the choice of checksum.

    .venv/bin/python bench/bench_checkpoint_hash.py [--mib 512] [--repeat 5] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib

import torch

from zeropp.checkpoint.format import _HashingWriter, atomic_replace, atomic_write, sha256_file


class _Sink:
    """A binary file that drops what it is given."""

    def write(self, data: object) -> int:
        return memoryview(data).nbytes  # type: ignore[arg-type]

    def flush(self) -> None:
        pass


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="shard size in MiB (default 512)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each measurement (default 5)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (default: the temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 12
    payload = {"params": {"w": torch.randn(n)}, "optimizer": {"state": {0: {"exp_avg": torch.randn(n),
                                                                            "exp_avg_sq": torch.rand(n)}}}}
    work = tempfile.mkdtemp(dir=args.dir)
    hashed, plain = os.path.join(work, "hashed.pt"), os.path.join(work, "plain.pt")
    save_h, save_p, verify, load, ser_h, ser_p = [], [], [], [], [], []
    for _ in range(args.repeat):
        ser_h.append(_timed(lambda: torch.save(payload, _HashingWriter(_Sink()))))  # type: ignore[arg-type]
        ser_p.append(_timed(lambda: torch.save(payload, _Sink())))
        save_h.append(_timed(lambda: atomic_write(hashed, lambda f: torch.save(payload, f))))
        save_p.append(_timed(lambda: atomic_replace(plain, lambda tmp: torch.save(payload, tmp))))
        verify.append(_timed(lambda: sha256_file(hashed)))
        load.append(_timed(lambda: torch.load(hashed, weights_only=False)))
    size = os.path.getsize(hashed)
    with open(hashed, "rb") as f:
        data = f.read()
    rates = {name: size / 1e9 / statistics.median(_timed(lambda fn=fn: fn(data)) for _ in range(3))
             for name, fn in (("sha256", lambda b: hashlib.sha256(b).digest()),
                              ("blake2b", lambda b: hashlib.blake2b(b).digest()), ("crc32", zlib.crc32))}
    for path in (hashed, plain):
        os.unlink(path)
    os.rmdir(work)
    med = statistics.median
    result = {
        "shard_bytes": size, "repeat": args.repeat,
        "serialize_hashed_s": med(ser_h), "serialize_plain_s": med(ser_p), "hash_cpu_s": med(ser_h) - med(ser_p),
        "save_hashed_s": med(save_h), "save_plain_s": med(save_p),
        "save_overhead": med(save_h) / med(save_p) - 1,
        "verify_s": med(verify), "torch_load_s": med(load), "verify_vs_load": med(verify) / med(load),
        "hash_gb_per_s": rates,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
