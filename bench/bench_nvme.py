"""Offload in training: step time with the optimizer on the host and on NVMe, and the file bandwidth the NVMe
offload achieves, against in-memory training and a plain sequential file copy on the same disk, in one run.

One process (a world of 1: every byte of the model's states goes through this rank's files) trains the demo
GPT in bf16 at ZeRO stage 3 under these settings, round-robin so all see the same background load:

  memory        no offload (torch AdamW)
  cpu_unfused   offload_optimizer on the host, CpuAdam, the 16-bit shard recast in a second pass
  cpu           offload_optimizer on the host, CpuAdam writing the 16-bit shard in its own pass (the engine's way)
  nvme_opt      offload_optimizer on NVMe (masters, gradient rows, Adam moments in a file)
  nvme_all      offload_optimizer and offload_param on NVMe (the 16-bit shards too)

For each: the median step time over the timed steps, and the bytes the offload files read and wrote per
step (AioPool's counters) divided by the step time. "copy" is a plain sequential file copy
(shutil.copyfile + fsync) of a cold file as large as one step's offload traffic, on the same directory, timed
between the settings. The achieved offload bandwidth includes waiting for compute (the reads are prefetched
one unit ahead and the writes are asynchronous), so it is a lower bound on what the I/O path can do;
bench/bench_aio.py measures the raw AioPool bandwidth.

Usage: python bench/bench_nvme.py [--dir /tmp] [--n-layer 8] [--n-embd 256] [--steps 6] [--warmup 2]
                                  [--rounds 2] [--out bench/results/nvme.json]
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

import zeropp
from zeropp.tools.demo.data import corpus_tokens, get_batch
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.offload.cpu_adam import CpuAdam
from results_io import write_results

SETTINGS = ("memory", "cpu_unfused", "cpu", "nvme_opt", "nvme_all")


class _UnfusedCpuAdam(CpuAdam):
    step_and_copy = None  # the engine then steps and recasts the shard in a second pass


def config(setting: str, nvme_dir: str) -> dict:
    zero: dict = {"stage": 3, "reduce_bucket_size": 5_000_000}
    if setting.startswith("cpu"):
        zero["offload_optimizer"] = {"device": "cpu"}
    elif setting != "memory":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 4}
    if setting == "nvme_all":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 5,
                                 "buffer_size": 20_000_000}
    return {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}


def nvme_bytes(engine) -> tuple[int, int]:
    """Bytes the engine's offload pools (parameters, optimizer states) have read and written since start-up."""
    stores = [s for s in (getattr(engine.residency, "params", None), getattr(engine.residency, "states", None))
              if s is not None]
    return sum(s.pool.bytes_read for s in stores), sum(s.pool.bytes_written for s in stores)


def io_bytes(engine) -> int:
    return sum(nvme_bytes(engine))


def train(setting: str, args: argparse.Namespace, nvme_dir: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=args.n_layer, n_embd=args.n_embd))
    opt = (lambda ps: _UnfusedCpuAdam(ps, lr=3e-4, weight_decay=0.1)) if setting == "cpu_unfused" else None
    engine, *_ = zeropp.initialize(model=model, config=config(setting, nvme_dir), optimizer=opt)
    tokens = corpus_tokens()
    times, io, losses = [], [], []
    for step in range(args.warmup + args.steps):
        x, y = get_batch(tokens, step, 8, 64, 0, 0, 1)
        before, t0 = io_bytes(engine), time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        io.append(io_bytes(engine) - before)
        losses.append(loss.item())
    engine.close()
    timed = slice(args.warmup, None)
    return {"step_s": statistics.median(times[timed]), "io_bytes_per_step": statistics.median(io[timed]),
            "step_times": times, "losses": losses, "parameters": model.num_parameters()}


def plain_copy(nvme_dir: str, nbytes: int) -> float:
    """Seconds for a cold sequential copy of an ``nbytes`` file (read + write every byte, fsync)."""
    src, dst = os.path.join(nvme_dir, "copy-src.bin"), os.path.join(nvme_dir, "copy-dst.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20) * max(1, int(nbytes) // (2 << 20)))  # half read, half written
        os.fsync(f.fileno())
    fd = os.open(src, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    os.unlink(src)
    os.unlink(dst)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/results/nvme.json")
    args = p.parse_args()
    nvme_dir = tempfile.mkdtemp(prefix="zeropp-bench-nvme-", dir=args.dir)
    rows: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    copies: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for setting in SETTINGS:
                r = train(setting, args, nvme_dir)
                rows[setting].append(r)
                print(f"round {rnd} {setting:<9} step {r['step_s'] * 1e3:8.1f} ms  "
                      f"offload I/O {r['io_bytes_per_step'] / 2**20:8.1f} MiB/step", flush=True)
                if r["io_bytes_per_step"]:
                    secs = plain_copy(nvme_dir, r["io_bytes_per_step"])
                    copies.append({"setting": setting, "bytes": r["io_bytes_per_step"], "seconds": secs})
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    summary = {}
    for setting in SETTINGS:
        step = statistics.median(r["step_s"] for r in rows[setting])
        io = statistics.median(r["io_bytes_per_step"] for r in rows[setting])
        summary[setting] = {"step_ms": step * 1e3, "io_mib_per_step": io / 2**20,
                            "achieved_mib_s": io / 2**20 / step if io else 0.0,
                            "step_vs_memory": step / statistics.median(r["step_s"] for r in rows["memory"])}
    for setting in ("nvme_opt", "nvme_all"):
        mine = [c for c in copies if c["setting"] == setting]
        copy_mib_s = statistics.median(c["bytes"] / 2**20 / c["seconds"] for c in mine)
        summary[setting]["plain_copy_mib_s"] = copy_mib_s
        summary[setting]["achieved_vs_copy"] = summary[setting]["achieved_mib_s"] / copy_mib_s
    fused = [a["step_s"] / b["step_s"] for a, b in zip(rows["cpu_unfused"], rows["cpu"])]
    summary["cpu"]["unfused_over_fused"] = statistics.median(fused)  # > 1: the fused copy-back is faster
    same = all(rows[s][0]["losses"] == rows["memory"][0]["losses"] for s in SETTINGS)
    print(json.dumps(summary, indent=1))
    print(f"losses identical across settings: {same}")
    sources = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout
    out = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sources": sources.strip(), "args": vars(args), "parameters": rows["memory"][0]["parameters"],
           "summary": summary, "losses_identical": same, "rows": rows, "copies": copies,
           "threads": torch.get_num_threads()}
    write_results(args.out, out)


if __name__ == "__main__":
    main()
