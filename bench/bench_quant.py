"""Quantizer kernel throughput: quantize + dequantize of a 64 MB tensor against a plain copy of it.

For bf16 (32M elements) and fp32 (16M elements), int8 and int4, this times in one run:
  copy        dst.copy_(src) into a preallocated tensor (the yardstick)
  clone       src.clone() (copy into a freshly allocated tensor: includes the page faults of new memory)
  fast (out=) zeropp.quant.quantize + dequantize writing into preallocated outputs
  fast        the same, letting the functions allocate their outputs
  spec        the reference (blockwise.py), allocating
Throughput is input bytes / second of the round trip (quantize then dequantize); ratios are to copy, except
the allocating fast path, which is compared with clone as well. The ops are timed round-robin: per round,
each op runs once untimed then once timed; --warmup rounds are discarded, --reps rounds kept. GB/s come from
per-op medians; ratios are the median of the per-round ratios, which cancels most of the background load of
a shared machine.

Usage: python bench/bench_quant.py [--block-size 2048] [--reps 9] [--spec-reps 3] [--out bench/results/quant.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from zeropp.quant import BlockLayout, QuantizedRows, dequantize, fast_available, payload_bytes, quantize
from zeropp.quant import blockwise
from results_io import write_results

MB = 1 << 20


def time_interleaved(ops: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Time every op once per round, round after round, so that all ops see the same background load (the
    machine is shared: a copy measured a minute apart can differ 2x). Each timed run follows an untimed run of
    the same op, so an op is measured in its own steady state (caches, page tables, OpenMP pool), not in the
    state the previous op left. Returns the per-round times."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rnd in range(warmup + reps):
        for name, fn in ops.items():
            fn()
            t0 = time.perf_counter()
            fn()
            if rnd >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def bench_case(dtype: torch.dtype, layout: BlockLayout, bits: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(layout.numel, generator=gen).to(dtype)
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    qout = QuantizedRows(torch.empty(1, payload_bytes(layout, bits), dtype=torch.uint8),
                         torch.empty(1, layout.num_blocks, dtype=torch.float32))
    ops = {
        "copy": lambda: dst.copy_(x),
        "fast_out": lambda: dequantize(quantize(x, layout, bits, out=qout), layout, bits, dtype, out=dst),
        "fast_q_out": lambda: quantize(x, layout, bits, out=qout),
        "fast_dq_out": lambda: dequantize(qout, layout, bits, dtype, out=dst),
        "clone": lambda: x.clone(),
        "fast_alloc": lambda: dequantize(quantize(x, layout, bits), layout, bits, dtype),
    }
    times = time_interleaved(ops, args.reps, args.warmup)
    spec_op = {"spec": lambda: blockwise.dequantize(blockwise.quantize(x, layout, bits), layout, bits, dtype)}
    spec_times = time_interleaved({"copy": ops["copy"], **spec_op}, args.spec_reps, 0)
    times["spec"] = spec_times["spec"]
    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(num: str, den: str, src: dict[str, list[float]] = times) -> float:
        # median over rounds of the per-round throughput ratio (den's throughput / num's throughput)
        return statistics.median(a / b for a, b in zip(src[num], src[den]))

    return {
        "dtype": str(dtype).replace("torch.", ""), "bits": bits, "numel": layout.numel, "bytes": nbytes,
        "segments": len(layout.segments), "block_size": layout.block_size,
        "median_seconds": med, "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratio_fast_out_vs_copy": paired("copy", "fast_out"),
        "ratio_fast_alloc_vs_copy": paired("copy", "fast_alloc"),
        "ratio_fast_alloc_vs_clone": paired("clone", "fast_alloc"),
        "ratio_spec_vs_copy": paired("copy", "spec", spec_times),
    }


def unaligned_layout(numel: int, block_size: int) -> BlockLayout:
    """Many parameter-like segments of odd lengths (plus a zero-length one) summing to numel."""
    gen = torch.Generator().manual_seed(1)
    lengths = (torch.randint(1, 2 * 65536, (numel // 65536,), generator=gen) | 1).tolist()
    lengths.append(0)
    total = sum(lengths)
    if total > numel:
        lengths = [max(1, n * numel // total) for n in lengths]
    lengths.append(numel - sum(lengths))
    return BlockLayout(tuple(lengths), block_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--spec-reps", type=int, default=3)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "quant.json"))
    args = p.parse_args()

    t0 = time.perf_counter()
    have_fast = fast_available()
    build_s = time.perf_counter() - t0
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        numel = 64 * MB // torch.tensor([], dtype=dtype).element_size()
        layouts = [BlockLayout((numel,), args.block_size)]
        if dtype == torch.bfloat16:
            layouts.append(unaligned_layout(numel, args.block_size))
        for layout in layouts:
            for bits in (8, 4):
                cases.append(bench_case(dtype, layout, bits, args))

    print(f"fast path available: {have_fast} (build/load + self-test {build_s:.2f} s); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print()
    print("| dtype | bits | segments | copy GB/s | spec GB/s | fast GB/s (out=) | fast GB/s (alloc) "
          "| spec / copy | fast (out=) / copy | fast (alloc) / copy | fast (alloc) / clone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        g = c["GBps"]
        print(f"| {c['dtype']} | int{c['bits']} | {c['segments']} | {g['copy']:.1f} | {g['spec']:.2f} "
              f"| {g['fast_out']:.1f} | {g['fast_alloc']:.1f} | {c['ratio_spec_vs_copy']:.3f} "
              f"| {c['ratio_fast_out_vs_copy']:.2f} | {c['ratio_fast_alloc_vs_copy']:.2f} "
              f"| {c['ratio_fast_alloc_vs_clone']:.2f} |")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "fast_available": have_fast, "warmup": args.warmup,
            "block_size": args.block_size,
            "reps": args.reps, "spec_reps": args.spec_reps}
    write_results(args.out, {"meta": meta, "cases": cases})


if __name__ == "__main__":
    main()
