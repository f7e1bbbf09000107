"""The engine's quantized gather (qwZ) and reduction (qgZ) per step, against a memcpy of the same step's
plain 16-bit volume: before (buffers allocated per unit) and after (reused buffers, Note [buffer pool]).

One simulated rank of ``--world`` ranks (``--ranks-per-node`` to a node) runs the strategy code of a step
on transformer-block units (``--dim``, ``--units``): every unit gathered once, every gradient bucket
(``--units-per-bucket`` blocks) reduced once. Collectives are a loopback (each destination gets this rank's
own rows, a plain copy) whose time is measured and subtracted, so what is timed is the strategy's own
work: quantize, dequantize, qgZ's fp32 sums, buffer handling. The yardstick is ``copy_`` of the bytes the
plain bf16 path would move through memory in the same step: the ``[W, shard]`` gathered rows of each unit
and the ``[W, L]`` bucket of each reduction, into preallocated memory.

  copy    dst.copy_(src) of each unit's gathered bf16 rows / each bucket (the yardstick)
  before  the strategies as they were before the pools (kept here): quantize/dequantize allocating their
          outputs, torch.cat packing, clone unpacking, fresh receive rows (the loopback's first touch of
          that fresh memory is subtracted with the collective, which flatters "before")
  after   the engine's QuantizedGather / QuantizedReduce with pooled buffers
  plain   (reduction only, for context) the plain reduce-scatter's own local work on the same bucket
          (AllToAllReduceScatter: fp32 copy of the received rows, sum, divide), also pooled

Ops run round-robin (per round each runs once untimed, then once timed) and ratios are medians of the
per-round ratios: the machine is shared, and this cancels most of the background load.

Usage: python bench/bench_hot_path.py [--rounds 9] [--dim 768] [--units 6] [--threads N]
                                     [--out bench/results/hot_path.json]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from results_io import RESULTS, write_results
from zeropp.comm.ledger import Phase
from zeropp.comm.reduce import AllToAllReduceScatter
from zeropp.comm.ops import DONE, Handle
from zeropp.partition.spec import RowLayout
from zeropp.plus.qgz import QuantizedReduce
from zeropp.plus.qwz import QuantizedGather
from zeropp.plus.wire import pack, quantize_poisoning, unpack
from zeropp.quant import BlockLayout, dequantize, payload_bytes
from zeropp.topology import Group, Layout, Topology


class Loopback:
    """A Comm stand-in for one rank: every member's contribution is this rank's own (a plain copy), timed."""

    def __init__(self, world: int, ranks_per_node: int) -> None:
        layout = Layout(world, ranks_per_node)
        d, n = ranks_per_node, world // ranks_per_node
        self.topo = Topology(layout, 0, Group(tuple(range(world))), Group(tuple(range(d))),
                             Group(tuple(k * d for k in range(n))), Group(tuple(range(d))))
        self.seconds = 0.0

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Group, phase: Phase,
                   async_op: bool = False) -> Handle:
        t0 = time.perf_counter()
        rows = out.view(group.size, -1)
        for i in range(group.size):
            rows[i].copy_(inp.reshape(-1))
        self.seconds += time.perf_counter() - t0
        return DONE

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: Group, phase: Phase,
                   async_op: bool = False) -> Handle:
        t0 = time.perf_counter()
        out.copy_(inp)
        self.seconds += time.perf_counter() - t0
        return DONE


@dataclass
class BenchUnit:
    """What QuantizedGather reads from a Unit: a block's shard row and its per-parameter chunks."""

    index: int
    row: RowLayout
    shard: torch.Tensor
    compute_dtype: torch.dtype = torch.bfloat16

    def shard_row(self) -> torch.Tensor:
        return self.shard

    def segment_names(self) -> list[str]:
        return [f"p{i}" for i in range(len(self.row.chunks))]


def block_chunks(dim: int, world: int) -> tuple[int, ...]:
    """Per-parameter chunks of a GPT-2 style block (Note [shard layout]: padded to 2W, cut in W)."""
    numels = [dim, dim, 3 * dim * dim, 3 * dim, dim * dim, dim, dim, dim, 4 * dim * dim, 4 * dim, 4 * dim * dim, dim]
    return tuple(-(-n // (2 * world)) * 2 for n in numels)


# ---- "before": the strategies' hot path as it was, allocating (kept to measure against) -----------------
def old_gather(comm: Loopback, unit: BenchUnit, bits: int, block: int) -> torch.Tensor:
    layout = BlockLayout(unit.row.chunks, block)
    wire = pack(quantize_poisoning(unit.shard_row().view(1, -1), layout, bits))[0]
    out = torch.empty(comm.topo.world.size, wire.numel(), dtype=torch.uint8)
    comm.all_gather(out, wire, comm.topo.world, Phase.FORWARD_GATHER)
    q = unpack(out, payload_bytes(layout, bits))
    return dequantize(q, layout, bits, unit.compute_dtype)


def old_reduce(comm: Loopback, bucket: torch.Tensor, segments: tuple[int, ...], bits: int, block: int) -> torch.Tensor:
    topo = comm.topo
    d, n = topo.ranks_per_node, topo.num_nodes
    layout = BlockLayout(segments, block)
    pb = payload_bytes(layout, bits)

    def hop(rows: torch.Tensor, group: Group) -> torch.Tensor:
        wire = pack(quantize_poisoning(rows, layout, bits))
        received = torch.empty_like(wire)
        comm.all_to_all(received, wire, group, Phase.GRAD_REDUCE)
        return dequantize(unpack(received, pb), layout, bits, torch.float32)

    rows = bucket.view(n, d, -1).transpose(0, 1).reshape(d * n, -1)
    partial = hop(rows, topo.intra_node).view(d, n, -1).sum(dim=0) if d > 1 else rows.float()
    total = hop(partial, topo.inter_node).sum(dim=0) if n > 1 else partial[0]
    return total.div_(topo.world_size)


# ---- timing -----------------------------------------------------------------------------------------
def time_rounds(ops: dict[str, Callable[[], None]], comm: Loopback, rounds: int, warmup: int) -> dict[str, list]:
    """Per round, each op once untimed then once timed (its own steady state); loopback time subtracted."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rnd in range(warmup + rounds):
        for name, fn in ops.items():
            fn()
            before = comm.seconds
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0 - (comm.seconds - before)
            if rnd >= warmup:
                times[name].append(elapsed)
    return times


def build_ops(args: argparse.Namespace, comm: Loopback) -> tuple[dict[str, Callable[[], None]], dict[str, int], list]:
    w = args.world
    gen = torch.Generator().manual_seed(0)
    chunks = block_chunks(args.dim, w)
    row = RowLayout(chunks)
    units = [BenchUnit(i, row, (torch.randn(row.numel, generator=gen) * 0.02).to(torch.bfloat16))
             for i in range(args.units)]
    gathered_src = [torch.randn(w, row.numel, generator=gen).to(torch.bfloat16) for _ in units]
    gathered_dst = [torch.empty_like(t) for t in gathered_src]
    per_bucket = args.units_per_bucket
    segments = chunks * per_bucket
    buckets = [(torch.randn(w, sum(segments), generator=gen) * 1e-3).to(torch.bfloat16)
               for _ in range(args.units // per_bucket)]
    bucket_dst = [torch.empty_like(b) for b in buckets]
    qwz = QuantizedGather(comm, args.weight_bits, args.block_size)
    qgz = QuantizedReduce(comm, args.grad_bits, args.block_size)
    plain = AllToAllReduceScatter(comm)  # type: ignore[arg-type] - the loopback stands in for Comm

    def after_gather() -> None:
        for u in units:
            pending = qwz.start(u, Phase.FORWARD_GATHER)
            pending.finish()
            pending.recycle()

    def after_reduce() -> None:
        for b in buckets:
            pending = qgz.start(b, segments)
            pending.finish()
            pending.recycle()

    def plain_reduce() -> None:
        for b in buckets:
            pending = plain.start(b, segments)
            pending.finish()
            pending.recycle()

    ops = {
        "gather_copy": lambda: [d.copy_(s) for d, s in zip(gathered_dst, gathered_src)],
        "gather_before": lambda: [old_gather(comm, u, args.weight_bits, args.block_size) for u in units],
        "gather_after": after_gather,
        "reduce_copy": lambda: [d.copy_(b) for d, b in zip(bucket_dst, buckets)],
        "reduce_before": lambda: [old_reduce(comm, b, segments, args.grad_bits, args.block_size) for b in buckets],
        "reduce_after": after_reduce,
        "reduce_plain": plain_reduce,
    }
    check_same(units, buckets, segments, qwz, qgz, comm, args)
    sizes = {"unit_params": row.numel * w, "gathered_bytes_bf16": row.numel * w * 2,
             "bucket_elements": buckets[0].numel() if buckets else 0, "buckets": len(buckets)}
    return ops, sizes, [qwz, qgz]


def check_same(units: list, buckets: list, segments: tuple, qwz: QuantizedGather, qgz: QuantizedReduce,
               comm: Loopback, args: argparse.Namespace) -> None:
    """Before and after compute the same bits (the benchmark compares like with like)."""
    p = qwz.start(units[0], Phase.FORWARD_GATHER)
    want = old_gather(comm, units[0], args.weight_bits, args.block_size)
    assert torch.equal(p.finish()[0].reshape(want.shape), want)  # a two-hop gather's rows: an [n, D, ...] view
    p.recycle()
    if buckets:
        r = qgz.start(buckets[0], segments)
        assert torch.equal(r.finish(), old_reduce(comm, buckets[0], segments, args.grad_bits, args.block_size))
        r.recycle()


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}
    for kind in ("gather", "reduce"):
        copy = times[f"{kind}_copy"]
        for path in ("before", "after", "plain"):
            if f"{kind}_{path}" not in times:
                continue
            ratios = [c / t for c, t in zip(copy, times[f"{kind}_{path}"])]
            out[f"{kind}_{path}_vs_copy"] = statistics.median(ratios)
        out[f"{kind}_speedup"] = statistics.median(
            [b / a for b, a in zip(times[f"{kind}_before"], times[f"{kind}_after"])])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--dim", type=int, default=768, help="hidden size of each transformer-block unit")
    ap.add_argument("--units", type=int, default=6)
    ap.add_argument("--units-per-bucket", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--weight-bits", type=int, default=8)
    ap.add_argument("--grad-bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch (and quantizer) threads; 0: torch's default")
    ap.add_argument("--out", default=os.path.join(RESULTS, "hot_path.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    comm = Loopback(args.world, args.ranks_per_node)
    ops, sizes, strategies = build_ops(args, comm)
    times = time_rounds(ops, comm, args.rounds, args.warmup)
    sizes["buffer_bytes"] = {k: v for st in strategies for k, v in st.buffer_bytes().items()}
    result = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "args": vars(args), "sizes": sizes, **summarize(times),
              "times_s": times}
    for k, v in result.items():
        if k != "times_s":
            print(f"{k}: {v}")
    write_results(args.out, result)


if __name__ == "__main__":
    main()
