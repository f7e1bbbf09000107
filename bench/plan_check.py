"""`zeropp plan` against measurement: predicted vs measured step times of zeropp's systems on the emulated cluster.

    sudo .venv/bin/python bench/plan_check.py            # calibrate + bench + compare (about 45 min here)
    .venv/bin/python bench/plan_check.py --results bench/results/cluster_bench.json --profile P.json

1. calibration (``zeropp plan --calibrate --cluster``) at every bandwidth, unless ``--profile`` gives one;
2. ``zeropp bench`` of zeropp's five systems (ZeRO-3, + qwZ, + hpZ, + qgZ, all three) at the same bandwidths,
   written as ``bench/results/plan_check_bench.*`` (the recorded cluster_bench.json is left alone), unless
   ``--results`` names an existing bench JSON;
3. the plan's prediction for each row (the bench's model, micro-batch, bucket size and node layout, the
   profile's fits for that bandwidth), the relative error of each, their median and worst, whether the plan's
   fastest system is the measured fastest at each bandwidth, and predicted model-state bytes against the
   bench's measured peak. Writes ``bench/results/plan_check.{json,md}`` (``--stem`` renames them).

Acceptance (issue 16): median |error| <= 15%, worst <= 30%, and the measured winner picked at each bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, write_results  # noqa: E402

from zeropp.tools.cluster_bench.catalog import SYSTEMS, ZEROPP_SWITCHES  # noqa: E402
from zeropp.tools.plan import Choice, demo_gpt, evaluate, from_profile, load_profile  # noqa: E402
from zeropp.tools.plan.calibrate import calibrate_cluster  # noqa: E402
from zeropp.tools.plan.ranking import TIE  # noqa: E402
from zeropp.tools.plan.schedule import Workload  # noqa: E402

OURS = list(ZEROPP_SWITCHES)  # zeropp_zero3, zeropp_qwz, zeropp_hpz, zeropp_qgz, zeropp_all
BANDWIDTHS = "unlimited,1gbit,200mbit,100mbit"


def choice_of(system: str, ranks_per_node: int) -> Choice:
    """The plan's configuration for a bench system (``cluster_bench.systems.zeropp_config``)."""
    qwz, hpz, qgz = ZEROPP_SWITCHES[system]
    return Choice(3, 8 if qwz else 0, ranks_per_node if hpz else 1, 4 if qgz else 0)


def links_only(hw: Any) -> Any:
    """``hw`` with free compute and host work: what the links alone would make the step (a diagnostic that does
    not depend on the measured machine's processors)."""
    fast = {8: 1e18, 4: 1e18}
    return replace(hw, flops=1e21, comm_uses_compute=False, quantize_per_s=fast, dequantize_per_s=fast,
                   optimizer_per_s=1e18, reduce_sum_per_s=1e18, copy_bytes_per_s=1e21, host_fits={})


def predict(result: dict[str, Any], profile: Any) -> list[dict[str, Any]]:
    """One line per measured row of our systems: measured and predicted step, error, memory."""
    meta = result["meta"]
    m = meta["model"]
    model = demo_gpt(m["n_layer"], m["n_embd"], m["n_head"], m["block_size"])
    work = Workload(micro_batch=meta["micro_batch"], seq_len=m["block_size"], grad_accum=1,
                    bucket=int(meta["train"]["bucket_elements"]), block=2048, bf16=True,
                    prefetch_bucket=50_000_000, max_live=1_000_000_000)  # the bench's config leaves the defaults
    lines = []
    for row in result["rows"]:
        if "error" in row or row["system"] not in OURS:
            continue
        hw = from_profile(profile, meta["nodes"], meta["ranks_per_node"], memory_gib=1e6,
                          link_label=row["bandwidth"] if row["bandwidth"] != "loopback" else None)
        choice = choice_of(row["system"], meta["ranks_per_node"])
        pred = evaluate(model, choice, hw, work)
        link = evaluate(model, choice, links_only(hw), work).time.step_s if hw.inter_bytes_per_s else None
        measured = row["median_step_s"]
        lines.append({
            "system": row["system"], "label": SYSTEMS[row["system"]][1], "bandwidth": row["bandwidth"],
            "measured_s": measured, "predicted_s": pred.time.step_s, "step_times_s": row["step_times_s"],
            "error": pred.time.step_s / measured - 1, "spread": (max(row["step_times_s"]) - min(row["step_times_s"]))
            / measured, "cpu_bound_s": pred.time.cpu_bound_s, "replayed_s": pred.time.replayed_s,
            "links_only_s": link, "links_only_error": link / measured - 1 if link else None,
            "predicted_state_bytes": pred.memory.states["total"], "predicted_need_bytes": pred.memory.need,
            "measured_state_bytes": row["model_state_bytes_peak"].get("total"),
        })
    return lines


def median_ratio_interval(a: list[float], b: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of ``median(a) / median(b)``, each sample resampled with replacement: whether one
    run's steps can tell two systems apart. (The systems ran one after the other, so drift of the machine's
    speed between them is not in the interval.)"""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(draws))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def winners(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for bw in dict.fromkeys(x["bandwidth"] for x in lines):
        here = [x for x in lines if x["bandwidth"] == bw]
        meas = min(here, key=lambda x: x["measured_s"])
        fastest = min(x["predicted_s"] for x in here)  # the plan's ranking: ties within TIE go to less memory
        pred = min((x for x in here if x["predicted_s"] <= fastest * (1 + TIE)),
                   key=lambda x: (x["predicted_need_bytes"], sum(ZEROPP_SWITCHES[x["system"]]), x["predicted_s"]))
        lo, hi = median_ratio_interval(pred["step_times_s"], meas["step_times_s"]) \
            if "step_times_s" in pred and pred is not meas else (1.0, 1.0)
        out.append({"bandwidth": bw, "measured_winner": meas["system"], "predicted_winner": pred["system"],
                    "match": meas["system"] == pred["system"],
                    "measured_gap": pred["measured_s"] / meas["measured_s"] - 1,
                    "gap_interval_95": [lo - 1, hi - 1], "separated": lo > 1})
    return out


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    errs = [abs(x["error"]) for x in lines]
    link = [abs(x["links_only_error"]) for x in lines if x["links_only_error"] is not None
            and x["bandwidth"] in ("200mbit", "100mbit")]
    return {"rows": len(lines), "median_abs_error": statistics.median(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None,
            "links_only_median_abs_error_200_100": statistics.median(link) if link else None,
            "links_only_worst_abs_error_200_100": max(link) if link else None,
            "memory_exact": all(x["predicted_state_bytes"] == x["measured_state_bytes"] for x in lines)}


def markdown(report: dict[str, Any]) -> str:
    s, lines = report["summary"], report["lines"]
    out = [f"Bench: `{report['bench_command']}` ({report['bench_date']}; {report['bench_machine']})  ",
           f"Profile: {report['profile_source']} ({report['profile_date']}; {report['profile_machine']})", "",
           "| system | bandwidth | measured s | predicted s | error | measured spread | links only s (error) | "
           "model states MiB: predicted / measured |", "|---|---|---|---|---|---|---|---|"]
    for x in lines:
        link = f"{x['links_only_s']:.3f} ({x['links_only_error']:+.1%})" if x["links_only_s"] else "-"
        out.append(f"| {x['label']} | {x['bandwidth']} | {x['measured_s']:.3f} | {x['predicted_s']:.3f} | "
                   f"{x['error']:+.1%} | {x['spread']:.0%} | {link} | {x['predicted_state_bytes'] / 2**20:.2f} / "
                   f"{(x['measured_state_bytes'] or 0) / 2**20:.2f} |")
    out += ["", f"Median |error| {s['median_abs_error']:.1%} (target <= 15%), worst {s['worst_abs_error']:.1%} "
            f"(target <= 30%) over {s['rows']} rows; model-state bytes predicted exactly: "
            f"{'yes' if s['memory_exact'] else 'no'}.", ""]
    if s["links_only_median_abs_error_200_100"] is not None:
        out += [f"Links only (compute and host work free), 200 and 100 Mbit/s rows: median |error| "
                f"{s['links_only_median_abs_error_200_100']:.1%}, worst {s['links_only_worst_abs_error_200_100']:.1%}.",
                ""]
    out += ["| bandwidth | measured fastest | plan's pick | match | pick's measured time over the fastest "
            "(95% bootstrap interval) | do this run's steps tell them apart? |", "|---|---|---|---|---|---|"]
    for w in report["winners"]:
        lo, hi = w.get("gap_interval_95", [float("nan")] * 2)
        gap = f"{w['measured_gap']:+.1%}" + ("" if w["match"] else f" ({lo:+.1%} to {hi:+.1%})")
        apart = "-" if w["match"] else ("yes" if w.get("separated") else "no: the interval includes 0")
        out.append(f"| {w['bandwidth']} | {SYSTEMS[w['measured_winner']][1]} | {SYSTEMS[w['predicted_winner']][1]}"
                   f" | {'yes' if w['match'] else '**no**'} | {gap} | {apart} |")
    return "\n".join(out) + "\n"


def run_bench(bandwidths: str, steps: int, fast_steps: int, out: str) -> str:
    cmd = [sys.executable, "-m", "zeropp.tools.cluster_bench.run", "--systems", ",".join(OURS), "--bandwidths",
           bandwidths, "--steps", str(steps), "--steps-per-bandwidth", f"unlimited={fast_steps},1gbit={fast_steps}",
           "--out", out, "--stem", "plan_check_bench"]
    print("plan_check: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return os.path.join(out, "plan_check_bench.json")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    p.add_argument("--results", default=None, help="compare with this bench JSON instead of running the bench")
    p.add_argument("--bandwidths", default=BANDWIDTHS)
    p.add_argument("--steps", type=int, default=8, help="timed steps per bandwidth in the bench (default 8)")
    p.add_argument("--fast-steps", type=int, default=32,
                   help="timed steps at unlimited and 1gbit, where a step takes under a second and the systems are "
                   "within a few percent of each other: 8 steps did not rank them (default 32)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--stem", default="plan_check", help="report names: STEM.json, STEM.md (default plan_check)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    profile_path = args.profile or os.path.join(args.out, "plan_profile.json")
    if args.profile is None:
        calibrate_cluster(2, 2, args.bandwidths.split(","), profile_path)
        print(f"plan_check: wrote {profile_path}", flush=True)
    profile = load_profile(profile_path)
    results_path = args.results or run_bench(args.bandwidths, args.steps, args.fast_steps, args.out)
    with open(results_path) as f:
        result = json.load(f)
    lines = predict(result, profile)
    report = {"bench": results_path, "bench_command": result["meta"]["command"], "bench_date": result["meta"]["date"],
              "bench_machine": result["meta"]["machine"], "profile": profile_path, "profile_source": profile.source,
              "profile_date": profile.date, "profile_machine": profile.machine, "lines": lines,
              "summary": summary(lines), "winners": winners(lines)}
    text = markdown(report)
    print(text)
    write_results(os.path.join(args.out, f"{args.stem}.json"), report)
    with open(os.path.join(args.out, f"{args.stem}.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
