"""`zeropp plan` at the ZeRO++ paper's scale: predicted ZeRO++ / ZeRO-3 throughput against the reported ratios.

    .venv/bin/python bench/plan_projection.py        # writes bench/results/plan_projection.{json,md}

No measurement: the cost model with the paper's cluster (DGX-2-like nodes of 16 V100 32 GB: NVSwitch inside,
100-800 Gbit/s between nodes) and GPT models of the paper's and tutorial's sizes, with the assumptions below.
The baseline is DeepSpeed's ZeRO-3 as the paper ran it (NCCL's ring reduce-scatter: ``ring_reduce_scatter``);
zeropp's own ZeRO-3 (its all-to-all reduce-scatter) is shown beside it. ZeRO++ = qwZ int8 + hpZ (a node) + qgZ
int4. Reported numbers: ZEROPP_NOTES.md and the ZeRO++ blog (Figures 6-8).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, write_results  # noqa: E402

from zeropp.tools.plan import Choice, evaluate, gpt_of_size, gpu_cluster, transformer  # noqa: E402
from zeropp.tools.plan.schedule import Workload  # noqa: E402

#: Assumptions (one place): V100 achieved TFLOP/s on a GPT's matmuls (40% of the 125 fp16 peak), NVSwitch per
#: GPU (NCCL's ~150 GB/s bus bandwidth), activation checkpointing and 512-token sequences as in the tutorial.
V100_TFLOPS, NVSWITCH_GBPS, MEMORY_GIB, SEQ = 50.0, 1200.0, 32.0, 512
ZEROPP, ZERO3 = Choice(3, 8, 16, 4), Choice(3)


def gpt18b():
    """The tutorial's GPT-2: 40 layers, width 6144, 32 heads (Megatron-DeepSpeed), vocabulary 50,304."""
    return transformer("GPT 18B (40 x 6144)", 40, 6144, 32, 50_304, positions=2048)


def run(model: Any, nodes: int, gbps: float, tokens_per_gpu: int, choice: Choice, ring: bool,
        tflops: float = V100_TFLOPS, efficiency: Optional[float] = None) -> Any:
    hw = gpu_cluster(nodes, 16, tflops, gbps, NVSWITCH_GBPS, MEMORY_GIB)
    if efficiency is not None:
        hw = replace(hw, wire_efficiency=dict.fromkeys(("all_gather", "all_to_all", "all_to_all_inter",
                                                         "all_reduce"), efficiency))
    work = Workload(micro_batch=max(1, tokens_per_gpu // SEQ), seq_len=SEQ, checkpointing=True, bucket=int(5e8),
                    ring_reduce_scatter=ring)
    return evaluate(model, choice, hw, work)


def ratio(model: Any, nodes: int, gbps: float, tokens: int, base_gbps: Optional[float] = None,
          ring: bool = True) -> dict[str, Any]:
    pp = run(model, nodes, gbps, tokens, ZEROPP, ring)
    z3 = run(model, nodes, base_gbps or gbps, tokens, ZERO3, ring)
    return {"zeropp_step_s": pp.time.step_s, "zero3_step_s": z3.time.step_s,
            "zeropp_tflops": 3 * model.forward_flops_per_token(SEQ) * 4 / 3 * tokens / pp.time.step_s / 1e12,
            "zero3_tflops": 3 * model.forward_flops_per_token(SEQ) * 4 / 3 * tokens / z3.time.step_s / 1e12,
            "ratio": z3.time.step_s / pp.time.step_s, "zeropp_fits": pp.fits, "zero3_fits": z3.fits,
            "zeropp_exposed_s": pp.time.exposed_comm_s, "zero3_exposed_s": z3.time.exposed_comm_s}


def projections() -> list[dict[str, Any]]:
    small, large = gpt18b(), gpt_of_size(138e9)
    rows = []
    for name, model in (("18B", small), ("138B", large)):
        for tokens in (1024, 2048):
            r = ratio(model, 24, 100.0, tokens)
            rows.append({"setup": f"384 V100, 100 Gbit/s, {name}, {tokens // 1024}K tokens/GPU",
                         "reported": "up to 2.16x, about 2x on average (ZeRO++ / ZeRO-3)", "reported_lo": 1.8,
                         "reported_hi": 2.16, **r, "zeropp_a2a_zero3_ratio": ratio(model, 24, 100.0, tokens,
                                                                                   ring=False)["ratio"]})
            r = ratio(model, 24, 400.0, tokens)
            lo, hi = (1.28, 1.36) if tokens == 1024 else (1.24, 1.29)
            rows.append({"setup": f"384 V100, 400 Gbit/s, {name}, {tokens // 1024}K tokens/GPU",
                         "reported": f"{lo:.2f}-{hi:.2f}x (blog, Figure 6)", "reported_lo": lo, "reported_hi": hi, **r,
                         "zeropp_a2a_zero3_ratio": ratio(model, 24, 400.0, tokens, ring=False)["ratio"]})
        r = ratio(model, 24, 200.0, 1024, base_gbps=800.0)
        rows.append({"setup": f"384 V100, {name}: ZeRO++ at 200 Gbit/s vs ZeRO-3 at 800 Gbit/s, 1K tokens/GPU",
                     "reported": "about equal (blog, Figure 8)", "reported_lo": 0.95, "reported_hi": 1.05, **r,
                     "zeropp_a2a_zero3_ratio": ratio(model, 24, 200.0, 1024, base_gbps=800.0, ring=False)["ratio"]})
    for row in rows:
        mid = (row["reported_lo"] + row["reported_hi"]) / 2
        row["difference"] = row["ratio"] / mid - 1
    return rows


def sensitivity() -> list[dict[str, Any]]:
    """The 18B model's ratios with other link efficiencies and compute rates (one assumption changed at a time)."""
    out = []
    for eff, tflops in ((0.85, V100_TFLOPS), (0.6, V100_TFLOPS), (0.45, V100_TFLOPS), (0.85, 35.0)):
        row: dict[str, Any] = {"wire_efficiency": eff, "tflops": tflops}
        for gbps, tokens in ((100.0, 1024), (100.0, 2048), (400.0, 1024), (400.0, 2048)):
            z3 = run(gpt18b(), 24, gbps, tokens, ZERO3, True, tflops, eff).time.step_s
            pp = run(gpt18b(), 24, gbps, tokens, ZEROPP, True, tflops, eff).time.step_s
            row[f"{gbps:g}G {tokens // 1024}K"] = z3 / pp
        out.append(row)
    return out


def tutorial_and_memory() -> list[dict[str, Any]]:
    """The tutorial's 18B on 4 x 16 V100 (what the plan ranks first) and the paper's 100B on 64 x 16."""
    from zeropp.tools.plan import rank

    out = []
    for label, model, nodes, gbps in (("tutorial: 18B GPT-2, 4 nodes x 16 V100 32 GB, 100 Gbit/s", gpt18b(), 4, 100.0),
                                      ("paper: 100B, 64 nodes x 16 V100 32 GB, 100 Gbit/s", gpt_of_size(100e9), 64,
                                       100.0)):
        hw = gpu_cluster(nodes, 16, V100_TFLOPS, gbps, NVSWITCH_GBPS, MEMORY_GIB)
        rows = rank(model, hw, Workload(1, SEQ, checkpointing=True, bucket=int(1e7)))
        z3 = next(r for r in rows if r.choice == ZERO3)
        pp = next(r for r in rows if r.choice == ZEROPP)
        out.append({"setup": label, "params": model.params, "best": rows[0].choice.label,
                    "best_step_s": rows[0].time.step_s, "zero3_states_gib": z3.memory.states["total"] / 2**30,
                    "zeropp_states_gib": pp.memory.states["total"] / 2**30,
                    "hpz_gib": pp.memory.states["hpz_secondary"] / 2**30, "zeropp_fits": pp.fits,
                    "formula_gib": (16 * model.params / (nodes * 16) + 2 * model.params / 16) / 2**30})
    return out


def markdown(rows: list[dict[str, Any]], extra: list[dict[str, Any]], sens: list[dict[str, Any]]) -> str:
    lines = ["| setup | predicted ZeRO++ / ZeRO-3 | reported | difference | predicted TFLOP/s per GPU: ZeRO++ / "
             "ZeRO-3 | zeropp's own ZeRO-3 (all-to-all reduce-scatter): ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['ratio']:.2f}x | {r['reported']} | {r['difference']:+.0%} | "
                     f"{r['zeropp_tflops']:.1f} / {r['zero3_tflops']:.1f} | {r['zeropp_a2a_zero3_ratio']:.2f}x |")
    lines += ["", "| setup | parameters | plan's first choice | its step s | model states GiB/GPU: ZeRO-3 / ZeRO++ "
              "(hpZ part) | ZeRO++ formula (16M/N + 2M/s) GiB | ZeRO++ fits 32 GB |", "|---|---|---|---|---|---|---|"]
    for e in extra:
        lines.append(f"| {e['setup']} | {e['params'] / 1e9:.1f}B | {e['best']} | {e['best_step_s']:.2f} | "
                     f"{e['zero3_states_gib']:.2f} / {e['zeropp_states_gib']:.2f} ({e['hpz_gib']:.2f}) | "
                     f"{e['formula_gib']:.2f} | {'yes' if e['zeropp_fits'] else 'no'} |")
    keys = [k for k in sens[0] if k not in ("wire_efficiency", "tflops")]
    lines += ["", "| 18B, 384 V100: link efficiency, TFLOP/s | " + " | ".join(f"ratio at {k}" for k in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for r in sens:
        lines.append(f"| {r['wire_efficiency']:.2f}, {r['tflops']:g} | " + " | ".join(f"{r[k]:.2f}x" for k in keys)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    rows, extra, sens = projections(), tutorial_and_memory(), sensitivity()
    text = markdown(rows, extra, sens)
    print(text)
    write_results(os.path.join(args.out, "plan_projection.json"),
                  {"assumptions": {"v100_tflops": V100_TFLOPS, "nvswitch_gbps": NVSWITCH_GBPS, "seq_len": SEQ,
                                   "checkpointing": True, "gpus_per_node": 16}, "rows": rows, "extra": extra,
                   "sensitivity": sens})
    with open(os.path.join(args.out, "plan_projection.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
