"""Plain gradient reduction: gloo's reduce_scatter_tensor vs zeropp's all-to-all + local fp32 sum, same run.

    python bench/bench_reduce.py [--world 4] [--mb 64] [--reps 5]

gloo implements reduce-scatter with an all-reduce underneath (NETSIM.md: 96 MiB on the wire per node for a
64 MiB input on 2x2, twice the ring optimum), so building the baseline on it would handicap ZeRO-3. This
times both on the same bf16 bucket, checks they agree, and writes bench/results/reduce.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.world import run_world  # noqa: E402
from results_io import RESULTS, write_results  # noqa: E402


def worker(rank: int, world: int, mb: int, reps: int) -> dict:
    from zeropp import topology
    from zeropp.comm.ledger import CommLedger
    from zeropp.comm.ops import Comm
    from zeropp.comm.reduce import AllToAllReduceScatter

    comm = Comm(topology.build(), CommLedger())
    numel = mb * 2**20 // 2 // world * world
    g = torch.Generator().manual_seed(rank)
    bucket = torch.randn(world, numel // world, generator=g).to(torch.bfloat16)
    ours = AllToAllReduceScatter(comm)

    def gloo() -> torch.Tensor:
        out = torch.empty(numel // world, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, bucket.view(-1))
        return out.float() / world

    def a2a() -> torch.Tensor:
        return ours.start(bucket, [numel // world]).finish()

    times: dict[str, list[float]] = {"gloo_reduce_scatter": [], "all_to_all_sum": []}
    results = {}
    for _ in range(reps + 1):  # first round is warm-up
        for name, fn in (("gloo_reduce_scatter", gloo), ("all_to_all_sum", a2a)):
            dist.barrier()
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
    diff = float((results["gloo_reduce_scatter"] - results["all_to_all_sum"]).abs().max())
    return {name: statistics.median(ts[1:]) for name, ts in times.items()} | {"max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mb", type=int, default=64, help="bucket size in MiB (bf16)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    res = run_world(worker, args.world, args.mb, args.reps)[0]
    res["ratio_all_to_all_over_gloo"] = res["all_to_all_sum"] / res["gloo_reduce_scatter"]
    write_results(os.path.join(RESULTS, "reduce.json"), vars(args) | res)
    print("| world | bucket | gloo reduce_scatter_tensor | all-to-all + fp32 sum | ratio | max abs diff |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.world} | {args.mb} MiB bf16 | {res['gloo_reduce_scatter']*1e3:.0f} ms | "
          f"{res['all_to_all_sum']*1e3:.0f} ms | {res['ratio_all_to_all_over_gloo']:.2f}x | {res['max_abs_diff']:.2e} |")


if __name__ == "__main__":
    main()
