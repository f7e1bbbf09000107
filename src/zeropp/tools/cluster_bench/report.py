"""Turn ``zeropp bench`` rows into the JSON file, a markdown report with the target ratios, and two PNG plots."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from zeropp.tools.cluster_bench.catalog import NOT_RUNNABLE, SYSTEMS

PHASES = ("forward_gather", "backward_gather", "grad_reduce", "other")
MB = 1e6
ZEROPP = "zeropp_all"  # "ZeRO++" in the targets: all three techniques


def find(rows: list[dict[str, Any]], system: str, bandwidth: str) -> Optional[dict[str, Any]]:
    for r in rows:
        if "error" not in r and r["system"] == system and r["bandwidth"] == bandwidth:
            return r
    return None


def _buckets(elements: Optional[int]) -> str:
    return "default-sized" if elements is None else f"{elements:,}-element"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _step(rows: list[dict[str, Any]], system: str, bw: str) -> Optional[float]:
    r = find(rows, system, bw)
    return r["median_step_s"] if r else None


def _wire(rows: list[dict[str, Any]], system: str, bw: str) -> Optional[float]:
    r = find(rows, system, bw)
    return r["wire"]["inter_node_bytes_per_step"] if r and r.get("wire") else None


def ledger_inter(row: Optional[dict[str, Any]], phase: Optional[str] = None) -> Optional[int]:
    if not row or not row.get("ledger"):
        return None
    table = row["ledger"]["all_ranks"]
    return sum(table[p]["inter_node_bytes"] for p in table if phase is None or p == phase)


def targets(rows: list[dict[str, Any]], bandwidths: list[str], slow: str = "200mbit",
            fast: str = "unlimited") -> list[dict[str, Any]]:
    """The issue's targets as measured ratios: ``{name, value, target, op, met}`` (value None when not measured)."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: Optional[float], target: float, op: str = "<=") -> None:
        met = None if value is None else (value <= target if op == "<=" else value == target)
        out.append({"name": name, "value": value, "target": target, "op": op, "met": met})

    fast = fast if fast in bandwidths or not bandwidths else bandwidths[0]
    wire_bw = slow if slow in bandwidths else (bandwidths[-1] if bandwidths else slow)
    add(f"{slow}: ZeRO++ step / zeropp ZeRO-3 step",
        _ratio(_step(rows, ZEROPP, slow), _step(rows, "zeropp_zero3", slow)), 0.45)
    add(f"{slow}: ZeRO++ step / FSDP2 step", _ratio(_step(rows, ZEROPP, slow), _step(rows, "fsdp2", slow)), 0.5)
    add(f"{slow}: ZeRO++ step / DeepSpeed ZeRO-3 step",
        _ratio(_step(rows, ZEROPP, slow), _step(rows, "ds_zero3", slow)), 0.5)
    add(f"{wire_bw}: inter-node wire bytes ZeRO++ / zeropp ZeRO-3",
        _ratio(_wire(rows, ZEROPP, wire_bw), _wire(rows, "zeropp_zero3", wire_bw)), 0.3)
    ref = next((r for r in rows if r["system"] == ZEROPP and "error" not in r), None)
    z3 = next((r for r in rows if r["system"] == "zeropp_zero3" and "error" not in r), None)
    add("ledger inter-node bytes ZeRO++ / zeropp ZeRO-3", _ratio(ledger_inter(ref), ledger_inter(z3)), 0.3)
    hpz = next((r for r in rows if r["system"] == "zeropp_hpz" and "error" not in r), None)
    add("hpZ backward gather inter-node bytes (ledger, all ranks)", ledger_inter(hpz, "backward_gather"), 0, "==")
    add(f"{fast}: ZeRO++ step / zeropp ZeRO-3 step",
        _ratio(_step(rows, ZEROPP, fast), _step(rows, "zeropp_zero3", fast)), 1.15)
    for name, label in ((ZEROPP, "ZeRO++"), ("zeropp_all_w4", "ZeRO++ 4-bit qwZ")):
        for bw, bound in (("200mbit", 1.2), ("100mbit", 1.5)):  # issue 17: the slow link hidden behind compute
            if bw in bandwidths and bw != fast and (name == ZEROPP or find(rows, name, bw)):
                add(f"{label} step at {bw} / {label} step at {fast}", _ratio(_step(rows, name, bw),
                                                                           _step(rows, name, fast)), bound)
    for bw in bandwidths:
        add(f"{bw}: zeropp ZeRO-3 step / FSDP2 step",
            _ratio(_step(rows, "zeropp_zero3", bw), _step(rows, "fsdp2", bw)), 1.1)
        add(f"{bw}: zeropp ZeRO-3 step / DeepSpeed ZeRO-3 step",
            _ratio(_step(rows, "zeropp_zero3", bw), _step(rows, "ds_zero3", bw)), 1.0)
        # the host cost per unit (bench/bench_host_cost.py's model): at most twice DDP's step
        add(f"{bw}: zeropp ZeRO-3 step / DDP step", _ratio(_step(rows, "zeropp_zero3", bw), _step(rows, "ddp", bw)),
            2.0)
    last = bandwidths[-1] if bandwidths else None
    if last:
        base = find(rows, "ddp", last) or find(rows, "zeropp_zero3", last)
        plain = [s for s in ("ddp", "fsdp2", "fsdp2_hpz", "ds_zero3", "ds_zero3_hpz", "ds_zero3_prefetch",
                             "zeropp_zero3", "zeropp_hpz") if find(rows, s, last)]
        if base and plain:
            spread = max(abs(find(rows, s, last)["loss"] / base["loss"] - 1) for s in plain)
            out.append({"name": f"loss spread of the unquantized systems after the run (max |rel. diff| to "
                                f"{base['system']}; bf16 noise)", "value": spread, "target": None, "op": "info",
                        "met": None})
        zpp, z3l = find(rows, ZEROPP, last), find(rows, "zeropp_zero3", last)
        add("ZeRO++ loss vs zeropp ZeRO-3 after the run, |relative difference|",
            abs(zpp["loss"] / z3l["loss"] - 1) if zpp and z3l else None, 0.02)
    return out


def _fmt(v: Optional[float], digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}"


def steps_text(meta: dict[str, Any]) -> str:
    """``8``, or ``8 (unlimited: 32, 1gbit: 32)`` when some bandwidths ran another count."""
    other = {bw: n for bw, n in (meta.get("steps_at") or {}).items() if n != meta["steps"]}
    return str(meta["steps"]) + (f" ({', '.join(f'{bw}: {n}' for bw, n in other.items())})" if other else "")


def markdown(result: dict[str, Any]) -> str:
    rows, meta = result["rows"], result["meta"]
    bws = meta["bandwidths"]
    systems = [s for s in meta["systems"]]
    lines = [f"# zeropp bench: {meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['mode']}", "",
             f"Command: `{meta['command'].strip()}`  ", f"Date: {meta['date']}; machine: {meta['machine']}; zeropp sources sha256[:12] "
             f"{meta.get('code_sha256_12', '-')} (the copy every rank imported)  ",
             f"Model: GPT {meta['parameters']:,} parameters ({meta['model']}), micro-batch {meta['micro_batch']} "
             f"x {meta['model']['block_size']} tokens per rank, {_buckets(meta.get('bucket_elements', 5_000_000))} "
             f"gradient buckets, {meta['train'].get('precision', 'bf16')}, AdamW, {meta['warmup']} warm-up + "
             f"{steps_text(meta)} timed steps per bandwidth (training continues across bandwidths, same order for "
             "every system).  ", f"Links: {meta['links']}  ",
             f"Load average at start / end: {meta['load_start']} / {meta.get('load_end', '-')}", ""]
    lines += ["## Median step time (s)", "", "| system | " + " | ".join(bws) + " |",
              "|---|" + "---|" * len(bws)]
    for s in systems:
        cells = []
        for bw in bws:
            r = find(rows, s, bw)
            err = next((x for x in rows if x["system"] == s and "error" in x), None)
            cells.append(_fmt(r["median_step_s"]) if r else ("failed" if err else "-"))
        lines.append(f"| {SYSTEMS[s][1]} | " + " | ".join(cells) + " |")
    for label, why in NOT_RUNNABLE.items():
        lines.append(f"| {label} | {why} |" + " |" * (len(bws) - 1))
    for s, why in meta.get("skipped", {}).items():
        lines.append(f"| {SYSTEMS[s][1]} | skipped: {why} |" + " |" * (len(bws) - 1))
    ref_bw = "200mbit" if "200mbit" in bws else bws[-1]
    lines += ["", f"## Bytes per step, memory and loss (bytes at {ref_bw})", "",
              "Wire = sum over nodes of eth0 tx bytes per timed step (veth counters; headers and acks included). "
              "Ledger = bytes received by all ranks per step, from `engine.comm_report()` (zeropp only). "
              "Memory = peak over warm-up samples (after forward, after backward, after step) of the model-state "
              "tensors one rank holds, max over ranks.", "",
              "| system | wire inter-node MB | ledger inter-node MB | ledger intra-node MB | fwd / bwd / reduce "
              "inter MB (ledger) | peak model state MiB/rank | loss after run |",
              "|---|---|---|---|---|---|---|"]
    for s in systems:
        r = find(rows, s, ref_bw) or next((x for x in rows if x["system"] == s and "error" not in x), None)
        last = find(rows, s, bws[-1])
        if not r:
            continue
        wire = r["wire"]["inter_node_bytes_per_step"] / MB if r.get("wire") else None
        led = r["ledger"]["all_ranks"] if r.get("ledger") else None
        inter = sum(v["inter_node_bytes"] for v in led.values()) / MB if led else None
        intra = sum(v["intra_node_bytes"] for v in led.values()) / MB if led else None
        split = " / ".join(_fmt(led[p]["inter_node_bytes"] / MB, 2) for p in PHASES[:3]) if led else "-"
        mem = r["model_state_bytes_peak"].get("total", 0) / 2**20
        lines.append(f"| {SYSTEMS[s][1]} | {_fmt(wire, 2)} | {_fmt(inter, 2)} | {_fmt(intra, 2)} | {split} | "
                     f"{mem:.1f} | {_fmt(last['loss'] if last else None, 4)} |")
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Failures", ""]
        lines += [f"- {SYSTEMS[r['system']][1]}: {r['error']}" for r in errors]
    lines += ["", "## Targets (measured ratios, this run)", "", "| quantity | measured | target | met |",
              "|---|---|---|---|"]
    for t in result["targets"]:
        target = "-" if t["target"] is None else f"{t['op']} {t['target']}"
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['name']} | {_fmt(t['value'])} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out_dir: str, stem: str) -> list[str]:
    """Step time vs bandwidth per system, and bytes per step (stacked by phase and link) per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows, meta = result["rows"], result["meta"]
    bws, systems = meta["bandwidths"], meta["systems"]
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in systems:
        pts = [(i, find(rows, s, bw)["median_step_s"]) for i, bw in enumerate(bws) if find(rows, s, bw)]
        if pts:
            style = "-o" if s.startswith("zeropp") else "--s"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=SYSTEMS[s][1],
                    linewidth=3 if s == ZEROPP else 1.5)
    ax.set_xticks(range(len(bws)), bws)
    ax.set_yscale("log")
    ax.set_xlabel("inter-node link (tc tbf, per node, full duplex)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"{meta['nodes']}x{meta['ranks_per_node']} ranks, GPT {meta['parameters'] / 1e6:.1f}M, "
                 f"{meta['mode']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}_step_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    ref_bw = "200mbit" if "200mbit" in bws else bws[-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6.5))
    zsys = [s for s in systems if find(rows, s, ref_bw) and find(rows, s, ref_bw).get("ledger")]
    colors = {"forward_gather": "tab:blue", "backward_gather": "tab:orange", "grad_reduce": "tab:green",
              "other": "tab:gray"}
    for i, s in enumerate(zsys):
        led = find(rows, s, ref_bw)["ledger"]["all_ranks"]
        bottom = 0.0
        for p in PHASES:
            for link, hatch in (("inter_node_bytes", ""), ("intra_node_bytes", "//")):
                v = led[p][link] / MB
                label = f"{p} {link.split('_')[0]}-node" if i == 0 else None
                ax1.bar(i, v, bottom=bottom, color=colors[p], hatch=hatch, edgecolor="white", label=label)
                bottom += v
    ax1.set_xticks(range(len(zsys)), [SYSTEMS[s][1].replace("zeropp ", "") for s in zsys], rotation=20,
                   fontsize=8)
    ax1.set_ylabel("MB per step, received by all ranks (ledger)")
    ax1.set_title("zeropp ledger by phase and link (hatched: intra-node)")
    ax1.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    wsys = [s for s in systems if find(rows, s, ref_bw) and find(rows, s, ref_bw).get("wire")]
    vals = [find(rows, s, ref_bw)["wire"]["inter_node_bytes_per_step"] / MB for s in wsys]
    ax2.bar(range(len(wsys)), vals, color=["tab:purple" if s.startswith("zeropp") else "tab:brown" for s in wsys])
    ax2.set_xticks(range(len(wsys)), [SYSTEMS[s][1] for s in wsys], rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("MB per step (sum of the nodes' eth0 tx)")
    ax2.set_title(f"inter-node wire bytes per step at {ref_bw} (veth counters)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}_bytes.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(result: dict[str, Any], out_dir: str, stem: str = "cluster_bench") -> list[str]:
    """``STEM.json``, ``STEM.md`` and the plots in ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    return paths + plots(result, out_dir, stem)


# python -m zeropp.tools.cluster_bench.report bench/results/cluster_bench.json: redo the .md and plots
if __name__ == "__main__":
    import sys

    path = sys.argv[1]
    with open(path) as f:
        saved = json.load(f)
    saved["targets"] = targets(saved["rows"], saved["meta"]["bandwidths"])
    stem = os.path.splitext(os.path.basename(path))[0]
    print("\n".join(write(saved, os.path.dirname(path) or ".", stem)))
