"""Peak memory per rank at scale: transformers' Llama at 0.1B to 1.06B parameters, built under
``zero.Init`` and trained on 2 nodes x 2 ranks with ZeRO++ (qwZ int8, hpZ 2, qgZ int4) and the default buffers
(no bucket keys).

For each model and each rank: the peak rise of RSS over a bare process (torch and zeropp imported, process
group up; kernel VmHWM), ``engine.memory_report()``'s peak, and the formula: model states + gathered units in
flight + gradient buckets + activations, from ``zeropp.tools.plan.memory.memory`` (what ``zeropp plan`` predicts).
The table row is the rank with the highest RSS.

    .venv/bin/python bench/bench_memory_scale.py [--models 0.1B,0.4B,0.55B,1.06B] [--precision fp32|bf16]
        [--micro 1] [--seq 128] [--steps 2] [--nvme-dir DIR] [--out bench/results/memory_scale.json]

Four ranks share this machine's memory: without offload the sum of their peaks must fit it (``zeropp plan``
gives the per-rank formula before a run); ``--nvme-dir`` keeps parameters and optimizer states in files.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402

GiB = 2**30


def main() -> None:
    from support.memory_scale import SIZES, as_row, train_memory
    from support.rss import MALLOC_ENV
    from support.world import run_world
    from dataclasses import asdict

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SIZES), help=f"comma-separated subset of {', '.join(SIZES)}")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (the config's default) or bf16; bf16 steps are slow on a CPU without a bf16 unit")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-dir", default=None,
                    help="offload parameters and optimizer states to files here (ZeRO-Infinity, hpZ off); for the "
                         "models whose states do not fit the machine's memory 4 times over")
    ap.add_argument("--out", default=os.path.join(RESULTS, "memory_scale.json"))
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        if name not in SIZES:
            raise SystemExit(f"--models: unknown {name!r}; known: {', '.join(SIZES)}")
        start = time.perf_counter()
        nvme = tempfile.mkdtemp(prefix="zeropp-memory-scale-", dir=args.nvme_dir) if args.nvme_dir else None
        try:
            ranks = run_world(train_memory, 4, asdict(SIZES[name]), args.micro, args.seq, args.steps,
                              args.precision == "bf16", nvme, ranks_per_node=2, env=MALLOC_ENV, timeout=3600)
        finally:
            if nvme is not None:
                shutil.rmtree(nvme, ignore_errors=True)
        row = as_row(name, ranks)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"{name} ({row['parameters'] / 1e9:.2f}B): peak RSS {row['peak_rss'] / GiB:.2f} GiB, report "
              f"{row['report_peak'] / GiB:.2f} GiB ({row['peak_over_report']:.2f}x), formula "
              f"{row['formula'] / GiB:.2f} GiB ({row['peak_over_formula']:.2f}x), buffers "
              f"{row['buffers'] / GiB:.2f} GiB, {row['seconds']:.0f} s", flush=True)
    write_results(args.out, {"command": " ".join(sys.argv), "precision": args.precision, "micro": args.micro,
                             "nvme": args.nvme_dir is not None,
                             "seq": args.seq, "steps": args.steps, "world": "2 x 2", "rows": rows})


if __name__ == "__main__":
    main()
