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

--cuda times the Triton kernels on the GPU instead (``bench_cuda_case``): quantize + dequantize of a
--cuda-mb tensor, writing into preallocated outputs, against a device-to-device copy of the same tensor,
with CUDA events around --inner back-to-back calls per op and round.

--qgz times qgZ's reduction steps on this CPU instead (``bench_qgz_case``): the middle step (dequantize the D
pieces that arrived, sum them, requantize for hop 2) and the last (dequantize, sum, divide), each as the
fused ``dequantize_sum_quantize`` / ``dequantize_sum`` with out= against the unfused dequantize + torch.sum
(+ quantize) they replace.

Usage: python bench/bench_quant.py [--block-size 2048] [--reps 9] [--spec-reps 3] [--out bench/results/quant.json]
       python bench/bench_quant.py --cuda [--cuda-mb 256] [--out bench/results/quant_cuda.json]
       python bench/bench_quant.py --qgz [--out bench/results/quant_qgz.json]
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

from zeropp.quant import (
    BlockLayout,
    QuantizedRows,
    dequantize,
    dequantize_sum,
    dequantize_sum_quantize,
    fast_available,
    payload_bytes,
    quantize,
)
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


def time_interleaved_cuda(ops: dict[str, Callable[[], object]], reps: int, warmup: int,
                          inner: int) -> dict[str, list[float]]:
    """``time_interleaved`` for GPU ops: per round and op, one untimed call, then ``inner`` calls between two CUDA
    events; returns seconds per call. Host-side time between launches counts when it leaves the GPU idle."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rnd in range(warmup + reps):
        for name, fn in ops.items():
            fn()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            if rnd >= warmup:
                times[name].append(start.elapsed_time(end) / 1e3 / inner)
    return times


def bench_cuda_case(dtype: torch.dtype, layout: BlockLayout, bits: int, args: argparse.Namespace) -> dict:
    """The Triton path on the GPU: hot-path calls (poison=True: no host sync) against a device-to-device copy;
    the raising quantize (one sync for its inf/nan check) is timed too."""
    dev = torch.device("cuda")
    x = torch.randn(layout.numel, device=dev).to(dtype)
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    qout = QuantizedRows(torch.empty(1, payload_bytes(layout, bits), dtype=torch.uint8, device=dev),
                         torch.empty(1, layout.num_blocks, dtype=torch.float32, device=dev))
    ops = {
        "copy": lambda: dst.copy_(x),
        "qdq": lambda: dequantize(quantize(x, layout, bits, out=qout, poison=True), layout, bits, dtype, out=dst),
        "q": lambda: quantize(x, layout, bits, out=qout, poison=True),
        "dq": lambda: dequantize(qout, layout, bits, dtype, out=dst),
        "q_raising": lambda: quantize(x, layout, bits, out=qout),
    }
    times = time_interleaved_cuda(ops, args.reps, args.warmup, args.inner)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "dtype": str(dtype).replace("torch.", ""), "bits": bits, "numel": layout.numel, "bytes": nbytes,
        "segments": len(layout.segments), "block_size": layout.block_size,
        "median_seconds": med, "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratio_qdq_vs_copy": statistics.median(c / q for c, q in zip(times["copy"], times["qdq"])),
    }


def main_cuda(args: argparse.Namespace) -> None:
    from zeropp.quant import triton_available

    if not torch.cuda.is_available() or not triton_available():
        raise SystemExit("--cuda needs a CUDA device, a CUDA build of torch and triton")
    cases = [bench_cuda_case(dtype, layout, bits, args)
             for dtype, layout, bits in case_grid(args.cuda_mb * MB, args.block_size)]
    device = torch.cuda.get_device_name()
    print(f"{device}; torch {torch.__version__}; Triton path; {args.cuda_mb} MiB input, blocks of {args.block_size}")
    print()
    print("| dtype | bits | segments | copy GB/s | quantize+dequantize GB/s | (q+dq) / copy | quantize GB/s "
          "| dequantize GB/s | raising quantize GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        g = c["GBps"]
        print(f"| {c['dtype']} | int{c['bits']} | {c['segments']} | {g['copy']:.0f} | {g['qdq']:.0f} "
              f"| {c['ratio_qdq_vs_copy']:.2f} | {g['q']:.0f} | {g['dq']:.0f} | {g['q_raising']:.0f} |")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": device,
            "block_size": args.block_size, "mb": args.cuda_mb, "warmup": args.warmup, "reps": args.reps,
            "inner": args.inner}
    write_results(args.out, {"meta": meta, "cases": cases})


def bench_qgz_case(pieces: int, rows: int, layout: BlockLayout, bits: int, args: argparse.Namespace) -> dict:
    """qgZ's steps on ``pieces`` x ``rows`` received quantized rows: fused with out= vs the unfused torch ops."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(pieces * rows, layout.numel, generator=gen)
    q = quantize(x, layout, bits)
    deq = torch.empty(pieces * rows, layout.numel)
    total = torch.empty(rows, layout.numel)
    qout = QuantizedRows(torch.empty(rows, payload_bytes(layout, bits), dtype=torch.uint8),
                         torch.empty(rows, layout.num_blocks))
    world = pieces * rows

    def unfused_mid() -> None:
        dequantize(q, layout, bits, torch.float32, out=deq)
        torch.sum(deq.view(pieces, rows, -1), dim=0, out=total)
        quantize(total, layout, bits, out=qout, poison=True)

    def unfused_last() -> None:
        dequantize(q, layout, bits, torch.float32, out=deq)
        torch.sum(deq.view(pieces, rows, -1), dim=0, out=total)
        total.div_(world)

    ops = {
        "mid_unfused": unfused_mid,
        "mid_fused": lambda: dequantize_sum_quantize(q, layout, bits, pieces, out=qout, poison=True),
        "last_unfused": unfused_last,
        "last_fused": lambda: dequantize_sum(q, layout, bits, pieces, out=total, divisor=world),
    }
    times = time_interleaved(ops, args.reps, args.warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    in_bytes = q.data.numel() + 4 * q.scales.numel()
    return {
        "pieces": pieces, "rows": rows, "numel": layout.numel, "bits": bits, "received_bytes": in_bytes,
        "median_seconds": med,
        "speedup_mid": statistics.median(a / b for a, b in zip(times["mid_unfused"], times["mid_fused"])),
        "speedup_last": statistics.median(a / b for a, b in zip(times["last_unfused"], times["last_fused"])),
    }


def main_qgz(args: argparse.Namespace) -> None:
    layout = unaligned_layout(4 * MB, args.block_size)  # a 4M-element gradient shard of odd-sized parameters
    cases = [bench_qgz_case(pieces, rows, layout, 4, args) for pieces, rows in ((4, 2), (8, 1))]
    print(f"fast path available: {fast_available()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; int4, {len(layout.segments)} segments, blocks of "
          f"{args.block_size}")
    print()
    print("| pieces x rows | elements per row | middle step unfused ms | fused ms | speedup | last step unfused ms "
          "| fused ms | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cases:
        m = {k: v * 1e3 for k, v in c["median_seconds"].items()}
        print(f"| {c['pieces']} x {c['rows']} | {c['numel']} | {m['mid_unfused']:.1f} | {m['mid_fused']:.1f} "
              f"| {c['speedup_mid']:.2f} | {m['last_unfused']:.1f} | {m['last_fused']:.1f} | {c['speedup_last']:.2f} |")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "fast_available": fast_available(), "warmup": args.warmup,
            "reps": args.reps, "block_size": args.block_size}
    write_results(args.out, {"meta": meta, "cases": cases})


def case_grid(nbytes: int, block_size: int) -> list[tuple[torch.dtype, BlockLayout, int]]:
    """(dtype, layout, bits) of every timed case: ``nbytes`` of bf16 (one segment, then odd segments) and of
    fp32 (one segment), each at 8 and 4 bits."""
    grid = []
    for dtype in (torch.bfloat16, torch.float32):
        numel = nbytes // torch.tensor([], dtype=dtype).element_size()
        layouts = [BlockLayout((numel,), block_size)]
        if dtype == torch.bfloat16:
            layouts.append(unaligned_layout(numel, block_size))
        grid += [(dtype, layout, bits) for layout in layouts for bits in (8, 4)]
    return grid


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
    p.add_argument("--cuda", action="store_true", help="time the Triton kernels on the GPU instead")
    p.add_argument("--qgz", action="store_true", help="time qgZ's reduction steps on the CPU instead")
    p.add_argument("--cuda-mb", type=int, default=256, help="--cuda: input size in MiB")
    p.add_argument("--inner", type=int, default=10, help="--cuda: calls per op between two CUDA events")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=None, help="default bench/results/quant.json (quant_cuda.json with --cuda, "
                   "quant_qgz.json with --qgz)")
    args = p.parse_args()
    if args.out is None:
        name = "quant_cuda.json" if args.cuda else "quant_qgz.json" if args.qgz else "quant.json"
        args.out = os.path.join(here, "results", name)
    if args.cuda:
        main_cuda(args)
        return
    if args.qgz:
        main_qgz(args)
        return

    t0 = time.perf_counter()
    have_fast = fast_available()
    build_s = time.perf_counter() - t0
    cases = [bench_case(dtype, layout, bits, args) for dtype, layout, bits in case_grid(64 * MB, args.block_size)]

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
