"""Run the DeepSpeed-derived cases against zeropp's alias or the real DeepSpeed, one case at a time.

    .venv/bin/python bench/deepspeed_cases/run.py --impl zeropp
    DS_ACCELERATOR=cpu <a python with deepspeed==0.19.8> bench/deepspeed_cases/run.py --impl deepspeed
    ... [--only PATTERN] [--out FILE] [--timeout 120] [--list]

Each case runs in a fresh gloo process group of its world size (one subprocess per rank, MASTER_ADDR=127.0.0.1,
a free port each time). Results: bench/results/deepspeed_cases_{impl}.json.
"""
import argparse
import re
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXT_DIR = os.path.join(tempfile.gettempdir(), f"ds_cases_ext_{os.getuid()}")
MODULES = ["cases_zero", "cases_zero_train", "cases_context", "cases_leaf", "cases_fragment", "cases_misc",
           "cases_grad_clip", "cases_zeropp", "cases_partitioning"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_cases():
    sys.path.insert(0, HERE)
    for m in MODULES:
        importlib.import_module(m)
    from common import CASES
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    return [(fn.__module__, name, world) for name, world, fn, _kw in CASES]


def run_case(impl, module, name, world, timeout):
    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        procs, files = [], []
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   TORCH_EXTENSIONS_DIR=EXT_DIR)  # DeepSpeed builds its small shm op here once (g++)
        for r in range(world):
            f = os.path.join(tmp, f"r{r}.json")
            files.append(f)
            log = open(os.path.join(tmp, f"r{r}.log"), "w")
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), impl, module, name,
                                           str(r), str(world), port, f], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=tmp, start_new_session=True))
        deadline = time.time() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        ranks = []
        for r, f in enumerate(files):
            if os.path.exists(f):
                with open(f) as fh:
                    ranks.append(json.load(fh))
            else:
                with open(os.path.join(tmp, f"r{r}.log")) as fh:
                    tail = fh.read()[-1500:]
                ranks.append({"status": "error", "exception": "timeout" if timed_out else
                              f"rank {r} died (exit {procs[r].returncode})", "line": "", "traceback": tail})
    # the case's result: the first rank that did not pass (rank 0 first)
    bad = [x for x in ranks if x["status"] != "pass"]
    res = dict(bad[0]) if bad else {"status": "pass"}
    if bad:
        res["ranks_failed"] = [i for i, x in enumerate(ranks) if x["status"] != "pass"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["zeropp", "deepspeed"], required=True)
    ap.add_argument("--only", default=None, help="fnmatch pattern (or substring) on case names")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--module", action="append", help="only the cases of this cases_*.py module (repeatable)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the cases already in --out, run the others")
    a = ap.parse_args()
    cases = all_cases()
    n_all = len(cases)
    if a.module:
        cases = [c for c in cases if c[0] in a.module]
    if a.only:
        rx = re.compile(".*".join(re.escape(p) for p in a.only.split("*")))
        cases = [c for c in cases if rx.search(c[1])]
    if a.list:
        for m, n, w in cases:
            print(f"{m}:{n} world={w}")
        print(len(cases), "cases")
        return
    out = a.out or os.path.join(HERE, "..", "results", f"deepspeed_cases_{a.impl}.json")
    results = {}
    totals = {}
    if a.resume and os.path.exists(out):
        with open(out) as f:
            results = json.load(f)["cases"]
        known = {c[1] for c in all_cases()}  # every defined case, not only this run's selection
        results = {k: v for k, v in results.items() if k in known}
        cases = [c for c in cases if c[1] not in results]
    t0 = time.time()
    for i, (m, n, w) in enumerate(cases):
        t = time.time()
        r = run_case(a.impl, m, n, w, a.timeout)
        r["seconds"] = round(time.time() - t, 1)
        r["world_size"] = w
        r["module"] = m
        results[n] = r
        msg = r["status"] + ("" if r["status"] == "pass" else f"  {r.get('exception', '')} @ {r.get('line', '')}")
        print(f"[{i + 1}/{len(cases)}] {n} ({w}): {msg}", flush=True)
        totals = {s: sum(1 for x in results.values() if x["status"] == s) for s in ("pass", "fail", "error")}
        with open(out, "w") as f:
            json.dump({"impl": a.impl, "python": sys.executable, "complete": len(results) == n_all,
                       "totals": totals, "n": len(results), "n_defined": n_all, "seconds": round(time.time() - t0, 1),
                       "cases": results}, f, indent=1)
    print("totals", totals, "of", len(cases))


if __name__ == "__main__":
    main()
