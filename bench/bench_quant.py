"""Quantizer kernel throughput: quantize + dequantize of a 64 MB tensor against a plain copy of it.

For bf16 (32M elements) and fp32 (16M elements), int8 and int4, this times in one run:
  copy        dst.copy_(src) into a preallocated tensor (the yardstick)
  clone       src.clone() (copy into a freshly allocated tensor: includes the page faults of new memory)
  fast (out=) zeropp.quant.quantize + dequantize writing into preallocated outputs
  fast        the same, letting the functions allocate their outputs
  spec        the reference (blockwise.py), allocating
Throughput is input bytes / second of the round trip (quantize then dequantize); ratios are to copy, except
the allocating fast path, which is compared with clone as well. Median of --reps runs after --warmup runs.

Usage: python bench/bench_quant.py [--block-size 2048] [--reps 9] [--spec-reps 3] [--out bench/results/quant.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from zeropp.quant import BlockLayout, QuantizedRows, dequantize, fast_available, payload_bytes, quantize
from zeropp.quant import blockwise

MB = 1 << 20


def median_seconds(fn: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_case(dtype: torch.dtype, layout: BlockLayout, bits: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(layout.numel, generator=gen).to(dtype)
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    qout = QuantizedRows(torch.empty(1, payload_bytes(layout, bits), dtype=torch.uint8),
                         torch.empty(1, layout.num_blocks, dtype=torch.float32))
    r, w = args.reps, args.warmup
    # Interleave nothing else: each measurement is a tight loop over one operation.
    t = {
        "copy": median_seconds(lambda: dst.copy_(x), r, w),
        "clone": median_seconds(lambda: x.clone(), r, w),
        "fast_out": median_seconds(
            lambda: dequantize(quantize(x, layout, bits, out=qout), layout, bits, dtype, out=dst), r, w),
        "fast_alloc": median_seconds(lambda: dequantize(quantize(x, layout, bits), layout, bits, dtype), r, w),
        "fast_q_out": median_seconds(lambda: quantize(x, layout, bits, out=qout), r, w),
        "spec": median_seconds(
            lambda: blockwise.dequantize(blockwise.quantize(x, layout, bits), layout, bits, dtype),
            args.spec_reps, 1),
    }
    t["fast_dq_out"] = median_seconds(lambda: dequantize(qout, layout, bits, dtype, out=dst), r, w)
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    return {
        "dtype": str(dtype).replace("torch.", ""), "bits": bits, "numel": layout.numel, "bytes": nbytes,
        "segments": len(layout.segments), "block_size": layout.block_size,
        "seconds": t, "GBps": gbs,
        "ratio_fast_out_vs_copy": t["copy"] / t["fast_out"],
        "ratio_fast_alloc_vs_copy": t["copy"] / t["fast_alloc"],
        "ratio_fast_alloc_vs_clone": t["clone"] / t["fast_alloc"],
        "ratio_spec_vs_copy": t["copy"] / t["spec"],
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
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quant.json"))
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
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
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
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "fast_available": have_fast, "block_size": args.block_size,
            "reps": args.reps, "spec_reps": args.spec_reps}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cases": cases}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
