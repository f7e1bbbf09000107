"""``zeropp bench``: every system, every bandwidth, on a simulated cluster; rows, a report and plots.

For each system the driver starts N x R ranks once (``zeropp.tools.cluster_bench.worker``) and walks them through the
bandwidths in order, re-shaping the links between phases while the ranks wait. Every run is bounded by
``--timeout``; the namespaces are deleted when the run ends, fails or is interrupted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import time
from typing import Any, Optional

from zeropp.tools.cluster_bench import report
from zeropp.tools.cluster_bench.cluster import Cluster, ClusterError, cleanup_prefix
from zeropp.tools.cluster_bench.catalog import SYSTEMS
from zeropp.tools.cluster_bench.models import MODELS, build_model, num_parameters

BANDWIDTHS = {"unlimited": None, "1gbit": "1gbit", "200mbit": "200mbit", "100mbit": "100mbit"}
DEFAULT_SYSTEMS = list(SYSTEMS)
#: The bench GPT: ~19.7M parameters, short sequences and a small micro-batch, so that compute per step is small
#: next to the 3 x 40 MB (bf16) that plain ZeRO-3 moves per step: link-bound at 200 Mbit/s.
BENCH_MODEL = {"n_layer": 4, "n_embd": 640, "n_head": 10, "block_size": 64}
TINY_MODEL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}


def parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="zeropp bench", description=__doc__.splitlines()[0])
    p.add_argument("--bandwidths", default="unlimited,1gbit,200mbit,100mbit",
                   help="comma-separated subset of: " + ", ".join(BANDWIDTHS) + " (default: all four)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated subset of: " + ", ".join(SYSTEMS) + " (default: all; DeepSpeed rows are "
                   "skipped with a note when deepspeed is not importable)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per bandwidth (default: 8)")
    p.add_argument("--steps-per-bandwidth", default="", metavar="BW=N,...",
                   help="timed steps at the named bandwidths instead of --steps, the same for every system (e.g. "
                   "unlimited=32,1gbit=32: fast steps are short and noisy, so take more of them)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each bandwidth's timed steps")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--model", choices=MODELS, default="demo",
                   help="demo: zeropp's GPT; hf-gpt2: transformers' GPT2LMHeadModel of the same shape (default: demo)")
    p.add_argument("--n-layer", type=int, default=BENCH_MODEL["n_layer"])
    p.add_argument("--n-embd", type=int, default=BENCH_MODEL["n_embd"])
    p.add_argument("--n-head", type=int, default=BENCH_MODEL["n_head"])
    p.add_argument("--block-size", type=int, default=BENCH_MODEL["block_size"])
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--bucket-elements", type=_bucket_elements, default=5_000_000, metavar="N",
                   help="gradient bucket size of every system, in elements (reduce_bucket_size, DDP's bucket_cap_mb; "
                        "default: 5000000), or 'default': each system's own default (no bucket keys)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="compute precision (default: bf16); fp32 only for the zeropp systems, for CPUs without "
                        "a bf16 matrix unit, where a bf16 step is compute-bound and hides the link")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke tests)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ledger-only", action="store_true",
                   help="all ranks in this namespace over loopback: no root needed, no shaping, no wire counters")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed per system, all bandwidths")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="output folder (default: bench/results)")
    p.add_argument("--stem", default="cluster_bench",
                   help="output file names: STEM.json, STEM.md, STEM_*.png (default: cluster_bench)")
    p.add_argument("--down", metavar="PREFIX", default=None,
                   help="only delete the namespaces PREFIX-* that a killed run left behind, and exit")
    return p


def _bucket_elements(text: str) -> Optional[int]:
    if text == "default":
        return None
    try:
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bucket-elements: a number of elements or 'default', got {text!r}")


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    import torch

    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Linux {platform.release()}, "
            f"torch {torch.__version__}, gloo")


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


class Progress:
    """One live status line on a terminal; plain lines (one per finished phase) otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self.tty = sys.stdout.isatty()

    def elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def status(self, text: str) -> None:
        if self.tty:
            print(f"\r\033[K[{self.done}/{self.total} {self.elapsed()}] {text}", end="", flush=True)

    def line(self, text: str) -> None:
        self.done += 1
        print(("\r\033[K" if self.tty else "") + f"[{self.done}/{self.total} {self.elapsed()}] {text}", flush=True)


class SystemRun:
    """Drives one system's ranks through the bandwidth phases (called from the cluster's wait loop)."""

    def __init__(self, cluster: Cluster, name: str, control: str, phases: list[str], progress: Progress) -> None:
        self.cluster, self.name, self.control, self.phases = cluster, name, control, phases
        self.progress = progress
        self.next_go, self.next_row = 0, 0
        self.rows: list[dict[str, Any]] = []

    def poll(self) -> None:
        k = self.next_go
        if k < len(self.phases) and os.path.exists(os.path.join(self.control, f"ready.{k}")):
            self.cluster.shape(BANDWIDTHS.get(self.phases[k]))  # "loopback" (ledger-only): nothing to shape
            with open(os.path.join(self.control, f"go.{k}"), "w") as f:
                f.write(self.phases[k])
            self.next_go += 1
        self.collect()
        if self.next_go and self.next_row < len(self.phases):
            self.progress.status(f"{SYSTEMS[self.name][1]} @ {self.phases[self.next_go - 1]}: {self._last_step()}")

    def _last_step(self) -> str:
        try:
            with open(os.path.join(self.control, "progress")) as f:
                last = f.read().split("\n")[-2].split()
            return f"step {last[1]} took {float(last[2]):.2f} s"
        except (OSError, IndexError, ValueError):
            return "warming up"

    def collect(self) -> None:
        while self.next_row < len(self.phases):
            path = os.path.join(self.control, f"row.{self.next_row}.json")
            if not os.path.exists(path):
                return
            with open(path) as f:
                row = json.load(f)
            self.rows.append(row)
            self.next_row += 1
            wire = row["wire"]["inter_node_bytes_per_step"] / 1e6 if row.get("wire") else None
            self.progress.line(f"{SYSTEMS[self.name][1]:<30} {row['bandwidth']:>9}: median step "
                               f"{row['median_step_s']:.3f} s, loss {row['loss']:.4f}"
                               + (f", wire {wire:.1f} MB/step" if wire is not None else ""))


def _log_tail(log_dir: str, lines: int = 12) -> str:
    tails = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            content = f.read().strip().splitlines()
        if content:
            tails.append(f"{name}: " + " | ".join(content[-lines:]))
    return "\n".join(tails)


def _error_summary(log_dir: str) -> str:
    """The most telling line of the ranks' logs (the last exception line), for the table."""
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "Exception" in ln]
        if errs:
            return f"{name}: {errs[-1][:300]}"
    return "no error line in the logs"


def build_spec(args: argparse.Namespace, phases: list[str], control_dir: str, wire: bool) -> dict[str, Any]:
    model = dict(TINY_MODEL) if args.tiny else {"n_layer": args.n_layer, "n_embd": args.n_embd,
                                                 "n_head": args.n_head, "block_size": args.block_size}
    model["kind"] = args.model
    return {"model": model, "seed": args.seed, "phases": phases, "warmup": args.warmup, "steps": args.steps,
            "steps_at": steps_per_phase(args, phases),
            "ranks_per_node": args.ranks_per_node, "control_dir": control_dir, "wire_counters": wire,
            "wait_timeout_s": args.timeout,
            "train": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0,
                      "micro_batch": args.micro_batch, "bucket_elements": args.bucket_elements,
                      "precision": args.precision}}


def snapshot_package(dest: str) -> str:
    """Copy the ``zeropp`` package the driver imported into ``dest``; return a short hash of its sources.

    Every system's ranks import this copy, so one run measures one version of the code even while the working
    tree is being edited (a full run takes half an hour).
    """
    import hashlib

    import zeropp

    src = os.path.dirname(os.path.abspath(zeropp.__file__))
    shutil.copytree(src, os.path.join(dest, "zeropp"), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(os.path.join(dest, "zeropp"))):
        dirs.sort()
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()[:12]


def _select(text: str, known: dict[str, Any], what: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in chosen if s not in known]
    if bad:
        raise SystemExit(f"zeropp bench: unknown {what}: {', '.join(bad)}; known: {', '.join(known)}")
    return chosen


def steps_per_phase(args: argparse.Namespace, phases: list[str]) -> dict[str, int]:
    """Timed steps at each phase: ``--steps``, or the count ``--steps-per-bandwidth`` names for it."""
    if args.steps < 1:
        raise SystemExit(f"zeropp bench: --steps must be at least 1, got {args.steps}")
    named: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in args.steps_per_bandwidth.split(","))):
        bw, _, count = item.partition("=")
        bw = bw.strip()
        if bw not in BANDWIDTHS and bw != "loopback":
            raise SystemExit(f"zeropp bench: --steps-per-bandwidth: unknown bandwidth {bw!r}; known: "
                             f"{', '.join(BANDWIDTHS)}, loopback (--ledger-only)")
        try:
            named[bw] = int(count)
        except ValueError:
            named[bw] = 0
        if named[bw] < 1:
            raise SystemExit(f"zeropp bench: --steps-per-bandwidth: {item!r} needs a whole number of steps >= 1")
    return {phase: named.get(phase, args.steps) for phase in phases}


def run_system(cluster: Cluster, name: str, spec_path: str, work: str, env: dict[str, str], progress: Progress,
               timeout_s: float) -> list[dict[str, Any]]:
    """One system through every phase: its rows, plus an error row if its ranks failed or ran out of time."""
    with open(spec_path) as f:
        spec = json.load(f)
    phases = spec["phases"]
    control = os.path.join(spec["control_dir"], name)
    os.makedirs(control, exist_ok=True)
    log_dir = os.path.join(work, "logs", name)
    driver = SystemRun(cluster, name, control, phases, progress)
    cluster.shape(None)
    ranks = cluster.launch([sys.executable, "-m", "zeropp.tools.cluster_bench.worker", spec_path, name], log_dir, env=env)
    error = None
    try:
        codes = cluster.wait(ranks, timeout_s, driver.poll)
        if any(codes):
            error = f"exit codes {codes}; {_error_summary(log_dir)}"
    except ClusterError as err:
        error = f"{err}; {_error_summary(log_dir)}"
    driver.collect()
    rows = list(driver.rows)
    if error:
        print(f"\nzeropp bench: {SYSTEMS[name][1]} failed: {error}\n{_log_tail(log_dir)}", flush=True)
        rows.append({"system": name, "error": error})
        progress.done += len(phases) - len(driver.rows)
    return rows


def run(args: argparse.Namespace, argv_text: str) -> dict[str, Any]:
    """Every system at every bandwidth; writes the report files and returns ``{meta, rows, targets}``."""
    bandwidths = _select(args.bandwidths, BANDWIDTHS, "bandwidth")
    systems = _select(args.systems, SYSTEMS, "system")
    others = [s for s in systems if SYSTEMS[s][0] != "zeropp"]
    if args.precision != "bf16" and others:
        raise SystemExit(f"zeropp bench: --precision {args.precision} runs the zeropp systems only; drop "
                         f"{', '.join(others)} from --systems")
    systems, skipped = _drop_unavailable(systems)
    cluster = Cluster(args.nodes, args.ranks_per_node, namespaces=not args.ledger_only)
    if cluster.namespaces:
        mode = "network namespaces + tc tbf"
        phases = bandwidths
    else:
        mode = "ledger-only (loopback)"
        phases = ["loopback"]
        print(f"zeropp bench: {cluster.why_local}: running in ledger-only mode: all {cluster.world_size} ranks in "
              "this namespace over loopback, no link shaping, no wire counters; step times are not link-bound. "
              "Run as root for the simulated cluster.", flush=True)
    work = os.path.join(os.path.abspath(args.out), "tmp", cluster.prefix)
    spec = build_spec(args, phases, os.path.join(work, "control"), cluster.namespaces)
    os.makedirs(work, exist_ok=True)
    code_hash = snapshot_package(os.path.join(work, "code"))
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    params = num_parameters(build_model(spec["model"]))
    meta: dict[str, Any] = {
        "command": argv_text, "date": datetime.date.today().isoformat(), "machine": machine(), "mode": mode,
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "bandwidths": phases, "systems": systems,
        "skipped": skipped, "model": spec["model"], "parameters": params, "micro_batch": args.micro_batch,
        "bucket_elements": args.bucket_elements,
        "warmup": args.warmup, "steps": args.steps, "steps_at": spec["steps_at"], "train": spec["train"],
        "load_start": _load(),
        "code_sha256_12": code_hash,
    }
    rows: list[dict[str, Any]] = []
    progress = Progress(len(systems) * len(phases))
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.path.join(os.path.abspath(args.out), "tmp",
                                                                         "torch_extensions"),
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(work, "code"), os.environ.get("PYTHONPATH")]))}
    # SIGTERM/SIGHUP raise, so that leaving `with cluster` deletes the namespaces and ends the ranks.
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with cluster:
            if cluster.namespaces:
                meta["links"] = (f"{args.nodes} node namespaces on a bridge, tc tbf on both ends of each link "
                                 "(burst 256kb); no added latency: "
                                 + ("netem is available but not used" if cluster.netem else
                                    "this kernel has no netem qdisc, so latency cannot be emulated"))
            else:
                meta["links"] = "loopback only (ledger-only mode)"
            print(f"zeropp bench: GPT {params:,} parameters, {args.nodes} nodes x {args.ranks_per_node} ranks, "
                  f"{mode}; bandwidths {', '.join(phases)}; {args.warmup} warm-up + {report.steps_text(meta)} "
                  f"timed steps; {len(systems)} systems. {meta['links']}.", flush=True)
            for name in systems:
                rows += run_system(cluster, name, spec_path, work, env, progress, args.timeout)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(os.path.join(work, "code"), ignore_errors=True)  # the logs stay when the run did not finish
    meta["load_end"] = _load()
    result = {"meta": meta, "rows": rows}
    result["targets"] = report.targets(rows, phases)
    paths = report.write(result, args.out, args.stem)
    if any("error" in r for r in rows):
        print(f"zeropp bench: the failed systems' logs are in {os.path.join(work, 'logs')}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(report.markdown(result))
    print("wrote " + ", ".join(paths), flush=True)
    return result


def _drop_unavailable(systems: list[str]) -> tuple[list[str], dict[str, str]]:
    """The systems that can run here, and why each other one is skipped (DeepSpeed not installed)."""
    skipped: dict[str, str] = {}
    if any(SYSTEMS[s][0] == "deepspeed" for s in systems):
        from zeropp.tools.cluster_bench.systems import deepspeed_available

        ok, why = deepspeed_available()
        if not ok:
            skipped = {s: why + "; install the optional extra: DS_BUILD_OPS=0 pip install deepspeed==0.19.8"
                       for s in systems if SYSTEMS[s][0] == "deepspeed"}
            systems = [s for s in systems if s not in skipped]
            print(f"zeropp bench: DeepSpeed rows skipped: {why}", flush=True)
    return systems, skipped


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[list[str]] = None, prog_args: Optional[argparse.Namespace] = None) -> int:
    args = prog_args or parser().parse_args(argv)
    if args.down:
        print("deleted:", " ".join(cleanup_prefix(args.down)) or "nothing")
        return 0
    text = "zeropp bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    run(args, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
