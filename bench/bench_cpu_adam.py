"""Host Adam throughput: zeropp's CpuAdam against torch's AdamW (fused, foreach, single-tensor) and
DeepSpeed's DeepSpeedCPUAdam, on fp32 parameters of 1e7 and 1e8 elements, in one run.

AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, on torch.get_num_threads() threads.
Timing: every optimizer owns one parameter of n elements, all read one shared gradient tensor (never written
by any of them). Round-robin rounds, one untimed warm-up round first: per round each fast optimizer (zeropp,
zeropp+bf16, zeropp_inexact, torch fused, torch fused+copy, DeepSpeed, DeepSpeed+copy; in an order rotated
every round) takes
--inner consecutive steps and the round keeps its fastest, then each slow one (torch foreach, torch
single-tensor) takes one step. Throughput (parameters updated per second)
comes from per-optimizer medians; speedups are medians of per-round ratios, which cancels most of the
background load of a shared machine. "zeropp+bf16" also writes the updated value into a bf16 copy in the same
pass (ZeRO-Offload's copy-back into the 16-bit shard); "torch_fused+copy" and "deepspeed+copy" are the same
without fusion: the step, then ``shard16.copy_(master)`` (what DeepSpeed's ZeRO-Offload does after its CPU
Adam step). The offload step the engine runs is the "+bf16"/"+copy" one. "zeropp_inexact" is ``CpuAdam(exact=False)``: DeepSpeed's shorter
operation sequence, not bit-exact.

Agreement (a separate run, --agree-n parameters, --agree-steps steps on fresh random gradients): each
optimizer's parameters against torch.optim.AdamW(foreach=False): max ulp distance, max absolute difference,
bit-exact or not; for zeropp also the moments, and its bf16 copy against p.to(bf16).

DeepSpeed is optional (``DS_BUILD_OPS=0 pip install deepspeed``; its CPU Adam op compiles at first use).

Usage: python bench/bench_cpu_adam.py [--sizes 1e7 1e8] [--reps 7] [--inner 3] [--no-deepspeed]
                                      [--out bench/results/cpu_adam.json]
       python bench/bench_cpu_adam.py --verify-sqrt-exhaustive   (the kernel's sqrt vs MKL's, all 2^32 inputs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable

import torch

from zeropp.offload import CpuAdam, kernel_info
from results_io import write_results

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    feats = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name}; {os.cpu_count()} cores; {' '.join(feats)}"


def load_deepspeed() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam and a status line (why it is missing, or its version)."""
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - optional dependency
        return None, f"not importable: {type(e).__name__}: {e}"
    try:  # compile/load the op now, not inside the timed loop
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        DeepSpeedCPUAdam([p], **HP, adamw_mode=True).step()
    except Exception as e:  # noqa: BLE001
        return None, f"op failed to build/run: {type(e).__name__}: {e}; {traceback.format_exc(limit=1)}"
    return DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}"


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max())


def make_optimizers(n: int, p0: torch.Tensor, grad: torch.Tensor, ds_cls: type | None):
    """One parameter of n elements per optimizer, all starting at p0, all reading the same gradient tensor."""
    params: dict[str, torch.nn.Parameter] = {}
    opts: dict[str, torch.optim.Optimizer] = {}

    def add(name: str, make: Callable[[list], torch.optim.Optimizer]) -> None:
        p = torch.nn.Parameter(p0.clone())
        p.grad = grad  # shared, read-only for every optimizer here
        params[name], opts[name] = p, make([p])

    add("zeropp", lambda ps: CpuAdam(ps, **HP))
    add("zeropp+bf16", lambda ps: CpuAdam(ps, **HP))
    add("zeropp_inexact", lambda ps: CpuAdam(ps, **HP, exact=False))
    add("torch_fused", lambda ps: torch.optim.AdamW(ps, **HP, fused=True))
    add("torch_fused+copy", lambda ps: torch.optim.AdamW(ps, **HP, fused=True))
    if ds_cls is not None:
        add("deepspeed", lambda ps: ds_cls(ps, **HP, adamw_mode=True))
        add("deepspeed+copy", lambda ps: ds_cls(ps, **HP, adamw_mode=True))
    add("torch_foreach", lambda ps: torch.optim.AdamW(ps, **HP, foreach=True))
    add("torch_single", lambda ps: torch.optim.AdamW(ps, **HP, foreach=False))
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    out16 = {params["zeropp+bf16"]: bf16}
    steps: dict[str, Callable[[], object]] = {k: o.step for k, o in opts.items()}
    steps["zeropp+bf16"] = lambda: opts["zeropp+bf16"].step(out16=out16)
    bf16_t = torch.empty(n, dtype=torch.bfloat16)

    def fused_then_copy() -> None:  # what an engine does without a fused copy: step, then cast the shard
        opts["torch_fused+copy"].step()
        bf16_t.copy_(params["torch_fused+copy"].detach())

    steps["torch_fused+copy"] = fused_then_copy
    if ds_cls is not None:
        bf16_d = torch.empty(n, dtype=torch.bfloat16)

        def deepspeed_then_copy() -> None:
            opts["deepspeed+copy"].step()
            bf16_d.copy_(params["deepspeed+copy"].detach())

        steps["deepspeed+copy"] = deepspeed_then_copy
    return params, opts, steps, bf16


def agreement(n: int, nsteps: int, ds_cls: type | None) -> dict:
    """Every optimizer against torch.optim.AdamW(foreach=False) after nsteps steps on fresh gradients."""
    gen = torch.Generator().manual_seed(1)
    grad = torch.empty(n)
    params, opts, steps, bf16 = make_optimizers(n, torch.randn(n, generator=gen), grad, ds_cls)
    for _ in range(nsteps):
        grad.normal_(generator=gen)
        for step in steps.values():
            step()
    ref = params["torch_single"].detach()
    rows = {}
    for name, p in params.items():
        d = p.detach()
        rows[name] = {"max_ulp": ulp_distance(d, ref), "max_abs_diff": float((d - ref).abs().max()),
                      "bit_exact": bool(torch.equal(d, ref))}
    zs, rs = opts["zeropp"].state[params["zeropp"]], opts["torch_single"].state[params["torch_single"]]
    rows["zeropp"]["moments_bit_exact"] = bool(torch.equal(zs["exp_avg"], rs["exp_avg"])
                                               and torch.equal(zs["exp_avg_sq"], rs["exp_avg_sq"]))
    rows["zeropp+bf16"]["bf16_copy_exact"] = bool(torch.equal(bf16, params["zeropp+bf16"].detach().bfloat16()))
    return {"numel": n, "steps": nsteps, "results": rows}


FAST = ("zeropp", "zeropp+bf16", "zeropp_inexact", "torch_fused", "torch_fused+copy", "deepspeed",
        "deepspeed+copy")


def bench_size(n: int, args: argparse.Namespace, ds_cls: type | None) -> dict:
    """Round-robin timing. Per round: each fast optimizer takes --inner consecutive steps (the round keeps
    the fastest: the least disturbed by other load), then each slow one (torch foreach / single-tensor:
    10-20x slower, their temporaries page-fault) takes one step. Ratios are medians of per-round ratios."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    _, _, steps, _ = make_optimizers(n, torch.randn(n, generator=gen), grad, ds_cls)
    times: dict[str, list[float]] = {k: [] for k in steps}
    fast = [k for k in steps if k in FAST]
    slow = [k for k in steps if k not in FAST]
    for rnd in range(args.warmup + args.reps):
        k = rnd % len(fast)  # rotate the fast group's order: no optimizer always runs first after the slow ones
        for name in fast[k:] + fast[:k] + slow:
            step = steps[name]
            best = float("inf")
            for _ in range(args.inner if name in FAST else 1):
                t0 = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t0)
            if rnd >= args.warmup:
                times[name].append(best)
    med = {k: statistics.median(v) for k, v in times.items()}
    others = [k for k in ("torch_fused", "deepspeed", "torch_foreach") if k in times]
    fastest = min(others, key=lambda k: med[k])
    rows = {}
    for name in steps:
        rows[name] = {"params_per_s": n / med[name], "median_s": med[name],
                      "zeropp_speedup": {o: statistics.median(t_o / t_z for t_z, t_o in zip(times["zeropp"],
                                                                                              times[o]))
                                         for o in others}}
    rows["zeropp_inexact"]["speedup_vs_fastest_other"] = statistics.median(
        t_o / t_z for t_z, t_o in zip(times["zeropp_inexact"], times[fastest]))
    copies = [k for k in ("torch_fused+copy", "deepspeed+copy") if k in times]
    for o in copies:
        rows["zeropp+bf16"][f"speedup_vs_{o}"] = statistics.median(
            t_o / t_z for t_z, t_o in zip(times["zeropp+bf16"], times[o]))
    fastest_copy = min(copies, key=lambda k: med[k])
    return {"numel": n, "rounds": args.reps, "fastest_other": fastest, "results": rows,
            "zeropp_vs_fastest_other": rows["zeropp"]["zeropp_speedup"][fastest],
            "offload_step": {"fastest_other": fastest_copy,
                             "zeropp+bf16_vs_fastest_other": rows["zeropp+bf16"][f"speedup_vs_{fastest_copy}"]}}


def verify_sqrt_exhaustive() -> dict:
    """The kernel's sqrt (the W-lane code of its chosen mode) against torch.sqrt's MKL routine (vmsSqrt_64,
    called as torch calls it) on all 2^32 float bit patterns; NaN matches NaN. Minutes on 2 cores."""
    import ctypes

    from zeropp.offload import cpu_adam as ca

    info = kernel_info()
    mkl = ca._mkl_sqrt_ptr()
    if not info.available or mkl is None:
        return {"skipped": "no kernel or no MKL sqrt"}
    lib = ca._kernel.lib  # a verification tool: reaches into the module on purpose
    vml = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(mkl)
    chunk = 1 << 24
    a, b = torch.empty(chunk), torch.empty(chunk)
    bad, t0 = 0, time.time()
    for base in range(0, 1 << 32, chunk):
        x = torch.arange(base, base + chunk, dtype=torch.int64).to(torch.int32).view(torch.float32)
        for i in range(0, chunk, 2048):
            vml(2048, x.data_ptr() + 4 * i, a.data_ptr() + 4 * i, 0x140102)
        lib.za_sqrt(ca._SQRT_MODES[info.sqrt], mkl, x.data_ptr(), b.data_ptr(), chunk)
        same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
        bad += int((~same).sum())
    return {"mode": info.sqrt, "inputs": 1 << 32, "mismatches": bad, "seconds": round(time.time() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--agree-n", type=int, default=1_000_003)
    ap.add_argument("--agree-steps", type=int, default=10)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--out", default="bench/results/cpu_adam.json")
    ap.add_argument("--verify-sqrt-exhaustive", action="store_true",
                    help="only check the kernel's sqrt against MKL's on all 2^32 inputs, then exit")
    args = ap.parse_args()
    if args.verify_sqrt_exhaustive:
        print(verify_sqrt_exhaustive())
        return
    warnings.filterwarnings("ignore")
    info = kernel_info()
    ds_cls, ds_status = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else load_deepspeed()
    meta = {
        "date": datetime.date.today().isoformat(), "machine": cpu_model(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "kernel": info._asdict(), "deepspeed": ds_status,
        "load_average_at_start": os.getloadavg()[0], "hyperparameters": {**HP, "betas": list(HP["betas"])},
        "command": "python bench/bench_cpu_adam.py " + " ".join(
            [f"--sizes {' '.join(f'{s:g}' for s in args.sizes)}", f"--reps {args.reps}", f"--inner {args.inner}"]
            + (["--no-deepspeed"] if args.no_deepspeed else [])),
    }
    print(json.dumps(meta, indent=1))
    agree = agreement(args.agree_n, args.agree_steps, ds_cls)
    print(f"\nagreement with torch.optim.AdamW(foreach=False): {agree['numel']:,} params, {agree['steps']} steps")
    for name, r in agree["results"].items():
        print(f"  {name:<15} max ulp {r['max_ulp']:>10}  max |diff| {r['max_abs_diff']:.2e}  exact {r['bit_exact']}")
    print("  zeropp moments exact:", agree["results"]["zeropp"]["moments_bit_exact"],
          "| bf16 copy exact:", agree["results"]["zeropp+bf16"]["bf16_copy_exact"])
    cases = []
    for size in args.sizes:
        case = bench_size(int(size), args, ds_cls)
        cases.append(case)
        print(f"\nn = {case['numel']:.0e}: {case['rounds']} rounds; zeropp vs fastest other "
              f"({case['fastest_other']}): {case['zeropp_vs_fastest_other']:.3f}x")
        print(f"{'optimizer':<15}{'Mparams/s':>11}")
        for name, r in case["results"].items():
            print(f"{name:<15}{r['params_per_s'] / 1e6:>11.1f}")
        print("zeropp speedup (median of per-round ratios):",
              {k: round(v, 3) for k, v in case["results"]["zeropp"]["zeropp_speedup"].items()})
        print("zeropp_inexact vs fastest other:", round(case["results"]["zeropp_inexact"]["speedup_vs_fastest_other"], 3))
        off = case["offload_step"]
        print(f"offload step (with the 16-bit copy): zeropp+bf16 vs fastest other ({off['fastest_other']}): "
              f"{off['zeropp+bf16_vs_fastest_other']:.3f}x")
        meta["load_average_at_end"] = os.getloadavg()[0]
    write_results(args.out, {"meta": meta, "agreement": agree, "cases": cases})


if __name__ == "__main__":
    main()
