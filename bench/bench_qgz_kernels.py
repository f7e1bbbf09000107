"""qgZ's three quantizer steps on one bucket, each against a copy of the bucket: where the reduction's time goes.

The bucket is ``bench_hot_path.py``'s: ``[4, L]`` bf16 gradients of two GPT-2-sized blocks (``--dim``), int4,
blocks of 2048. Timed per call (median of ``--reps`` batches of ``--calls`` calls), in this order:

  copy   dst.copy_(bucket), the yardstick
  quant  quantize the 4 rows into reused rows (qgZ's first step)
  mid    dequantize_sum_quantize over 2 pieces of 2 rows (the fused middle step)
  last   dequantize_sum of 2 pieces of 1 row, divided by the world size (the last step)

Usage: python bench/bench_qgz_kernels.py [--threads 1] [--dim 768] [--calls 40] [--reps 5]
Prints one JSON line of milliseconds per call; run it from two checkouts in turn to compare kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hot_path import block_chunks  # noqa: E402
from zeropp.quant import BlockLayout, dequantize_sum, dequantize_sum_quantize, quantize  # noqa: E402


def per_call_ms(fn: Callable[[], object], calls: int, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layout = BlockLayout(block_chunks(args.dim, 4) * 2, 2048)
    x = (torch.randn(4, layout.numel, generator=torch.Generator().manual_seed(0)) * 1e-3).to(torch.bfloat16)
    rows4, rows2 = quantize(x, layout, 4), quantize(x[:2], layout, 4)
    sums = quantize(x[:2], layout, 4)
    mean = torch.empty(1, layout.numel)
    dst = torch.empty_like(x)
    ops = {
        "copy": lambda: dst.copy_(x),
        "quant": lambda: quantize(x, layout, 4, out=rows4),
        "mid": lambda: dequantize_sum_quantize(rows4, layout, 4, 2, out=sums),
        "last": lambda: dequantize_sum(rows2, layout, 4, 2, out=mean, divisor=4.0),
    }
    print(json.dumps({name: round(per_call_ms(fn, args.calls, args.reps), 3) for name, fn in ops.items()}))


if __name__ == "__main__":
    main()
